// moe-service-bench's two trainers, driving the same micro-batches through the service (a
// RemoteLayer) and through the engine in process (a Layer), with the tensors in host memory or
// on a GPU, and the steps both run: a training step is N Forwards in flight, then their N
// Backwards in flight, then Step (unless the bench says not); an inference round is N inference
// Forwards in flight. In process the N calls run one after the other, as the server's single
// per-device executor runs them.
//
// A trainer with its tensors on a GPU (DeviceTensors) keeps each micro-batch's inputs and
// results in one cudaMalloc'd block, as a framework's caching allocator would, and orders
// everything on one stream: the service gets device views and device destinations (no copy
// through the host with CUDA IPC), the in-process baseline the same engine's Layer API on the same
// device tensors. Each step or round ends with the stream synchronized, so its time covers the
// GPU work.
#ifndef MOE_BENCH_SERVICE_TRAINERS_H_
#define MOE_BENCH_SERVICE_TRAINERS_H_

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/service/device_tensors.h"
#include "bench/service/service_bench.h"
#include "client/client.h"
#include "engine/layer.h"

namespace moe::bench {

// One micro-batch's inputs in host memory: x, dout [T, d]; ids, weights [T, K] (client routing).
struct MicroBatch {
  Tensor x, ids, weights, dout;
};
MicroBatch MakeMicroBatch(const LayerConfig& cfg, int64_t tokens, std::mt19937_64& rng);

// The micro-batches on a GPU: each one's inputs and destinations in one block.
class DeviceTensors {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceTensors>> Upload(
      int device, const std::vector<MicroBatch>& mbs);
  TensorView x(size_t i) const { return In(i, 0); }
  TensorView ids(size_t i) const { return In(i, 1); }
  TensorView weights(size_t i) const { return In(i, 2); }
  TensorView dout(size_t i) const { return In(i, 3); }
  MutableTensorView out(size_t i) const { return Dest(i, 0); }
  MutableTensorView dx(size_t i) const { return Dest(i, 1); }
  MutableTensorView dweights(size_t i) const { return Dest(i, 2); }  // empty: server routing
  void* stream() const { return stream_->get(); }
  absl::Status Synchronize() const { return stream_->Synchronize(); }
  // out(i), copied to host memory.
  absl::StatusOr<Tensor> DownloadOut(size_t i) const;

 private:
  struct Placed {  // a tensor of a micro-batch's block
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
    int64_t offset = 0;
    int64_t bytes = 0;
  };
  struct Block {
    std::unique_ptr<DeviceBuffer> memory;
    Placed in[4];    // x, ids, weights, dout
    Placed dest[3];  // out, dx, dweights
  };
  TensorView In(size_t i, int k) const;
  MutableTensorView Dest(size_t i, int k) const;
  int device_ = -1;
  std::vector<Block> blocks_;
  std::unique_ptr<DeviceStream> stream_;
};

// The service side: starts micro-batch i's Forward or Backward; `finish` ends a step or round
// (waits for the trainer's stream).
struct ServiceTrainer {
  std::function<std::future<absl::StatusOr<client::ForwardOutput>>(size_t i, bool training)>
      forward;
  std::function<std::future<absl::StatusOr<client::BackwardOutput>>(size_t i, uint64_t ctx)>
      backward;
  std::function<absl::Status()> finish = [] { return absl::OkStatus(); };
  // The optimizer step, for ServiceTrainStep without a layer (a sharded layer's).
  std::function<absl::Status()> step;
};
// The in-process side: micro-batch i's requests.
struct InprocTrainer {
  std::function<ForwardRequest(size_t i, bool training)> forward;
  std::function<BackwardRequest(size_t i)> backward;
  std::function<absl::Status()> finish = [] { return absl::OkStatus(); };
};

// Host tensors: lent as views, or, when `owned` is set, this rep's copies handed over.
ServiceTrainer HostService(client::RemoteLayer& layer, const std::vector<MicroBatch>& mbs,
                           std::vector<MicroBatch>* owned);
InprocTrainer HostInproc(const std::vector<MicroBatch>& mbs);
// Device tensors, results into their device destinations, stepping `layer`: a
// client::RemoteLayer or a client::ShardedLayer.
template <typename RemoteLayerT>
ServiceTrainer DeviceService(RemoteLayerT& layer, const DeviceTensors& dev);
InprocTrainer DeviceInproc(const DeviceTensors& dev);

// One training step / inference round of `mbs.size()` micro-batches. `r` (may be null: a warmup)
// gets latencies and payload bytes. A training step ends with Step when `optimizer_step`. A
// service step that fails returns its first error only once every call it started is complete
// and `finish` has run, so that the caller may free the tensors and the stream at once.
absl::Status ServiceTrainStep(client::RemoteLayer& layer, const ServiceTrainer& t,
                              const std::vector<MicroBatch>& mbs, bool optimizer_step,
                              ModeResult* r);
// The same, stepping with t.step.
absl::Status ServiceTrainStep(const ServiceTrainer& t, const std::vector<MicroBatch>& mbs,
                              bool optimizer_step, ModeResult* r);
absl::Status ServiceInferRound(const ServiceTrainer& t, const std::vector<MicroBatch>& mbs,
                               ModeResult* r);
absl::Status InprocTrainStep(Layer& layer, const InprocTrainer& t, size_t n, bool optimizer_step,
                             ModeResult* r);
absl::Status InprocInferRound(Layer& layer, const InprocTrainer& t, size_t n, ModeResult* r);

}  // namespace moe::bench

#endif  // MOE_BENCH_SERVICE_TRAINERS_H_
