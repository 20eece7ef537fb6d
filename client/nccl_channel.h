// The client's NCCL channels (internal to the library; client.h does not include it): when a
// connection sends device tensors over NCCL, the channel it opened, the order it posts in, and
// the decision whether to use one at all (docs/PROTOCOL.md, "NCCL channels";
// docs/decisions/0018-nccl-transport.md).
//
// NcclChannel: OpenNcclChannel, then the client's side of the two communicators (nccl_link.h) on
// the trainer's device. Post takes the channel's next sequence number and posts the call's sends
// and receives under one lock, so the numbers follow the post order, which the server matches;
// the call's RPC may then go at any time, on any connection.
//
// NcclRoute: one per connection. Whether eligible device calls try NCCL (WantsNccl), the channel
// (opened by the first such call; a failure is logged once and device tensors are staged from
// then on), and dropping a channel whose call failed (its order with the server is unknown), so
// the next call opens another. Thread-safe.
#ifndef MOE_CLIENT_NCCL_CHANNEL_H_
#define MOE_CLIENT_NCCL_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/nccl_link.h"
#include "common/tensor.h"

namespace moe::client {

// kAuto: NCCL when the client has it and the server is on another host; kNccl: whenever the
// client has it; kNever: never.
bool WantsNccl(DeviceTransportRequest requested, bool nccl_built, bool local_target);

// The device of a call that can go over NCCL: every input given and every required destination
// on one CUDA device, each optional destination empty or there too. -1 when the call cannot
// (a host tensor, two devices, a required destination missing).
int NcclCallDevice(absl::Span<const TensorView* const> inputs,
                   absl::Span<const MutableTensorView* const> required,
                   absl::Span<const MutableTensorView* const> optional);

class NcclChannel {
 public:
  // OpenNcclChannel on `conn`, then joins as rank 0 on `device`, waiting (up to the connection's
  // timeout) for both communicators.
  static absl::StatusOr<std::shared_ptr<NcclChannel>> Open(Connection& conn, int device);
  ~NcclChannel();  // aborts the communicators

  uint64_t id() const { return id_; }
  int device() const { return device_; }
  const std::string& server_device() const { return server_device_; }

  struct Ticket {
    uint64_t seq = 0;
    std::unique_ptr<nccl::Posted> posted;
  };
  // The next sequence number, with the call's transfers posted after `stream`'s work.
  absl::StatusOr<Ticket> Post(absl::Span<const NcclBuffer> sends,
                              absl::Span<const NcclBuffer> receives, void* stream);
  void Abort();

 private:
  NcclChannel() = default;
  uint64_t id_ = 0;
  int device_ = -1;
  std::string server_device_;
  std::mutex mu_;
  uint64_t next_seq_ = 1;
  std::unique_ptr<nccl::Link> link_;
};

class NcclRoute {
 public:
  NcclRoute(DeviceTransportRequest requested, bool local_target,
            std::function<void(const std::string&)> log);

  // Whether calls should try NCCL now: wanted, and not given up on.
  bool active() const;
  // True once a channel has been opened (DeviceTransport::kNccl).
  bool chosen() const;
  // The channel for a call on `device`: the open one, or a new one. Null when NCCL is given up
  // (the first channel could not be opened: logged with the reason, once) or the call's device
  // is not the channel's (such calls go the other way).
  std::shared_ptr<NcclChannel> Channel(Connection& conn, int device);
  // A call on `channel` failed: the channel is aborted and closed on the server (best effort);
  // the next call opens a new one.
  void Drop(Connection& conn, const std::shared_ptr<NcclChannel>& channel);

 private:
  const bool wanted_;
  std::function<void(const std::string&)> log_;
  mutable std::mutex mu_;
  bool given_up_ = false;
  bool chosen_ = false;
  std::shared_ptr<NcclChannel> channel_;
};

// ForwardInto / BackwardInto over NCCL, for Connection (region_calls.cc): nullopt when the call
// does not go that way (not eligible, NCCL not wanted or given up), so the caller takes the
// other path; else the call's future.
std::optional<std::future<absl::StatusOr<ForwardOutput>>> NcclForwardInto(
    Connection& conn, const std::shared_ptr<NcclRoute>& route, const std::string& layer,
    uint64_t context_id, bool training, const TensorView& x, const TensorView& ids,
    const TensorView& weights, const MutableTensorView& out, void* stream);
std::optional<std::future<absl::StatusOr<BackwardOutput>>> NcclBackwardInto(
    Connection& conn, const std::shared_ptr<NcclRoute>& route, const std::string& layer,
    uint64_t context_id, const TensorView& dout, const MutableTensorView& dx,
    const MutableTensorView& dweights, void* stream, const BackwardOptions& options);

}  // namespace moe::client

#endif  // MOE_CLIENT_NCCL_CHANNEL_H_
