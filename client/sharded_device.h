// ShardedLayer's device path (internal to the library; client.h does not include it): a
// micro-batch whose tensors live on the trainer's GPU is split, sent and summed there, and the
// host sees one small copy per micro-batch, the shards' row counts (it needs them to size each
// shard's call).
//
// Why it is built this way: docs/decisions/0019-sharded-device-calls.md.
//
// Two implementations behind one header, as device.h: sharded_device_cuda.cc in a client built
// with CUDA, sharded_device_none.cc without, where MakeShardedDevice returns null (ShardedLayer
// refuses device tensors before it would be needed).
//
// Forward, on the trainer's GPU: a flag per (shard, token) and CUB's stable compaction give each
// shard its rows in ascending token order (shard_rows.h); x, ids and weights rows are gathered
// into the shard's buffers, every shard with rows gets RemoteLayer::ForwardInto at once (the
// connection picks CUDA IPC or NCCL as for any call), and once all have answered, out is zeroed
// and each partial scatter-added in shard order: bitwise the host path's sums. Backward gathers
// dout the same way and sums dx and dweights likewise.
//
// Streams: the call records an event on the caller's stream when it is made and runs on a
// stream of its own (a lane) that waits on it, so a micro-batch waits for no other one's shards;
// before the future is ready the caller's stream is made to wait on the lane's last work. The
// per-shard buffers are cudaMalloc'd (CUDA IPC cannot export a stream-ordered pool's memory) and
// pooled: each keeps an event recorded after its last use, and the next user's lane waits on it,
// so a steady loop allocates nothing. A buffer whose shard call failed is not reused (its server
// may still be writing it) but kept until the layer goes. Thread-safe.
#ifndef MOE_CLIENT_SHARDED_DEVICE_H_
#define MOE_CLIENT_SHARDED_DEVICE_H_

#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace moe::client {

class ShardedDevice {
 public:
  virtual ~ShardedDevice() = default;
  // x [T, d] float32, expert_ids [T, K] int32, weights [T, K] float32 and out [T, d] float32,
  // all on one CUDA device, already checked by the caller. `context_id` nonzero (training) keeps
  // a context under it for Backward. An id outside [0, E) is InvalidArgument naming it; a shard's
  // error fails the call with its status (the shards' server contexts then die with their TTL or
  // the session; none is kept here).
  virtual std::future<absl::StatusOr<ForwardOutput>> Forward(
      const TensorView& x, const TensorView& ids, const TensorView& weights,
      const MutableTensorView& out, void* stream, uint64_t context_id) = 0;
  // Whether a Forward kept `context_id` (and no Backward has taken it yet).
  virtual bool Has(uint64_t context_id) const = 0;
  // dout, dx [T, d] float32 and dweights [T, K] float32 on the context's device (checked here:
  // InvalidArgument naming the field, the context kept). NotFound for an unknown context.
  virtual std::future<absl::StatusOr<BackwardOutput>> Backward(
      uint64_t context_id, const TensorView& dout, const MutableTensorView& dx,
      const MutableTensorView& dweights, void* stream, const BackwardOptions& options) = 0;
};

// `shards[i]` holds experts [ranges[i].first, ranges[i].first + ranges[i].count); the layer
// outlives the ShardedDevice. Null in a client built without CUDA.
struct ExpertRange {
  int64_t first = 0;
  int64_t count = 0;
};
std::unique_ptr<ShardedDevice> MakeShardedDevice(const LayerConfig& config,
                                                 std::vector<RemoteLayer*> shards,
                                                 std::vector<ExpertRange> ranges);

}  // namespace moe::client

#endif  // MOE_CLIENT_SHARDED_DEVICE_H_
