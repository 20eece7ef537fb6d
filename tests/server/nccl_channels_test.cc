// NcclChannels without a GPU (server/nccl_channels.h): the sequence gate, transfer plans from
// requests alone, ownership, posting order, and every way a channel ends (bad sequence numbers,
// a gap or transfer past the timeout, a communicator error, the session's end), with a fake link
// that records what would have been posted.
#include "server/nccl_channels.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"

namespace moe::server {
namespace {

using std::chrono::milliseconds;

TEST(SequenceGateTest, AdmitsInOrderAndHoldsEarlyArrivals) {
  SequenceGate<int> gate(4);
  absl::StatusOr<std::vector<int>> r = gate.Offer(2, 20);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->empty());
  EXPECT_TRUE(gate.holding());
  r = gate.Offer(3, 30);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->empty());
  r = gate.Offer(1, 10);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (std::vector<int>{10, 20, 30}));
  EXPECT_FALSE(gate.holding());
  EXPECT_EQ(gate.next(), 4u);
}

TEST(SequenceGateTest, RefusesReusedAndFarAheadNumbers) {
  SequenceGate<int> gate(2);
  ASSERT_TRUE(gate.Offer(1, 1).ok());
  absl::StatusOr<std::vector<int>> r = gate.Offer(1, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "nccl.seq")) << r.status();
  ASSERT_TRUE(gate.Offer(3, 3).ok());
  EXPECT_EQ(gate.Offer(3, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gate.Offer(5, 5).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(gate.TakeHeld(), (std::vector<int>{3}));
  EXPECT_FALSE(gate.holding());
}

v1::Tensor Header(v1::DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t e : shape) t.add_shape(e);
  return t;
}

TEST(NcclPlanTest, ForwardSizesComeFromTheRequest) {
  v1::ForwardRequest r;
  *r.mutable_x() = Header(v1::DTYPE_BFLOAT16, {24, 16});
  *r.mutable_expert_ids() = Header(v1::DTYPE_INT32, {24, 2});
  absl::StatusOr<NcclPlan> plan = PlanForward(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->inputs.size(), 3u);
  EXPECT_EQ(plan->inputs[0].bytes, 24 * 16 * 2);
  EXPECT_EQ(plan->inputs[1].bytes, 24 * 2 * 4);
  EXPECT_FALSE(plan->inputs[2].present);
  ASSERT_EQ(plan->outputs.size(), 1u);
  EXPECT_EQ(plan->outputs[0].bytes, 24 * 16 * 2);
  EXPECT_EQ(plan->outputs[0].shape, (std::vector<int64_t>{24, 16}));
}

TEST(NcclPlanTest, ForwardRefusesBytesReferencesAndOtherTransports) {
  auto refused = [](const v1::ForwardRequest& r, const char* field) {
    absl::StatusOr<NcclPlan> plan = PlanForward(r);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(absl::StartsWith(plan.status().message(), field)) << plan.status();
  };
  v1::ForwardRequest r;
  refused(r, "x");
  *r.mutable_x() = Header(v1::DTYPE_FLOAT32, {4, 8});
  r.mutable_x()->set_data(std::string(128, '\0'));
  refused(r, "x");
  *r.mutable_x() = Header(v1::DTYPE_FLOAT32, {4, 8});
  *r.mutable_weights() = Header(v1::DTYPE_FLOAT32, {4, 2});
  r.mutable_weights()->mutable_ref()->set_region_id(7);
  refused(r, "weights");
  r.clear_weights();
  r.mutable_out_ref()->set_region_id(7);
  refused(r, "out_ref");
  r.clear_out_ref();
  r.set_event_id(3);
  refused(r, "event_id");
  r.set_event_id(0);
  r.mutable_stripe()->set_count(2);
  refused(r, "stripe");
  r.clear_stripe();
  *r.mutable_x() = Header(v1::DTYPE_FLOAT32, {int64_t{1} << 40, int64_t{1} << 20});
  refused(r, "x.shape");
  *r.mutable_x() = Header(v1::DTYPE_UNSPECIFIED, {4, 8});
  refused(r, "x.dtype");
}

TEST(NcclPlanTest, BackwardTakesDweightsOnlyWhenAsked) {
  v1::BackwardRequest r;
  *r.mutable_dout() = Header(v1::DTYPE_FLOAT32, {10, 16});
  absl::StatusOr<NcclPlan> plan = PlanBackward(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->outputs.size(), 2u);
  EXPECT_EQ(plan->outputs[0].bytes, 10 * 16 * 4);
  EXPECT_FALSE(plan->outputs[1].present);
  r.mutable_nccl()->set_dweights_k(3);
  plan = PlanBackward(r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->outputs[1].present);
  EXPECT_EQ(plan->outputs[1].bytes, 10 * 3 * 4);
  r.mutable_nccl()->set_dweights_k(-1);
  EXPECT_EQ(PlanBackward(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.mutable_nccl()->set_dweights_k(2);
  r.mutable_dx_ref()->set_region_id(1);
  plan = PlanBackward(r);
  EXPECT_TRUE(absl::StartsWith(plan.status().message(), "dx_ref")) << plan.status();
}

// Transfers posted on the fake link complete when the test says so (or never).
class FakeCompletion : public NcclCompletion {
 public:
  explicit FakeCompletion(std::shared_ptr<std::atomic<bool>> done) : done_(std::move(done)) {}
  absl::Status Query() const override {
    return *done_ ? absl::OkStatus() : absl::UnavailableError("pending");
  }

 private:
  std::shared_ptr<std::atomic<bool>> done_;
};

struct FakeLinkLog {
  std::mutex mu;
  std::vector<std::vector<int64_t>> receives;  // byte counts of each Receive, in post order
  std::vector<std::vector<int64_t>> sends;
  std::vector<bool> zeroed;
  std::atomic<bool> complete{true};  // transfers complete at once
  std::atomic<int> aborts{0};
  absl::Status poll = absl::OkStatus();
  // While set, Abort waits for ReleaseAborts (an ncclCommAbort that waits on the driver).
  bool aborts_block = false;
  std::condition_variable aborts_released;
  // When set, Abort waits (5 s at most) until this many aborts have begun, as an abort that
  // frees memory waits for other links' kernels, which stop only at their own abort; the
  // aborts that gave up are counted.
  int abort_quorum = 0;
  int quorum_missed = 0;

  void ReleaseAborts() {
    std::lock_guard<std::mutex> lock(mu);
    aborts_block = false;
    aborts_released.notify_all();
  }
};

// Whether the link was aborted within 5 s (an ended channel's link is aborted off the caller's
// thread).
bool AbortedSoon(const FakeLinkLog& log) {
  for (int i = 0; i < 500 && log.aborts == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return log.aborts > 0;
}

class FakeLink : public NcclLink {
 public:
  explicit FakeLink(std::shared_ptr<FakeLinkLog> log) : log_(std::move(log)) {}
  MemoryLocation location() const override { return MemoryLocation::Cuda(1); }
  const std::string& to_server_id() const override { return id_; }
  const std::string& to_client_id() const override { return id_; }
  absl::Status Poll() override {
    std::lock_guard<std::mutex> lock(log_->mu);
    return log_->poll;
  }
  absl::StatusOr<NcclBuffer> Acquire(int64_t bytes) override {
    buffers_.push_back(std::make_unique<char[]>(bytes + 1));
    return NcclBuffer{buffers_.back().get(), bytes};
  }
  void Release(NcclBuffer) override {}
  absl::StatusOr<std::unique_ptr<NcclCompletion>> Receive(
      absl::Span<const NcclBuffer> into) override {
    return Record(into, &log_->receives);
  }
  absl::StatusOr<std::unique_ptr<NcclCompletion>> Send(absl::Span<const NcclBuffer> from,
                                                       bool zero, void*) override {
    {
      std::lock_guard<std::mutex> lock(log_->mu);
      log_->zeroed.push_back(zero);
    }
    return Record(from, &log_->sends);
  }
  void* compute_done_event() override { return nullptr; }
  void Abort() override {
    ++log_->aborts;
    std::unique_lock<std::mutex> lock(log_->mu);
    log_->aborts_released.notify_all();
    log_->aborts_released.wait(lock, [this] { return !log_->aborts_block; });
    if (log_->abort_quorum > 0 &&
        !log_->aborts_released.wait_for(lock, std::chrono::seconds(5), [this] {
          return log_->aborts >= log_->abort_quorum;
        })) {
      ++log_->quorum_missed;
    }
  }

 private:
  absl::StatusOr<std::unique_ptr<NcclCompletion>> Record(absl::Span<const NcclBuffer> b,
                                                         std::vector<std::vector<int64_t>>* to) {
    std::vector<int64_t> sizes;
    for (const NcclBuffer& x : b) sizes.push_back(x.bytes);
    std::lock_guard<std::mutex> lock(log_->mu);
    to->push_back(sizes);
    auto done = std::make_shared<std::atomic<bool>>(log_->complete.load());
    return std::unique_ptr<NcclCompletion>(new FakeCompletion(done));
  }
  std::shared_ptr<FakeLinkLog> log_;
  std::string id_ = std::string(kNcclUniqueIdBytes, 'i');
  std::vector<std::unique_ptr<char[]>> buffers_;
};

// What became of the batches a test submitted: received (with the order) or failed.
struct Outcomes {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> received;
  std::vector<std::pair<int, absl::Status>> failed;

  NcclChannels::Batch Batch(int tag, int64_t bytes) {
    NcclChannels::Batch b;
    NcclPlan::Part p;
    p.present = true;
    p.shape = {bytes / 4};
    p.bytes = bytes;
    b.plan.inputs = {p};
    b.plan.outputs = {p};
    b.received = [this, tag](NcclChannels::Received) {
      std::lock_guard<std::mutex> lock(mu);
      received.push_back(tag);
      cv.notify_all();
    };
    b.failed = [this, tag](absl::Status st) {
      std::lock_guard<std::mutex> lock(mu);
      failed.emplace_back(tag, st);
      cv.notify_all();
    };
    return b;
  }
  // Waits until `n` batches have an outcome.
  bool Wait(size_t n, milliseconds timeout = milliseconds(5000)) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return received.size() + failed.size() >= n; });
  }
};

class NcclChannelsTest : public ::testing::Test {
 protected:
  void Make(NcclChannelsOptions o = {}) {
    channels_ =
        std::make_unique<NcclChannels>(o, [this]() -> absl::StatusOr<std::unique_ptr<NcclLink>> {
          return std::unique_ptr<NcclLink>(new FakeLink(log_));
        });
    channels_->OpenSession("s1", "alice");
    channels_->OpenSession("s2", "alice");
    channels_->OpenSession("s3", "bob");
  }
  uint64_t OpenChannel(const RegionOwner& owner) {
    absl::StatusOr<v1::OpenNcclChannelResponse> r = channels_->Open(owner);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->channel_id() : 0;
  }
  static v1::NcclTransfer Transfer(uint64_t id, uint64_t seq) {
    v1::NcclTransfer t;
    t.set_channel_id(id);
    t.set_seq(seq);
    return t;
  }

  std::shared_ptr<FakeLinkLog> log_ = std::make_shared<FakeLinkLog>();
  Outcomes out_;  // before channels_, whose end may still report to it
  std::unique_ptr<NcclChannels> channels_;
};

TEST_F(NcclChannelsTest, OpenNeedsTheCallersOpenSession) {
  Make();
  EXPECT_EQ(channels_->Open({"alice", ""}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(channels_->Open({"alice", "nope"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(channels_->Open({"alice", "s3"}).status().code(), absl::StatusCode::kPermissionDenied);
  absl::StatusOr<v1::OpenNcclChannelResponse> r = channels_->Open({"alice", "s1"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->channel_id(), 0u);
  EXPECT_EQ(r->to_server_id().size(), kNcclUniqueIdBytes);
  EXPECT_EQ(r->device(), "cuda:1");
}

TEST_F(NcclChannelsTest, OpenRefusesPastThePrincipalsChannels) {
  NcclChannelsOptions o;
  o.max_channels_per_principal = 2;
  Make(o);
  OpenChannel({"alice", "s1"});
  OpenChannel({"alice", "s2"});
  EXPECT_EQ(channels_->Open({"alice", "s1"}).status().code(), absl::StatusCode::kResourceExhausted);
  OpenChannel({"bob", "s3"});
}

TEST_F(NcclChannelsTest, AnotherCallersChannelIsRefusedAndKeepsWorking) {
  Make();
  const uint64_t id = OpenChannel({"alice", "s1"});
  absl::Status st = channels_->Submit({"bob", "s3"}, Transfer(id, 1), out_.Batch(0, 64));
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "nccl.channel_id")) << st;
  st = channels_->Submit({"alice", "s2"}, Transfer(id, 1), out_.Batch(0, 64));
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_EQ(channels_->Submit({"alice", "s1"}, Transfer(id + 1, 1), out_.Batch(0, 64)).code(),
            absl::StatusCode::kNotFound);
  channels_->Abort({"bob", "s3"}, id, absl::InvalidArgumentError("hostile"));
  EXPECT_EQ(channels_->Close({"bob", "s3"}, id).code(), absl::StatusCode::kNotFound);
  // The owner's channel lost nothing: sequence number 1 is still the next.
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(id, 1), out_.Batch(1, 64)).ok());
  ASSERT_TRUE(out_.Wait(1));
  EXPECT_EQ(out_.received, (std::vector<int>{1}));
  EXPECT_EQ(log_->aborts, 0);
}

TEST_F(NcclChannelsTest, ReceivesArePostedInSequenceOrder) {
  Make();
  const uint64_t id = OpenChannel({"alice", "s1"});
  const RegionOwner owner{"alice", "s1"};
  // 3 and 2 arrive before 1, each with its own size, so the post order shows in the sizes.
  ASSERT_TRUE(channels_->Submit(owner, Transfer(id, 3), out_.Batch(3, 300)).ok());
  ASSERT_TRUE(channels_->Submit(owner, Transfer(id, 2), out_.Batch(2, 200)).ok());
  std::this_thread::sleep_for(milliseconds(50));
  {
    std::lock_guard<std::mutex> lock(log_->mu);
    EXPECT_TRUE(log_->receives.empty()) << "posted before number 1 came";
  }
  ASSERT_TRUE(channels_->Submit(owner, Transfer(id, 1), out_.Batch(1, 100)).ok());
  ASSERT_TRUE(out_.Wait(3));
  EXPECT_EQ(out_.received, (std::vector<int>{1, 2, 3}));
  std::lock_guard<std::mutex> lock(log_->mu);
  EXPECT_EQ(log_->receives, (std::vector<std::vector<int64_t>>{{100}, {200}, {300}}));
}

TEST_F(NcclChannelsTest, AReusedSequenceNumberEndsTheChannel) {
  Make();
  const uint64_t id = OpenChannel({"alice", "s1"});
  const RegionOwner owner{"alice", "s1"};
  ASSERT_TRUE(channels_->Submit(owner, Transfer(id, 1), out_.Batch(1, 64)).ok());
  ASSERT_TRUE(channels_->Submit(owner, Transfer(id, 3), out_.Batch(3, 64)).ok());  // held
  ASSERT_TRUE(out_.Wait(1));
  const absl::Status st = channels_->Submit(owner, Transfer(id, 1), out_.Batch(9, 64));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  ASSERT_TRUE(out_.Wait(2));
  ASSERT_EQ(out_.failed.size(), 1u);
  EXPECT_EQ(out_.failed[0].first, 3);
  EXPECT_EQ(out_.failed[0].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(AbortedSoon(*log_));
  EXPECT_EQ(channels_->Submit(owner, Transfer(id, 2), out_.Batch(2, 64)).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(NcclChannelsTest, AGapPastTheTimeoutEndsTheChannel) {
  NcclChannelsOptions o;
  o.transfer_timeout = milliseconds(100);
  Make(o);
  const uint64_t id = OpenChannel({"alice", "s1"});
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(id, 2), out_.Batch(2, 64)).ok());
  ASSERT_TRUE(out_.Wait(1));
  ASSERT_EQ(out_.failed.size(), 1u);
  EXPECT_EQ(out_.failed[0].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(out_.failed[0].second.message(), "never came"))
      << out_.failed[0].second;
  EXPECT_EQ(channels_->channels(), 0);
}

TEST_F(NcclChannelsTest, AReceiveThatNeverCompletesEndsTheChannel) {
  NcclChannelsOptions o;
  o.transfer_timeout = milliseconds(100);
  Make(o);
  log_->complete = false;  // the peer is gone: nothing it should send arrives
  const uint64_t id = OpenChannel({"alice", "s1"});
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(id, 1), out_.Batch(1, 64)).ok());
  ASSERT_TRUE(out_.Wait(1));
  ASSERT_EQ(out_.failed.size(), 1u);
  EXPECT_EQ(out_.failed[0].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(AbortedSoon(*log_));
}

TEST_F(NcclChannelsTest, ACommunicatorErrorEndsTheChannel) {
  Make();
  log_->complete = false;
  const uint64_t id = OpenChannel({"alice", "s1"});
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(id, 1), out_.Batch(1, 64)).ok());
  std::this_thread::sleep_for(milliseconds(20));
  {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->poll = absl::UnavailableError("nccl: remote process exited");
  }
  ASSERT_TRUE(out_.Wait(1));
  ASSERT_EQ(out_.failed.size(), 1u);
  EXPECT_TRUE(absl::StrContains(out_.failed[0].second.message(), "remote process exited"));
}

// The abort of a dead peer's communicators can wait inside the driver for a long time: the
// session's end still returns at once, its calls are answered, and other callers go on.
TEST_F(NcclChannelsTest, AnAbortThatBlocksHoldsNeitherTheCallerNorTheCalls) {
  Make();
  log_->complete = false;  // the peer is gone: its bytes never come
  log_->aborts_block = true;
  absl::Cleanup release = [this] { log_->ReleaseAborts(); };
  const uint64_t id = OpenChannel({"alice", "s1"});
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(id, 1), out_.Batch(1, 64)).ok());
  for (int i = 0; i < 500; ++i) {  // until the pump has posted the receive
    std::lock_guard<std::mutex> lock(log_->mu);
    if (!log_->receives.empty()) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  std::future<void> dropped =
      std::async(std::launch::async, [this] { channels_->DropSession("s1"); });
  EXPECT_EQ(dropped.wait_for(milliseconds(500)), std::future_status::ready);
  ASSERT_TRUE(out_.Wait(1, milliseconds(500)));
  ASSERT_EQ(out_.failed.size(), 1u);
  EXPECT_EQ(out_.failed[0].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(AbortedSoon(*log_));  // entered, and still waiting
  // Another caller opens a channel and has its micro-batch received meanwhile.
  log_->complete = true;
  const uint64_t other = OpenChannel({"bob", "s3"});
  ASSERT_TRUE(channels_->Submit({"bob", "s3"}, Transfer(other, 1), out_.Batch(2, 64)).ok());
  ASSERT_TRUE(out_.Wait(2));
  std::lock_guard<std::mutex> lock(out_.mu);
  EXPECT_EQ(out_.received, std::vector<int>{2});
}

// An abort frees memory, which waits for the device to go idle, and a kernel of another channel
// whose peer died keeps it busy until that channel's own abort: at shutdown every channel's abort
// begins at once (one after the other, the first would wait for the second forever).
TEST_F(NcclChannelsTest, AtShutdownEveryChannelIsAbortedAtOnce) {
  Make();
  log_->abort_quorum = 3;
  OpenChannel({"alice", "s1"});
  OpenChannel({"alice", "s2"});
  OpenChannel({"bob", "s3"});
  channels_.reset();
  EXPECT_EQ(log_->aborts, 3);
  std::lock_guard<std::mutex> lock(log_->mu);
  EXPECT_EQ(log_->quorum_missed, 0);
}

TEST_F(NcclChannelsTest, TheSessionsEndEndsItsChannelsOnly) {
  Make();
  log_->complete = false;
  const uint64_t mine = OpenChannel({"alice", "s1"});
  const uint64_t other = OpenChannel({"alice", "s2"});
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(mine, 1), out_.Batch(1, 64)).ok());
  channels_->DropSession("s1");
  ASSERT_TRUE(out_.Wait(1));
  ASSERT_EQ(out_.failed.size(), 1u);
  EXPECT_EQ(out_.failed[0].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(channels_->channels(), 1);
  EXPECT_TRUE(channels_->Close({"alice", "s2"}, other).ok());
  EXPECT_EQ(channels_->channels(), 0);
}

TEST_F(NcclChannelsTest, SentBuffersAreTrackedUntilTheSendCompletes) {
  Make();
  const uint64_t id = OpenChannel({"alice", "s1"});
  NcclChannels::Batch b = out_.Batch(1, 64);
  b.received = [&](NcclChannels::Received r) {
    absl::StatusOr<std::unique_ptr<NcclCompletion>> sent =
        r.link->Send(r.outputs, false, nullptr);
    ASSERT_TRUE(sent.ok());
    channels_->TrackSend(r.channel_id, r.link, *std::move(sent), r.outputs);
    std::lock_guard<std::mutex> lock(out_.mu);
    out_.received.push_back(1);
    out_.cv.notify_all();
  };
  ASSERT_TRUE(channels_->Submit({"alice", "s1"}, Transfer(id, 1), std::move(b)).ok());
  ASSERT_TRUE(out_.Wait(1));
  std::lock_guard<std::mutex> lock(log_->mu);
  EXPECT_EQ(log_->sends, (std::vector<std::vector<int64_t>>{{64}}));
  EXPECT_EQ(log_->zeroed, (std::vector<bool>{false}));
}

}  // namespace
}  // namespace moe::server
