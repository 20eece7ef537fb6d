// NcclChannels (see nccl_channels.h): plans, ownership, the sequence gate and the pump.
#include "server/nccl_channels.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "wire/wire.h"

namespace moe::server {
namespace {

using Clock = std::chrono::steady_clock;

// How often the pump looks while something is in flight or bootstrapping, and while idle (for
// deadlines only).
constexpr std::chrono::microseconds kBusyPoll{50};
constexpr std::chrono::milliseconds kIdlePoll{100};

// A tensor an NCCL micro-batch declares: dtype and shape only.
absl::StatusOr<NcclPlan::Part> Declared(const v1::Tensor& t, const std::string& field) {
  if (!t.data().empty() || t.has_ref() || t.offset() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": an NCCL micro-batch's tensors carry dtype and shape only (no data, ref or "
        "offset); their bytes travel over the channel"));
  }
  NcclPlan::Part p;
  p.present = true;
  MOE_ASSIGN_OR_RETURN(p.dtype, wire::DTypeFromProto(t.dtype(), absl::StrCat(field, ".dtype")));
  p.shape.assign(t.shape().begin(), t.shape().end());
  MOE_ASSIGN_OR_RETURN(p.bytes, CheckedByteSize(p.shape, p.dtype, absl::StrCat(field, ".shape")));
  return p;
}

absl::Status NoOtherTransport(bool has_stripe, uint64_t event_id) {
  if (has_stripe) {
    return absl::InvalidArgumentError("stripe: an NCCL micro-batch is never striped");
  }
  if (event_id != 0) {
    return absl::InvalidArgumentError("event_id: an NCCL micro-batch is ordered by its channel");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<NcclPlan> PlanForward(const v1::ForwardRequest& r) {
  MOE_RETURN_IF_ERROR(NoOtherTransport(r.has_stripe(), r.event_id()));
  if (r.has_out_ref()) {
    return absl::InvalidArgumentError("out_ref: an NCCL micro-batch's out comes by the channel");
  }
  if (!r.has_x()) return absl::InvalidArgumentError("x: missing");
  NcclPlan plan;
  MOE_ASSIGN_OR_RETURN(NcclPlan::Part x, Declared(r.x(), "x"));
  plan.inputs.push_back(x);
  for (auto [has, t, field] : {std::tuple{r.has_expert_ids(), &r.expert_ids(), "expert_ids"},
                               std::tuple{r.has_weights(), &r.weights(), "weights"}}) {
    if (!has) {
      plan.inputs.emplace_back();
      continue;
    }
    MOE_ASSIGN_OR_RETURN(NcclPlan::Part p, Declared(*t, field));
    plan.inputs.push_back(p);
  }
  plan.outputs.push_back(x);  // out: x's dtype and shape
  return plan;
}

absl::StatusOr<NcclPlan> PlanBackward(const v1::BackwardRequest& r) {
  MOE_RETURN_IF_ERROR(NoOtherTransport(r.has_stripe(), r.event_id()));
  if (r.has_dx_ref() || r.has_dweights_ref()) {
    return absl::InvalidArgumentError(absl::StrCat(
        r.has_dx_ref() ? "dx_ref" : "dweights_ref",
        ": an NCCL micro-batch's results come by the channel or in the response"));
  }
  if (!r.has_dout()) return absl::InvalidArgumentError("dout: missing");
  NcclPlan plan;
  MOE_ASSIGN_OR_RETURN(NcclPlan::Part dout, Declared(r.dout(), "dout"));
  plan.inputs.push_back(dout);
  plan.outputs.push_back(dout);  // dx: dout's dtype and shape
  const int64_t k = r.nccl().dweights_k();
  if (k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("nccl.dweights_k: ", k, " is negative"));
  }
  plan.outputs.emplace_back();
  if (k > 0) {
    if (dout.shape.empty()) {
      return absl::InvalidArgumentError("dout.shape: [T, d] expected, got a scalar");
    }
    NcclPlan::Part& dw = plan.outputs.back();
    dw.present = true;
    dw.dtype = DType::kFloat32;
    dw.shape = {dout.shape[0], k};
    MOE_ASSIGN_OR_RETURN(dw.bytes, CheckedByteSize(dw.shape, dw.dtype, "nccl.dweights_k"));
  }
  return plan;
}

NcclChannels::NcclChannels(NcclChannelsOptions options, LinkFactory start_link)
    : options_(options), start_link_(std::move(start_link)), ids_(std::random_device{}()) {
  pump_ = std::thread([this] { PumpLoop(); });
}

NcclChannels::~NcclChannels() {
  std::vector<std::shared_ptr<Channel>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, c] : channels_) all.push_back(c);
    channels_.clear();
    stopping_ = true;
  }
  wake_.notify_all();
  pump_.join();
  for (auto& c : all) EndChannel(c, absl::UnavailableError("nccl: the server is shutting down"));
  // Until none is left: a caller ending a channel meanwhile adds its abort.
  for (;;) {
    std::vector<std::thread> aborts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborts.swap(final_aborts_);
    }
    if (aborts.empty()) break;
    for (std::thread& t : aborts) t.join();
  }
}

void NcclChannels::OpenSession(const std::string& session, const std::string& principal) {
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[session] = principal;
}

void NcclChannels::DropSession(const std::string& session) {
  std::vector<std::shared_ptr<Channel>> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(session);
    for (auto it = channels_.begin(); it != channels_.end();) {
      if (it->second->owner.session == session) {
        ended.push_back(it->second);
        it = channels_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : ended) EndChannel(c, absl::UnavailableError("nccl: the session ended"));
}

absl::StatusOr<v1::OpenNcclChannelResponse> NcclChannels::Open(const RegionOwner& owner) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (owner.session.empty()) {
      return absl::FailedPreconditionError(
          "NCCL channels need a session (the moe-session-id metadata of an OpenSession stream)");
    }
    auto s = sessions_.find(owner.session);
    if (s == sessions_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", owner.session, " is not open"));
    }
    if (s->second != owner.principal) {
      return absl::PermissionDeniedError("moe-session-id: the session is another principal's");
    }
    int held = 0;
    for (const auto& [id, c] : channels_) held += c->owner.principal == owner.principal;
    if (held >= options_.max_channels_per_principal) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "nccl: principal ", owner.principal, " already holds ", held, " NCCL channels"));
    }
  }
  MOE_ASSIGN_OR_RETURN(std::unique_ptr<NcclLink> link, start_link_());
  auto c = std::make_shared<Channel>(options_.max_held);
  c->owner = owner;
  c->link = std::move(link);
  c->bootstrap_deadline = Clock::now() + options_.transfer_timeout;
  v1::OpenNcclChannelResponse resp;
  resp.set_to_server_id(c->link->to_server_id());
  resp.set_to_client_id(c->link->to_client_id());
  resp.set_device(c->link->location().DebugString());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sessions_.count(owner.session) == 0) {  // ended meanwhile
      c->link->Abort();
      return absl::FailedPreconditionError(absl::StrCat("session ", owner.session, " ended"));
    }
    do {
      c->id = ids_();
    } while (c->id == 0 || channels_.count(c->id) != 0);
    channels_[c->id] = c;
    resp.set_channel_id(c->id);
  }
  wake_.notify_all();
  return resp;
}

absl::StatusOr<std::shared_ptr<NcclChannels::Channel>> NcclChannels::FindLocked(
    const RegionOwner& owner, uint64_t id) const {
  auto it = channels_.find(id);
  if (it == channels_.end() || it->second->owner.principal != owner.principal) {
    return absl::NotFoundError(absl::StrCat("nccl.channel_id: no NCCL channel ", id));
  }
  if (it->second->owner.session != owner.session) {
    return absl::PermissionDeniedError(absl::StrCat(
        "nccl.channel_id: channel ", id, " belongs to another session of this principal"));
  }
  return it->second;
}

std::shared_ptr<NcclChannels::Channel> NcclChannels::RemoveLocked(uint64_t id) {
  auto it = channels_.find(id);
  if (it == channels_.end()) return nullptr;
  std::shared_ptr<Channel> c = it->second;
  channels_.erase(it);
  return c;
}

absl::Status NcclChannels::Close(const RegionOwner& owner, uint64_t channel_id) {
  std::shared_ptr<Channel> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_RETURN_IF_ERROR(FindLocked(owner, channel_id).status());
    c = RemoveLocked(channel_id);
  }
  EndChannel(c, absl::UnavailableError(absl::StrCat("nccl: channel ", channel_id, " closed")));
  return absl::OkStatus();
}

void NcclChannels::Abort(const RegionOwner& owner, uint64_t channel_id, const absl::Status& why) {
  std::shared_ptr<Channel> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!FindLocked(owner, channel_id).ok()) return;
    c = RemoveLocked(channel_id);
  }
  EndChannel(c, absl::UnavailableError(absl::StrCat("nccl: channel ", channel_id,
                                                    " aborted: ", why.message())));
}

absl::Status NcclChannels::Submit(const RegionOwner& owner, const v1::NcclTransfer& transfer,
                                  Batch batch) {
  std::shared_ptr<Channel> ended;
  absl::Status st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, FindLocked(owner, transfer.channel_id()));
    const bool was_holding = c->gate.holding();
    absl::StatusOr<std::vector<Batch>> ready = c->gate.Offer(transfer.seq(), std::move(batch));
    if (ready.ok()) {
      for (Batch& b : *ready) c->to_post.push_back(std::move(b));
      if (!was_holding && c->gate.holding()) c->gap_since = Clock::now();
    } else {
      // The client posted transfers this channel can no longer match: its order is lost.
      st = ready.status();
      ended = RemoveLocked(c->id);
    }
  }
  if (ended) {
    EndChannel(ended, absl::UnavailableError(absl::StrCat(
                          "nccl: channel ", transfer.channel_id(), " aborted: ", st.message())));
    return st;
  }
  wake_.notify_all();
  return absl::OkStatus();
}

void NcclChannels::TrackSend(uint64_t channel_id, std::shared_ptr<NcclLink> link,
                             std::unique_ptr<NcclCompletion> sent,
                             std::vector<NcclBuffer> buffers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = channels_.find(channel_id);
    if (it != channels_.end() && it->second->link == link) {
      it->second->sending.push_back(Sending{std::move(link), std::move(sent), std::move(buffers),
                                            Clock::now() + options_.transfer_timeout});
      wake_.notify_all();
      return;
    }
  }
  // The channel ended meanwhile: its link is aborted, nothing will use the buffers.
  for (const NcclBuffer& b : buffers) link->Release(b);
}

int64_t NcclChannels::channels() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(channels_.size());
}

void NcclChannels::EndChannel(std::shared_ptr<Channel> c, const absl::Status& why) {
  if (c == nullptr) return;
  std::vector<Batch> failed = c->gate.TakeHeld();
  for (Batch& b : c->to_post) failed.push_back(std::move(b));
  c->to_post.clear();
  for (Posted& p : c->posted) failed.push_back(std::move(p.batch));
  c->posted.clear();
  c->sending.clear();
  // The calls are answered first: their reactors finish whatever NCCL does next. Their buffers
  // belong to the link, which outlives any transfer still writing them.
  for (Batch& b : failed) {
    if (b.failed) b.failed(why);
  }
  // ncclCommAbort waits for NCCL's threads and kernels to stop, and freeing the link's buffers
  // synchronises the device (which waits for every other channel's receives): neither may hold
  // a gRPC thread, the pump or the executor, so both run on a thread of their own, one per
  // channel, so that no channel's abort waits behind another's (a dead peer's receive keeps the
  // device busy until its own channel is aborted). The last holder frees the link (an executor
  // task that still has it, or that thread).
  std::thread abort([link = std::move(c->link)]() mutable {
    link->Abort();
    link.reset();
  });
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) {
    final_aborts_.push_back(std::move(abort));
  } else {
    abort.detach();
  }
}

absl::Status NcclChannels::PumpChannel(Channel& c,
                                       std::vector<std::function<void()>>* callbacks) {
  const Clock::time_point now = Clock::now();
  if (!c.ready) {
    const absl::Status st = c.link->Poll();
    if (absl::IsUnavailable(st)) {
      if (now > c.bootstrap_deadline) {
        return absl::DeadlineExceededError("nccl: the client did not join the channel in time");
      }
      return absl::OkStatus();
    }
    MOE_RETURN_IF_ERROR(st);
    c.ready = true;
  } else if (!c.posted.empty() || !c.sending.empty()) {
    MOE_RETURN_IF_ERROR(c.link->Poll());  // a peer that went away shows here
  }
  // Receives, in number order.
  while (!c.to_post.empty()) {
    Batch b = std::move(c.to_post.front());
    c.to_post.pop_front();
    Received r;
    r.link = c.link;
    r.channel_id = c.id;
    std::vector<NcclBuffer> into;
    absl::Status st;
    for (const std::vector<NcclPlan::Part>* parts : {&b.plan.inputs, &b.plan.outputs}) {
      std::vector<NcclBuffer>& dst = parts == &b.plan.inputs ? r.inputs : r.outputs;
      for (const NcclPlan::Part& p : *parts) {
        if (!p.present || !st.ok()) {
          dst.emplace_back();
          continue;
        }
        absl::StatusOr<NcclBuffer> buf = c.link->Acquire(p.bytes);
        if (!buf.ok()) {
          st = buf.status();
          dst.emplace_back();
          continue;
        }
        dst.push_back(NcclBuffer{buf->data, p.bytes});
        if (parts == &b.plan.inputs) into.push_back(dst.back());
      }
    }
    absl::StatusOr<std::unique_ptr<NcclCompletion>> done =
        st.ok() ? c.link->Receive(into) : absl::StatusOr<std::unique_ptr<NcclCompletion>>(st);
    if (!done.ok()) {
      // Without its receives this call cannot be matched: the channel is out of step.
      for (const auto* v : {&r.inputs, &r.outputs}) {
        for (const NcclBuffer& buf : *v) c.link->Release(buf);
      }
      c.posted.push_back(Posted{std::move(b), {}, nullptr, now});  // failed with the channel
      return done.status();
    }
    c.posted.push_back(
        Posted{std::move(b), std::move(r), *std::move(done), now + options_.transfer_timeout});
  }
  // Completed receives, in order.
  while (!c.posted.empty()) {
    Posted& p = c.posted.front();
    const absl::Status st = p.done->Query();
    if (absl::IsUnavailable(st)) {
      if (now > p.deadline) {
        return absl::DeadlineExceededError("nccl: a receive did not complete in time");
      }
      break;
    }
    MOE_RETURN_IF_ERROR(st);
    callbacks->push_back([received = std::move(p.batch.received), r = std::move(p.received)]() {
      received(r);
    });
    c.posted.pop_front();
  }
  // Completed sends: their buffers go back.
  while (!c.sending.empty()) {
    Sending& s = c.sending.front();
    const absl::Status st = s.done->Query();
    if (absl::IsUnavailable(st)) {
      if (now > s.deadline) return absl::DeadlineExceededError("nccl: a send did not complete");
      break;
    }
    MOE_RETURN_IF_ERROR(st);
    for (const NcclBuffer& b : s.buffers) s.link->Release(b);
    c.sending.pop_front();
  }
  if (c.gate.holding() && now - c.gap_since > options_.transfer_timeout) {
    return absl::DeadlineExceededError(absl::StrCat(
        "nccl: micro-batch ", c.gate.next(), " of the channel never came"));
  }
  return absl::OkStatus();
}

void NcclChannels::PumpLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    std::vector<std::function<void()>> callbacks;
    std::vector<std::pair<std::shared_ptr<Channel>, absl::Status>> ended;
    bool busy = false;
    for (auto it = channels_.begin(); it != channels_.end();) {
      Channel& c = *it->second;
      const absl::Status st = PumpChannel(c, &callbacks);
      if (!st.ok()) {
        ended.emplace_back(it->second, st);
        it = channels_.erase(it);
        continue;
      }
      busy = busy || !c.ready || !c.posted.empty() || !c.sending.empty();
      ++it;
    }
    if (!callbacks.empty() || !ended.empty()) {
      lock.unlock();
      for (auto& cb : callbacks) cb();
      for (auto& [c, st] : ended) {
        EndChannel(c, absl::UnavailableError(absl::StrCat("nccl: channel ", c->id,
                                                          " aborted: ", st.message())));
      }
      lock.lock();
      continue;
    }
    if (busy) {
      wake_.wait_for(lock, kBusyPoll);
    } else {
      wake_.wait_for(lock, kIdlePoll);
    }
  }
}

}  // namespace moe::server
