// NcclChannels: the NCCL channels clients opened (OpenNcclChannel), the order their micro-batches'
// transfers are posted in, and the watchdog that ends a channel whose peer is gone
// (docs/PROTOCOL.md, "NCCL channels"; docs/decisions/0018-nccl-transport.md).
//
// Ownership as for regions (region_registry.h): a channel belongs to the session of the opening
// call and to its principal. Another principal's id, or one never issued, is NotFound; the same
// principal's channel named from another session is PermissionDenied. A channel is aborted when
// closed, when its session ends, when its communicators report an error, and when a transfer or
// a gap in its sequence outlasts the transfer timeout; its calls then fail with Unavailable.
//
// Order: a micro-batch names its channel and sequence number; the channel's receives are posted
// strictly in number order (SequenceGate holds a call that came early), by the pump thread, which
// also polls every posted transfer: once a micro-batch's inputs are in, its `received` callback
// runs (it queues the engine call on the device executor, which then sends the results, so sends
// follow number order too). Transfer sizes come from the request alone (PlanForward,
// PlanBackward), so a refused call still receives its inputs and sends zeros of its results' size
// and the channel stays in step with the client.
//
// The pump is the only thread that waits on NCCL; reactions only queue, and the executor only
// posts. Thread-safe.
#ifndef MOE_SERVER_NCCL_CHANNELS_H_
#define MOE_SERVER_NCCL_CHANNELS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "engine/nccl.h"
#include "moe/v1/moe.pb.h"
#include "server/region_registry.h"

namespace moe::server {

// What one micro-batch moves over its channel, from its request alone.
struct NcclPlan {
  struct Part {
    bool present = false;  // an absent input (server routing's ids, weights) moves nothing
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
    int64_t bytes = 0;
  };
  std::vector<Part> inputs;   // in the request's order: x, expert_ids, weights | dout
  std::vector<Part> outputs;  // out | dx, dweights
};
// Forward: x (required), expert_ids and weights as present, each dtype and shape only (no data,
// no ref, offset 0); out is x's dtype and shape. No out_ref, event_id or stripe. InvalidArgument
// naming the field otherwise.
absl::StatusOr<NcclPlan> PlanForward(const v1::ForwardRequest& request);
// Backward: dout (required, [T, ...]); dx is dout's dtype and shape; dweights [T, dweights_k]
// float32 when nccl.dweights_k > 0. No dx_ref, dweights_ref, event_id or stripe.
absl::StatusOr<NcclPlan> PlanBackward(const v1::BackwardRequest& request);

// Admits sequence numbers 1, 2, 3... in order: an item offered early is held until those before
// it have come. Offer returns the items now admitted, in order. A number already admitted or
// held is InvalidArgument; one more than `max_held` ahead of the next is ResourceExhausted.
template <typename T>
class SequenceGate {
 public:
  explicit SequenceGate(size_t max_held) : max_held_(max_held) {}
  absl::StatusOr<std::vector<T>> Offer(uint64_t seq, T item) {
    if (seq < next_ || held_.count(seq) != 0) {
      return absl::InvalidArgumentError(
          "nccl.seq: " + std::to_string(seq) + " was already used on this channel");
    }
    if (seq - next_ > max_held_) {
      return absl::ResourceExhaustedError(
          "nccl.seq: " + std::to_string(seq) + " is more than " + std::to_string(max_held_) +
          " ahead of the next expected, " + std::to_string(next_));
    }
    held_.emplace(seq, std::move(item));
    std::vector<T> ready;
    for (auto it = held_.find(next_); it != held_.end(); it = held_.find(next_)) {
      ready.push_back(std::move(it->second));
      held_.erase(it);
      ++next_;
    }
    return ready;
  }
  uint64_t next() const { return next_; }
  bool holding() const { return !held_.empty(); }
  // Takes every held item (the channel is ending).
  std::vector<T> TakeHeld() {
    std::vector<T> out;
    for (auto& [seq, item] : held_) out.push_back(std::move(item));
    held_.clear();
    return out;
  }

 private:
  size_t max_held_;
  uint64_t next_ = 1;
  std::map<uint64_t, T> held_;
};

struct NcclChannelsOptions {
  // A posted transfer, or a gap in a channel's sequence, may last this long before the channel
  // is aborted.
  std::chrono::milliseconds transfer_timeout{60000};
  size_t max_held = 64;  // micro-batches a channel holds ahead of a missing one
  int max_channels_per_principal = 16;
};

class NcclChannels {
 public:
  // A micro-batch's inputs, received into device buffers (in plan order; an absent input's is
  // empty), and the buffers its outputs are to be sent from.
  struct Received {
    std::shared_ptr<NcclLink> link;
    std::vector<NcclBuffer> inputs;
    std::vector<NcclBuffer> outputs;
    uint64_t channel_id = 0;
  };
  // `received` runs on the pump thread once the inputs are in; `failed` instead when they will
  // never be (the channel ended). Exactly one of them runs.
  struct Batch {
    NcclPlan plan;
    std::function<void(Received)> received;
    std::function<void(absl::Status)> failed;
  };
  // Starts a link: the engine's (Engine::StartNcclLink), faked in tests.
  using LinkFactory = std::function<absl::StatusOr<std::unique_ptr<NcclLink>>()>;

  NcclChannels(NcclChannelsOptions options, LinkFactory start_link);
  ~NcclChannels();  // aborts every channel, then stops the pump
  NcclChannels(const NcclChannels&) = delete;
  NcclChannels& operator=(const NcclChannels&) = delete;

  void OpenSession(const std::string& session, const std::string& principal);
  // Aborts the session's channels. Idempotent.
  void DropSession(const std::string& session);

  // OpenNcclChannel: FailedPrecondition without an open session of the caller's (or from the
  // engine: no NCCL), PermissionDenied for another principal's session, ResourceExhausted past
  // max_channels_per_principal.
  absl::StatusOr<v1::OpenNcclChannelResponse> Open(const RegionOwner& owner);
  absl::Status Close(const RegionOwner& owner, uint64_t channel_id);

  // Queues a micro-batch on channel `transfer.channel_id` at `transfer.seq`: NotFound /
  // PermissionDenied (naming "nccl.channel_id") for a channel that is not the caller's, with
  // nothing else touched; a bad sequence number aborts the channel (its order is lost) and is
  // returned. OK: `batch.received` or `batch.failed` will run.
  absl::Status Submit(const RegionOwner& owner, const v1::NcclTransfer& transfer, Batch batch);
  // Aborts the caller's channel `channel_id` with `why` (a request whose transfer sizes could not
  // be known). No-op for a channel that is not the caller's.
  void Abort(const RegionOwner& owner, uint64_t channel_id, const absl::Status& why);
  // The sends of a micro-batch's results: the pump gives `buffers` back to the link once
  // `sent` completes, and aborts the channel if it does not within the timeout.
  void TrackSend(uint64_t channel_id, std::shared_ptr<NcclLink> link,
                 std::unique_ptr<NcclCompletion> sent, std::vector<NcclBuffer> buffers);

  int64_t channels() const;

 private:
  struct Posted {
    Batch batch;
    Received received;
    std::unique_ptr<NcclCompletion> done;
    std::chrono::steady_clock::time_point deadline;
  };
  struct Sending {
    std::shared_ptr<NcclLink> link;
    std::unique_ptr<NcclCompletion> done;
    std::vector<NcclBuffer> buffers;
    std::chrono::steady_clock::time_point deadline;
  };
  struct Channel {
    uint64_t id = 0;
    RegionOwner owner;
    std::shared_ptr<NcclLink> link;
    bool ready = false;
    std::chrono::steady_clock::time_point bootstrap_deadline;
    SequenceGate<Batch> gate;
    std::chrono::steady_clock::time_point gap_since;  // while the gate holds a call
    std::deque<Batch> to_post;  // admitted, in order, not yet posted
    std::deque<Posted> posted;  // receives in flight, in order
    std::deque<Sending> sending;
    explicit Channel(size_t max_held) : gate(max_held) {}
  };

  // NotFound / PermissionDenied unless the channel is `owner`'s.
  absl::StatusOr<std::shared_ptr<Channel>> FindLocked(const RegionOwner& owner, uint64_t id) const;
  // Removes the channel; its calls are failed and its link aborted by EndChannel, outside mu_.
  std::shared_ptr<Channel> RemoveLocked(uint64_t id);
  void EndChannel(std::shared_ptr<Channel> channel, const absl::Status& why);
  void PumpLoop();
  // One pass over a channel: bootstrap, posts, completions, deadlines. An error ends it.
  absl::Status PumpChannel(Channel& c, std::vector<std::function<void()>>* callbacks);

  const NcclChannelsOptions options_;
  const LinkFactory start_link_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  // Once stopping: the aborts the destructor joins (each channel's on a thread of its own).
  std::vector<std::thread> final_aborts_;
  std::map<std::string, std::string> sessions_;  // open session -> principal
  std::map<uint64_t, std::shared_ptr<Channel>> channels_;
  std::mt19937_64 ids_;
  std::thread pump_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_NCCL_CHANNELS_H_
