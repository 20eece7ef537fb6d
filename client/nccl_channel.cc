// NcclChannel and NcclRoute (see nccl_channel.h): opening a channel, posting in sequence, and the
// connection's decision to use NCCL.
#include "client/nccl_channel.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::client {
namespace {

// CloseNcclChannel without waiting for it (a call's completion runs on gRPC's thread, where a
// blocking call must not): best effort, as the session's end frees the channel anyway.
void CloseOnServer(Connection& conn, uint64_t id) {
  struct Call {
    grpc::ClientContext ctx;
    v1::CloseNcclChannelRequest req;
    v1::CloseNcclChannelResponse resp;
  };
  auto* call = new Call();
  conn.Prepare(&call->ctx);
  call->req.set_channel_id(id);
  conn.stub()->async()->CloseNcclChannel(&call->ctx, &call->req, &call->resp,
                                         [call](grpc::Status) { delete call; });
}

}  // namespace

bool WantsNccl(DeviceTransportRequest requested, bool nccl_built, bool local_target) {
  switch (requested) {
    case DeviceTransportRequest::kNever:
      return false;
    case DeviceTransportRequest::kNccl:
      return nccl_built;
    case DeviceTransportRequest::kAuto:
      return nccl_built && !local_target;
  }
  return false;
}

int NcclCallDevice(absl::Span<const TensorView* const> inputs,
                   absl::Span<const MutableTensorView* const> required,
                   absl::Span<const MutableTensorView* const> optional) {
  int device = -1;
  auto on = [&device](const MemoryLocation& at) {
    if (!at.is_cuda() || at.device < 0 || (device >= 0 && at.device != device)) return false;
    device = at.device;
    return true;
  };
  for (const TensorView* v : inputs) {
    if (!v->empty() && !on(v->location)) return -1;
  }
  for (const MutableTensorView* d : required) {
    if (d->empty() || !on(d->location)) return -1;
  }
  for (const MutableTensorView* d : optional) {
    if (!d->empty() && !on(d->location)) return -1;
  }
  return device;
}

absl::StatusOr<std::shared_ptr<NcclChannel>> NcclChannel::Open(Connection& conn, int device) {
  if (!nccl::Built()) {
    return absl::FailedPreconditionError("this client was built without NCCL");
  }
  v1::OpenNcclChannelResponse resp;
  {
    grpc::ClientContext ctx;
    conn.Prepare(&ctx);
    MOE_RETURN_IF_ERROR(
        FromGrpcStatus(conn.stub()->OpenNcclChannel(&ctx, v1::OpenNcclChannelRequest(), &resp)));
  }
  std::shared_ptr<NcclChannel> c(new NcclChannel());
  c->id_ = resp.channel_id();
  c->device_ = device;
  c->server_device_ = resp.device();
  absl::StatusOr<std::unique_ptr<nccl::Link>> link =
      nccl::Link::Start(device, resp.to_server_id(), resp.to_client_id());
  absl::Status st = link.status();
  if (st.ok()) st = (*link)->WaitReady(conn.options().timeout);
  if (!st.ok()) {
    CloseOnServer(conn, c->id_);
    return st;
  }
  c->link_ = *std::move(link);
  return c;
}

NcclChannel::~NcclChannel() { Abort(); }

absl::StatusOr<NcclChannel::Ticket> NcclChannel::Post(absl::Span<const NcclBuffer> sends,
                                                      absl::Span<const NcclBuffer> receives,
                                                      void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (link_ == nullptr) return absl::FailedPreconditionError("nccl: the channel was aborted");
  Ticket t;
  MOE_ASSIGN_OR_RETURN(t.posted, link_->Post(sends, receives, stream));
  t.seq = next_seq_++;
  return t;
}

void NcclChannel::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (link_ != nullptr) link_->Abort();
}

NcclRoute::NcclRoute(DeviceTransportRequest requested, bool local_target,
                     std::function<void(const std::string&)> log)
    : wanted_(WantsNccl(requested, nccl::Built(), local_target)), log_(std::move(log)) {}

bool NcclRoute::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wanted_ && !given_up_;
}

bool NcclRoute::chosen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chosen_ && !given_up_;
}

std::shared_ptr<NcclChannel> NcclRoute::Channel(Connection& conn, int device) {
  // Held while opening, so that concurrent first calls open one channel.
  std::lock_guard<std::mutex> lock(mu_);
  if (!wanted_ || given_up_) return nullptr;
  if (channel_ != nullptr) return channel_->device() == device ? channel_ : nullptr;
  absl::StatusOr<std::shared_ptr<NcclChannel>> opened = NcclChannel::Open(conn, device);
  std::string line;
  if (opened.ok()) {
    channel_ = *opened;
    if (!chosen_) {
      line = absl::StrCat("device tensors over NCCL (channel to ", channel_->server_device(),
                          " from cuda:", device, ")");
    }
    chosen_ = true;
  } else if (!chosen_) {
    given_up_ = true;
    line = absl::StrCat("device tensors staged through host memory (NCCL refused: ",
                        absl::StatusCodeToString(opened.status().code()), ": ",
                        opened.status().message(), ")");
  } else {
    // NCCL worked before: this call fails over to the other path, the next tries again.
    line = absl::StrCat("an NCCL channel could not be reopened: ", opened.status().message());
  }
  if (!line.empty()) {
    const std::string text = absl::StrCat("moe::client: ", conn.target(), ": ", line);
    if (log_) log_(text);
  }
  return channel_;
}

void NcclRoute::Drop(Connection& conn, const std::shared_ptr<NcclChannel>& channel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (channel_ == channel) channel_ = nullptr;
  }
  channel->Abort();
  CloseOnServer(conn, channel->id());
}

}  // namespace moe::client
