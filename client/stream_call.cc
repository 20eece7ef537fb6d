// One Forward or Backward stream (see stream_call.h): the callback reactor that writes a
// stream's request messages one at a time, copies each response's tensor bytes once, as it
// arrives, into the assembled outputs, and reports the result just before it deletes itself.
#include "client/stream_call.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::client {
namespace {

// The full names of the raw methods (gRPC keeps a pointer to them for the call's lifetime).
constexpr char kForwardMethod[] = "/moe.v1.ExpertService/Forward";
constexpr char kBackwardMethod[] = "/moe.v1.ExpertService/Backward";

// What one micro-batch (or one stream of a striped one) sends and how its answer is taken:
// the requests are encoded by reference to the call's own copy of the caller's tensors, one
// message at a time as it is written; each response's tensor bytes are copied once, as it
// arrives, by `accept` into the assembled outputs; `finish` makes the result from the first
// response's small fields, and `done` receives it (or the call's error).
template <typename Req, typename Resp, typename Out>
struct MicroBatch {
  wire::ChunkedMessages<Req> requests;
  std::function<absl::Status(const Resp&, const wire::IncomingMessage&)> accept;
  std::function<absl::StatusOr<Out>(const Resp& first)> finish;
  std::function<void(absl::StatusOr<Out>)> done;
};

// The responses of one micro-batch as they are read: decoded, handed to `accept`, the first
// kept for `finish`.
template <typename Req, typename Resp, typename Out>
class ResponseReader {
 public:
  explicit ResponseReader(std::vector<int> tensor_fields)
      : tensor_fields_(std::move(tensor_fields)) {}
  void Reset() {
    responses_ = 0;
    last_seen_ = false;
  }
  // Takes `buffer` as the next response of `batch`; an error when this client cannot use it.
  absl::Status Take(grpc::ByteBuffer* buffer, MicroBatch<Req, Resp, Out>& batch) {
    Resp response;
    MOE_RETURN_IF_ERROR(
        incoming_.Decode(buffer, tensor_fields_, &response, Resp::descriptor()->full_name()));
    MOE_RETURN_IF_ERROR(batch.accept(response, incoming_));
    last_seen_ = response.last_chunk();
    if (responses_ == 0) first_ = std::move(response);
    ++responses_;
    return absl::OkStatus();
  }
  bool complete() const { return responses_ != 0 && last_seen_; }
  absl::StatusOr<Out> Finish(MicroBatch<Req, Resp, Out>& batch) const {
    return batch.finish(first_);
  }

 private:
  const std::vector<int> tensor_fields_;
  wire::IncomingMessage incoming_;
  Resp first_;
  size_t responses_ = 0;
  bool last_seen_ = false;
};

using SteadyClock = std::chrono::steady_clock;

// A long-lived stream as its link sees it (kinds: Forward, Backward).
enum StreamKind { kForwardStreams = 0, kBackwardStreams = 1 };
class LongLivedStream {
 public:
  virtual ~LongLivedStream() = default;
  // Under the link's lock, on a stream just taken out of the idle list: it will be ended.
  virtual void TakeForEndingLocked() = 0;
  // Ends the stream so taken (outside the link's lock).
  virtual void End() = 0;
};

}  // namespace

struct StreamLink::Streams {
  std::mutex mu;
  std::condition_variable gone;  // a stream ended
  bool shut_down = false;
  int live = 0;  // streams of either kind whose call still holds a channel
  std::vector<LongLivedStream*> idle[2];  // by StreamKind
};

namespace {

// Counts a stream in while its call holds one of the connection's channels.
void StreamBorn(StreamLink::Streams& streams) {
  std::lock_guard<std::mutex> lock(streams.mu);
  ++streams.live;
}

// Counts a stream out once its ClientContext, which holds a channel, is gone. A Connection waits
// for the count (StreamLink::ShutDown) before it lets go of its channels, so the last reference
// to a channel is not dropped on gRPC's callback thread: destroying a channel there makes gRPC
// shut down the queue that thread serves, and abort.
void StreamGone(const std::shared_ptr<StreamLink::Streams>& streams) {
  {
    std::lock_guard<std::mutex> lock(streams->mu);
    --streams->live;
  }
  streams->gone.notify_all();
}

// One stream of a striped micro-batch on its own bidi stream, on raw buffers
// (wire/raw_message.h); `done` is called once the last response has arrived, and the call deletes
// itself when gRPC ends it.
template <typename Req, typename Resp, typename Out>
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamCall(std::shared_ptr<StreamLink::Streams> streams, MicroBatch<Req, Resp, Out> batch,
             std::vector<int> response_tensor_fields)
      : streams_(std::move(streams)),
        context_(std::make_unique<grpc::ClientContext>()),
        batch_(std::move(batch)),
        reader_(std::move(response_tensor_fields)) {
    StreamBorn(*streams_);
  }

  // Sets `conn`'s deadline and metadata, shows the context to `track`, and starts the call on
  // `method` of `stub`.
  void Start(const Connection& conn, grpc::GenericStub& stub, const char* method,
             const TrackContext& track) {
    conn.Prepare(context_.get());
    if (track) track(context_.get());
    stub.PrepareBidiStreamingCall(context_.get(), method, grpc::StubOptions(), this);
    message_ = batch_.requests.Build(0);
    StartWrite(&message_);
    StartRead(&read_);
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call failed; OnDone reports why
    if (++next_ < batch_.requests.size()) {
      message_ = batch_.requests.Build(next_);
      StartWrite(&message_);
    } else {
      message_.Clear();
      StartWritesDone();
    }
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (absl::Status st = reader_.Take(&read_, batch_); !st.ok()) {
      // A response this client cannot use: end the call (OnDone reports `st`).
      error_ = st;
      context_->TryCancel();
      return;
    }
    if (reader_.complete() && !reported_) {
      // Answered: the caller need not wait for the stream's end as well.
      reported_ = true;
      batch_.done(reader_.Finish(batch_));
    }
    StartRead(&read_);
  }
  void OnDone(const grpc::Status& status) override {
    if (!reported_) {
      if (!error_.ok()) {
        batch_.done(error_);
      } else if (!status.ok()) {
        batch_.done(FromGrpcStatus(status));
      } else {
        batch_.done(absl::DataLossError("the server ended the stream without a complete response"));
      }
    }
    batch_ = MicroBatch<Req, Resp, Out>();
    context_.reset();
    StreamGone(streams_);
    delete this;
  }

 private:
  const std::shared_ptr<StreamLink::Streams> streams_;
  std::unique_ptr<grpc::ClientContext> context_;
  MicroBatch<Req, Resp, Out> batch_;
  ResponseReader<Req, Resp, Out> reader_;
  grpc::ByteBuffer message_;  // the request being written: batch_.requests's message next_
  size_t next_ = 0;
  grpc::ByteBuffer read_;
  bool reported_ = false;
  absl::Status error_;
};

// One long-lived Forward or Backward stream (see StreamLink): micro-batches one at a time, each
// its request messages then its responses; the next response read is always outstanding, so a
// stream that dies while idle leaves the idle list at once. A hold (gRPC's AddHold) keeps the
// call open while the link may hand it a micro-batch from another thread; exactly one party
// releases it, decided under the link's lock: the reaction that finds the stream broken, or
// whoever ends it.
template <typename Req, typename Resp, typename Out>
class PooledStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                           public LongLivedStream {
 public:
  using Batch = MicroBatch<Req, Resp, Out>;

  // Runs `batch` on an idle stream of `link`, or on a new one.
  static void Run(const Connection& conn, StreamLink& link, StreamKind kind, const char* method,
                  const std::vector<int>& response_tensor_fields, Batch batch) {
    StreamLink::Streams& streams = link.streams();
    std::vector<PooledStream*> retired;
    PooledStream* taken = nullptr;
    {
      std::lock_guard<std::mutex> lock(streams.mu);
      std::vector<LongLivedStream*>& idle = streams.idle[kind];
      const SteadyClock::time_point now = SteadyClock::now();
      while (taken == nullptr && !idle.empty()) {
        auto* s = static_cast<PooledStream*>(idle.back());
        idle.pop_back();
        if (now >= s->retire_at_) {
          s->TakeForEndingLocked();
          retired.push_back(s);
        } else {
          s->TakeLocked(std::move(batch));
          taken = s;
        }
      }
      if (taken == nullptr) ++streams.live;
    }
    for (PooledStream* s : retired) s->End();
    if (taken != nullptr) {
      taken->Begin();
      return;
    }
    auto* s = new PooledStream(link.shared_from_this(), kind, response_tensor_fields,
                               conn.options().timeout);
    s->Open(conn, method, std::move(batch));
  }

  void TakeForEndingLocked() override { state_ = State::kEnding; }
  void End() override {
    StartWritesDone();
    RemoveHold();
  }

  void OnWriteDone(bool ok) override {
    if (ok && ++next_ < batch_.requests.size()) {
      message_ = batch_.requests.Build(next_);
      StartWrite(&message_);
      return;
    }
    message_.Clear();
    bool complete = false;
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      writing_ = false;
      if (!ok) broken_ = true;
      complete = answered_ && !broken_;
    }
    if (complete) {
      Complete();
    } else {
      ReleaseIfBroken();
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      ReadFailed();
      return;
    }
    bool expected;
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      expected = state_ == State::kBusy && !answered_;
    }
    absl::Status st = expected ? reader_.Take(&read_, batch_)
                               : absl::DataLossError("the server answered no micro-batch");
    if (!st.ok()) {
      // A response this client cannot use: end the stream; OnDone reports `st`.
      error_ = st;
      context_->TryCancel();
      ReadFailed();
      return;
    }
    if (!reader_.complete()) {
      StartRead(&read_);
      return;
    }
    StartRead(&read_);  // the next micro-batch's first response, or the stream's end
    bool complete = false;
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      answered_ = true;
      complete = !writing_ && !broken_;
    }
    if (complete) Complete();
  }

  void OnDone(const grpc::Status& status) override {
    std::function<void(absl::StatusOr<Out>)> done;
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      if (state_ == State::kBusy) done = std::move(batch_.done);
      state_ = State::kGone;
    }
    if (done) {
      if (!error_.ok()) {
        done(error_);
      } else if (!status.ok()) {
        done(FromGrpcStatus(status));
      } else {
        done(absl::DataLossError("the server ended the stream before answering the micro-batch"));
      }
    }
    // The channel references go before the count does (StreamGone).
    batch_ = Batch();
    context_.reset();
    link_.reset();
    StreamGone(streams_);
    delete this;
  }

 private:
  enum class State { kIdle, kBusy, kEnding, kGone };

  PooledStream(std::shared_ptr<StreamLink> link, StreamKind kind,
               std::vector<int> response_tensor_fields, std::chrono::milliseconds timeout)
      : link_(std::move(link)),
        streams_(link_->shared_streams()),
        kind_(kind),
        context_(std::make_unique<grpc::ClientContext>()),
        reader_(std::move(response_tensor_fields)) {
    retire_at_ = SteadyClock::now() + timeout;
    // Twice the timeout, saturating: a micro-batch taken just before retirement gets a whole one.
    const auto now = std::chrono::system_clock::now();
    const auto max = std::chrono::system_clock::time_point::max();
    deadline_ = timeout > std::chrono::duration_cast<std::chrono::milliseconds>(max - now) / 2
                    ? max
                    : now + 2 * timeout;
  }

  StreamLink::Streams& streams() { return *streams_; }

  // Opens the stream with `batch` as its first micro-batch.
  void Open(const Connection& conn, const char* method, Batch batch) {
    conn.Prepare(context_.get());
    context_->set_deadline(deadline_);
    link_->stub().PrepareBidiStreamingCall(context_.get(), method, grpc::StubOptions(), this);
    AddHold();
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      TakeLocked(std::move(batch));
    }
    Begin();
    StartRead(&read_);
    StartCall();
  }

  // Under the link's lock: the stream carries `batch` next.
  void TakeLocked(Batch batch) {
    state_ = State::kBusy;
    batch_ = std::move(batch);
    writing_ = true;
    answered_ = false;
  }
  // Starts writing the micro-batch taken.
  void Begin() {
    reader_.Reset();
    next_ = 0;
    message_ = batch_.requests.Build(0);
    StartWrite(&message_);
  }

  // The micro-batch is answered and its requests written: back to the idle list, or ended when
  // the link shuts down or the stream is past its retirement; then the caller hears.
  void Complete() {
    absl::StatusOr<Out> result = reader_.Finish(batch_);
    std::function<void(absl::StatusOr<Out>)> done = std::move(batch_.done);
    batch_ = Batch();  // lets go of the call's tensors
    bool end = false;
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      if (streams().shut_down || SteadyClock::now() >= retire_at_) {
        state_ = State::kEnding;
        end = true;
      } else {
        state_ = State::kIdle;
        streams().idle[kind_].push_back(this);
      }
    }
    if (end) End();
    done(std::move(result));
  }

  void ReadFailed() {
    bool release = false;
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      if (state_ == State::kIdle) {
        std::vector<LongLivedStream*>& idle = streams().idle[kind_];
        idle.erase(std::remove(idle.begin(), idle.end(), this), idle.end());
        state_ = State::kGone;
        release = true;
      } else if (state_ == State::kBusy) {
        broken_ = true;
      }
    }
    if (release) {
      RemoveHold();
    } else {
      ReleaseIfBroken();
    }
  }

  // A busy stream that broke lets go of its hold once no write of ours is outstanding; OnDone
  // then reports the micro-batch's error.
  void ReleaseIfBroken() {
    {
      std::lock_guard<std::mutex> lock(streams().mu);
      if (state_ != State::kBusy || !broken_ || writing_ || released_) return;
      released_ = true;
    }
    RemoveHold();
  }

  std::shared_ptr<StreamLink> link_;  // its stub holds a channel: released before StreamGone
  const std::shared_ptr<StreamLink::Streams> streams_;
  const StreamKind kind_;
  SteadyClock::time_point retire_at_;
  std::chrono::system_clock::time_point deadline_;
  std::unique_ptr<grpc::ClientContext> context_;
  Batch batch_;
  ResponseReader<Req, Resp, Out> reader_;
  grpc::ByteBuffer message_;  // the request being written: batch_.requests's message next_
  size_t next_ = 0;
  grpc::ByteBuffer read_;
  absl::Status error_;
  // Under the link's lock.
  State state_ = State::kIdle;
  bool writing_ = false;   // a request message of ours is being written
  bool answered_ = false;  // the micro-batch's last response has arrived
  bool broken_ = false;    // a read or write failed: the stream takes nothing more
  bool released_ = false;
};

// Moves the tensor `assembler` collected into `*out`. A tensor no response carried is an error
// when `required`, and leaves `*out` empty otherwise (e.g. no dweights under server routing).
absl::Status FinishInto(wire::TensorAssembler& assembler, bool required, Tensor* out) {
  if (!required && !assembler.seen()) return absl::OkStatus();
  MOE_ASSIGN_OR_RETURN(*out, assembler.Finish());
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<ResponseTensors> ResponseTensors::Whole(
    absl::Span<const char* const> names, const std::vector<std::optional<v1::TensorRef>>& by_ref) {
  auto r = std::make_shared<ResponseTensors>();
  for (const char* n : names) {
    r->whole.emplace_back(n, wire::TensorAssembler::Sizing::kClaimedAtOnce);
  }
  r->names.assign(names.begin(), names.end());
  r->by_ref = by_ref;
  r->by_ref.resize(names.size());
  r->written.resize(names.size());
  return r;
}

std::shared_ptr<ResponseTensors> ResponseTensors::Stripe(
    std::shared_ptr<std::deque<wire::StripedAssembler>> outputs, uint32_t stream,
    int64_t row_begin) {
  auto r = std::make_shared<ResponseTensors>();
  r->striped = std::move(outputs);
  r->stream = stream;
  r->row_begin = row_begin;
  return r;
}

std::shared_ptr<std::deque<wire::StripedAssembler>> ResponseTensors::Shared(
    absl::Span<const char* const> names, int64_t total_rows) {
  auto d = std::make_shared<std::deque<wire::StripedAssembler>>();
  for (const char* n : names) {
    d->emplace_back(n, wire::TensorAssembler::Sizing::kClaimedAtOnce, total_rows);
  }
  return d;
}

absl::Status ResponseTensors::AddIfPresent(size_t i, bool present, const v1::Tensor& proto,
                                           int field, const wire::IncomingMessage& in) {
  if (!present) return absl::OkStatus();
  const std::string name = i < names.size() ? names[i] : absl::StrCat("response tensor ", i);
  if (i < by_ref.size() && by_ref[i]) {
    // Written where the call asked: the response must say so, and carry no bytes of it.
    const v1::TensorRef& want = *by_ref[i];
    size_t bytes = proto.data().size();
    for (absl::string_view p : in.payload(field)) bytes += p.size();
    if (!proto.has_ref() || proto.ref().region_id() != want.region_id() ||
        proto.ref().offset() != want.offset() || bytes != 0) {
      return absl::DataLossError(absl::StrCat(
          name, ": the server did not answer that it wrote it at region ", want.region_id(),
          " offset ", want.offset()));
    }
    MOE_ASSIGN_OR_RETURN(written[i].dtype, wire::DTypeFromProto(proto.dtype(), name));
    written[i].shape.assign(proto.shape().begin(), proto.shape().end());
    written[i].seen = true;
    return absl::OkStatus();
  }
  if (proto.has_ref()) {
    return absl::DataLossError(
        absl::StrCat(name, ": the server answered a reference this call did not ask for"));
  }
  return striped ? (*striped)[i].Add(stream, row_begin, proto, in.payload(field))
                 : whole[i].Add(proto, in.payload(field));
}

absl::Status ResponseTensors::FinishInto(size_t i, bool required, Tensor* out) {
  if (striped) return absl::OkStatus();
  if (i < by_ref.size() && by_ref[i]) {
    if (required && !written[i].seen) {
      return absl::DataLossError(
          absl::StrCat(names[i], ": the response does not say it was written"));
    }
    return absl::OkStatus();
  }
  return client::FinishInto(whole[i], required, out);
}

std::shared_ptr<StreamLink::Streams> StreamLink::NewStreams() {
  return std::make_shared<Streams>();
}

StreamLink::StreamLink(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<Streams> streams)
    : stub_(std::move(channel)), streams_(std::move(streams)) {}

StreamLink::~StreamLink() = default;

void StreamLink::ShutDown(std::chrono::milliseconds wait) {
  std::vector<LongLivedStream*> idle;
  {
    std::lock_guard<std::mutex> lock(streams_->mu);
    streams_->shut_down = true;
    for (std::vector<LongLivedStream*>& kind : streams_->idle) {
      for (LongLivedStream* s : kind) {
        s->TakeForEndingLocked();
        idle.push_back(s);
      }
      kind.clear();
    }
  }
  for (LongLivedStream* s : idle) s->End();
  std::unique_lock<std::mutex> lock(streams_->mu);
  streams_->gone.wait_for(lock, wait, [this] { return streams_->live == 0; });
}

namespace {

// Runs `batch` on a long-lived stream of `link` when it is a whole micro-batch nobody tracks,
// else on a stream of its own.
template <typename Req, typename Resp, typename Out>
void RunMicroBatch(const Connection& conn, StreamLink& link, StreamKind kind, const char* method,
                   const std::vector<int>& response_tensor_fields, bool whole,
                   MicroBatch<Req, Resp, Out> batch, const TrackContext& track) {
  if (whole && !track) {
    PooledStream<Req, Resp, Out>::Run(conn, link, kind, method, response_tensor_fields,
                                      std::move(batch));
    return;
  }
  auto* stream = new StreamCall<Req, Resp, Out>(link.shared_streams(), std::move(batch),
                                                response_tensor_fields);
  stream->Start(conn, link.stub(), method, track);
}

bool Whole(const StreamRows& rows) { return rows.stripe.count() == 0; }

}  // namespace

void StartForwardStream(const Connection& conn, StreamLink& link, const ForwardCall& call,
                        std::shared_ptr<const std::vector<Tensor>> tensors, const StreamRows& rows,
                        std::shared_ptr<ResponseTensors> outputs,
                        std::function<void(absl::StatusOr<ForwardOutput>)> done,
                        TrackContext track) {
  static const std::vector<int> kFields = {v1::ForwardResponse::kOutFieldNumber,
                                           v1::ForwardResponse::kExpertIdsFieldNumber,
                                           v1::ForwardResponse::kWeightsFieldNumber};
  MicroBatch<v1::ForwardRequest, v1::ForwardResponse, ForwardOutput> batch;
  batch.requests = ForwardRequests(call, std::move(tensors), rows, conn.options());
  batch.accept = [outputs](const v1::ForwardResponse& r,
                           const wire::IncomingMessage& in) -> absl::Status {
    MOE_RETURN_IF_ERROR(
        outputs->AddIfPresent(0, r.has_out(), r.out(), v1::ForwardResponse::kOutFieldNumber, in));
    MOE_RETURN_IF_ERROR(outputs->AddIfPresent(1, r.has_expert_ids(), r.expert_ids(),
                                              v1::ForwardResponse::kExpertIdsFieldNumber, in));
    return outputs->AddIfPresent(2, r.has_weights(), r.weights(),
                                 v1::ForwardResponse::kWeightsFieldNumber, in);
  };
  batch.finish = [outputs](const v1::ForwardResponse& first) -> absl::StatusOr<ForwardOutput> {
    ForwardOutput o;
    o.context_id = first.context_id();
    o.aux_loss = first.aux_loss();
    o.z_loss = first.z_loss();
    MOE_RETURN_IF_ERROR(outputs->FinishInto(0, /*required=*/true, &o.out));
    MOE_RETURN_IF_ERROR(outputs->FinishInto(1, /*required=*/false, &o.expert_ids));
    MOE_RETURN_IF_ERROR(outputs->FinishInto(2, /*required=*/false, &o.weights));
    return o;
  };
  batch.done = std::move(done);
  RunMicroBatch(conn, link, kForwardStreams, kForwardMethod, kFields, Whole(rows),
                std::move(batch), track);
}

void StartBackwardStream(const Connection& conn, StreamLink& link, const BackwardCall& call,
                         std::shared_ptr<const std::vector<Tensor>> tensors, const StreamRows& rows,
                         std::shared_ptr<ResponseTensors> outputs,
                         std::function<void(absl::StatusOr<BackwardOutput>)> done,
                         TrackContext track) {
  static const std::vector<int> kFields = {v1::BackwardResponse::kDxFieldNumber,
                                           v1::BackwardResponse::kDweightsFieldNumber};
  MicroBatch<v1::BackwardRequest, v1::BackwardResponse, BackwardOutput> batch;
  batch.requests = BackwardRequests(call, std::move(tensors), rows, conn.options());
  batch.accept = [outputs](const v1::BackwardResponse& r,
                           const wire::IncomingMessage& in) -> absl::Status {
    MOE_RETURN_IF_ERROR(
        outputs->AddIfPresent(0, r.has_dx(), r.dx(), v1::BackwardResponse::kDxFieldNumber, in));
    return outputs->AddIfPresent(1, r.has_dweights(), r.dweights(),
                                 v1::BackwardResponse::kDweightsFieldNumber, in);
  };
  batch.finish = [outputs](const v1::BackwardResponse&) -> absl::StatusOr<BackwardOutput> {
    BackwardOutput o;
    MOE_RETURN_IF_ERROR(outputs->FinishInto(0, /*required=*/true, &o.dx));
    MOE_RETURN_IF_ERROR(outputs->FinishInto(1, /*required=*/false, &o.dweights));
    return o;
  };
  batch.done = std::move(done);
  RunMicroBatch(conn, link, kBackwardStreams, kBackwardMethod, kFields, Whole(rows),
                std::move(batch), track);
}

}  // namespace moe::client
