// ShardedLayer's device path in a client built with CUDA (see sharded_device.h): the pools of
// lanes and buffers per device, and Forward and Backward over the shards.
//
// A call's life: on the caller's thread, its lane's stream is made to wait on the caller's
// stream (so the call sees the inputs as they were when it was made); the rest runs on a thread
// of its own (std::async, as the host path): the shards' rows, one device-to-host copy of their
// counts (the one place the host waits on the GPU), the gathers, the shards' calls, their sums,
// and at last the caller's stream made to wait on the lane.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/shard_rows.h"
#include "client/sharded_device.h"
#include "common/status_macros.h"
#include "engine/cuda/ipc_export.h"
#include "kernels/cuda/gather.h"

namespace moe::client {
namespace {

// Buffers are placed at multiples of this in their block (CUDA IPC references need 16).
constexpr int64_t kAlign = 256;
// New blocks are rounded up to this, so micro-batches of nearly one size share them.
constexpr int64_t kBlockGranularity = int64_t{2} << 20;

int64_t Aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clears a non-sticky error so later calls are not blamed for it
  return absl::InternalError(absl::StrCat("sharded layer: ", what, ": ", cudaGetErrorName(e),
                                          " (", cudaGetErrorString(e), ")"));
}

template <typename Out>
std::future<absl::StatusOr<Out>> Ready(absl::StatusOr<Out> value) {
  std::promise<absl::StatusOr<Out>> p;
  p.set_value(std::move(value));
  return p.get_future();
}

// One cudaMalloc'd block and the event recorded after its last use.
struct Block {
  char* data = nullptr;
  int64_t bytes = 0;
  cudaEvent_t last_use = nullptr;
};

// Blocks of one device, reused best fit; each new user's stream waits on the block's last use.
class BlockPool {
 public:
  explicit BlockPool(int device) : device_(device) {}
  ~BlockPool() {  // the owner made the device current; every block is idle by then
    for (auto* list : {&free_, &retired_}) {
      for (std::unique_ptr<Block>& b : *list) Free(*b);
    }
  }
  absl::StatusOr<std::unique_ptr<Block>> Acquire(int64_t bytes, cudaStream_t stream) {
    std::unique_ptr<Block> b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if ((*it)->bytes >= bytes && (best == free_.end() || (*it)->bytes < (*best)->bytes)) {
          best = it;
        }
      }
      if (best != free_.end()) {
        b = std::move(*best);
        free_.erase(best);
      }
    }
    if (b == nullptr) {
      b = std::make_unique<Block>();
      b->bytes = std::max<int64_t>(1, (bytes + kBlockGranularity - 1) / kBlockGranularity) *
                 kBlockGranularity;
      void* p = nullptr;
      if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(b->bytes)); e != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(
            absl::StrCat("sharded layer: cudaMalloc of ", b->bytes, " bytes on cuda:", device_,
                         " failed: ", cudaGetErrorName(e)));
      }
      b->data = static_cast<char*>(p);
      if (cudaError_t e = cudaEventCreateWithFlags(&b->last_use, cudaEventDisableTiming);
          e != cudaSuccess) {
        cudaFree(p);
        return CudaError(e, "cudaEventCreateWithFlags");
      }
      return b;  // never used: nothing to wait for
    }
    if (absl::Status st = CudaError(cudaStreamWaitEvent(stream, b->last_use, 0),
                                    "cudaStreamWaitEvent");
        !st.ok()) {
      Release(std::move(b), nullptr, /*reuse=*/false);
      return st;
    }
    return b;
  }
  // After the work enqueued on `stream` so far: back to the pool, or (reuse false: a server may
  // still write it after a failed call) kept aside until the pool goes.
  void Release(std::unique_ptr<Block> b, cudaStream_t stream, bool reuse) {
    if (b == nullptr) return;
    if (reuse && cudaEventRecord(b->last_use, stream) != cudaSuccess) {
      cudaGetLastError();
      reuse = false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    (reuse ? free_ : retired_).push_back(std::move(b));
  }
  // Records the block's last use so far without giving it back (a context keeps its rows).
  absl::Status MarkUsed(Block& b, cudaStream_t stream) {
    return CudaError(cudaEventRecord(b.last_use, stream), "cudaEventRecord");
  }

 private:
  static void Free(Block& b) {
    if (b.last_use != nullptr) {
      cudaEventSynchronize(b.last_use);
      cudaEventDestroy(b.last_use);
    }
    cudaFree(b.data);
  }
  const int device_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Block>> free_, retired_;
};

// A call's own stream, its events and the page-locked summary (row counts, first bad id).
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, counted = nullptr, done = nullptr;
  int32_t* summary = nullptr;  // page-locked
};

class LanePool {
 public:
  LanePool(int device, int64_t summary_ints) : device_(device), summary_ints_(summary_ints) {}
  ~LanePool() {  // the owner made the device current
    for (std::unique_ptr<Lane>& l : free_) {
      cudaStreamSynchronize(l->stream);
      for (cudaEvent_t e : {l->start, l->counted, l->done}) cudaEventDestroy(e);
      cudaStreamDestroy(l->stream);
      cudaFreeHost(l->summary);
    }
  }
  absl::StatusOr<std::unique_ptr<Lane>> Acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        std::unique_ptr<Lane> l = std::move(free_.back());
        free_.pop_back();
        return l;
      }
    }
    auto l = std::make_unique<Lane>();
    absl::Status st = CudaError(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking),
                                "cudaStreamCreateWithFlags");
    for (cudaEvent_t* e : {&l->start, &l->counted, &l->done}) {
      if (st.ok()) {
        st = CudaError(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags");
      }
    }
    void* host = nullptr;
    if (st.ok()) {
      st = CudaError(cudaMallocHost(&host, static_cast<size_t>(summary_ints_) * sizeof(int32_t)),
                     "cudaMallocHost");
    }
    l->summary = static_cast<int32_t*>(host);
    if (!st.ok()) {
      for (cudaEvent_t e : {l->start, l->counted, l->done}) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      if (l->stream != nullptr) cudaStreamDestroy(l->stream);
      cudaFreeHost(host);
      return st;
    }
    return l;
  }
  void Release(std::unique_ptr<Lane> l) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(l));
  }

 private:
  const int device_;
  const int64_t summary_ints_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Lane>> free_;
};

// What one device holds for the layer: the expert -> shard table and the pools.
struct DeviceState {
  DeviceState(int device, int64_t summary_ints)
      : device(device), index(device), work(device), lanes(device, summary_ints) {}
  ~DeviceState() { cudaFree(shard_of); }
  int device;
  int32_t* shard_of = nullptr;  // [E]
  BlockPool index;  // a micro-batch's rows, flags, summary and CUB scratch
  BlockPool work;   // a shard's gathered inputs and results
  LanePool lanes;
};

// Where a micro-batch's row bookkeeping lies in its index block.
struct IndexLayout {
  IndexLayout(int64_t tokens, int64_t shards, size_t temp) : tokens(tokens), temp_bytes(temp) {
    flags = Aligned(shards * tokens * 4);
    summary = flags + Aligned(shards * tokens);
    scratch = summary + Aligned(shard_rows::SummaryInts(shards) * 4);
    bytes = scratch + Aligned(static_cast<int64_t>(temp));
  }
  int32_t* rows(const Block& b, size_t s) const {
    return reinterpret_cast<int32_t*>(b.data) + s * tokens;
  }
  int64_t tokens;
  size_t temp_bytes;
  int64_t flags = 0, summary = 0, scratch = 0, bytes = 0;  // offsets, total
};

// A shard's buffers in its work block, for `rows` rows at most: a and b [rows, d] float32, c and
// d [rows, K] of 4-byte elements. Forward: x, out, ids, weights; Backward: dout, dx, -, dweights.
struct WorkLayout {
  WorkLayout(int64_t rows, int64_t d_model, int64_t top_k) {
    const int64_t wide = Aligned(rows * d_model * 4), narrow = Aligned(rows * top_k * 4);
    b = wide;
    c = 2 * wide;
    d = 2 * wide + narrow;
    bytes = 2 * wide + 2 * narrow;
  }
  int64_t b = 0, c = 0, d = 0, bytes = 0;  // a is at 0
};

TensorView In(const Block& blk, int64_t offset, DType dtype, int64_t rows, int64_t cols,
              int device) {
  return {dtype, {rows, cols}, blk.data + offset, static_cast<size_t>(rows * cols * 4),
          MemoryLocation::Cuda(device)};
}
MutableTensorView Out(const Block& blk, int64_t offset, int64_t rows, int64_t cols, int device) {
  return {DType::kFloat32, {rows, cols}, blk.data + offset, static_cast<size_t>(rows * cols * 4),
          MemoryLocation::Cuda(device)};
}

// InvalidArgument naming `field` unless [p, p + bytes) is memory of `device` inside one
// allocation, 4-byte aligned (the kernels read it as int32 and float).
absl::Status CheckDeviceMemory(const void* p, size_t bytes, int device, absl::string_view field) {
  MOE_ASSIGN_OR_RETURN(const cuda::DeviceAllocation a, cuda::FindDeviceAllocation(p, field));
  if (a.device != device) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": said to be on cuda:", device,
                                                   ", but its memory is on cuda:", a.device));
  }
  const char* begin = static_cast<const char*>(p);
  if (begin + bytes > a.base + a.size_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": its ", bytes, " bytes run past the end of its allocation"));
  }
  if (reinterpret_cast<uintptr_t>(p) % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": not 4-byte aligned"));
  }
  return absl::OkStatus();
}

// Waits for every started call; the first error in shard order.
template <typename Out>
absl::Status JoinAll(std::vector<std::future<absl::StatusOr<Out>>>& futures,
                     std::vector<absl::StatusOr<Out>>* results) {
  absl::Status first;
  results->clear();
  for (auto& f : futures) {
    results->push_back(f.valid() ? f.get() : absl::StatusOr<Out>(Out{}));
    if (!results->back().ok() && first.ok()) first = results->back().status();
  }
  return first;
}

class CudaShardedDevice final : public ShardedDevice {
 public:
  CudaShardedDevice(const LayerConfig& config, std::vector<RemoteLayer*> shards,
                    std::vector<ExpertRange> ranges)
      : config_(config), shards_(std::move(shards)), ranges_(std::move(ranges)) {}
  ~CudaShardedDevice() override;

  std::future<absl::StatusOr<ForwardOutput>> Forward(const TensorView& x, const TensorView& ids,
                                                     const TensorView& weights,
                                                     const MutableTensorView& out, void* stream,
                                                     uint64_t context_id) override;
  bool Has(uint64_t context_id) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return contexts_.count(context_id) > 0;
  }
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id,
                                                       const TensorView& dout,
                                                       const MutableTensorView& dx,
                                                       const MutableTensorView& dweights,
                                                       void* stream,
                                                       const BackwardOptions& options) override;

 private:
  struct Context {
    DeviceState* state = nullptr;
    int64_t tokens = 0;
    std::vector<uint64_t> shard_context;
    std::vector<int64_t> counts;
    std::unique_ptr<Block> index;  // rows of each shard
    IndexLayout layout{0, 1, 0};
  };
  // One call's resources, given back by End.
  struct Call {
    DeviceState* state = nullptr;
    std::unique_ptr<Lane> lane;
    cudaStream_t caller = nullptr;
    std::unique_ptr<Block> index;
    std::vector<std::unique_ptr<Block>> work;  // per shard; null: no rows
    std::vector<bool> failed;                  // per shard: its call failed
  };

  absl::StatusOr<DeviceState*> StateFor(int device);
  // On the caller's thread: a lane whose stream waits on the caller's stream's work so far.
  absl::StatusOr<Call> Begin(int device, void* stream);
  // The caller's stream waits on the lane's work; blocks and lane go back (the index block too
  // unless `keep_index`).
  absl::Status End(Call& call, bool keep_index);
  // Shard s's work block for the call.
  static absl::Status AcquireWork(Call& call, size_t s, int64_t bytes) {
    MOE_ASSIGN_OR_RETURN(call.work[s], call.state->work.Acquire(bytes, call.lane->stream));
    return absl::OkStatus();
  }
  absl::StatusOr<ForwardOutput> RunForward(Call call, TensorView x, TensorView ids,
                                           TensorView weights, MutableTensorView out,
                                           uint64_t context_id);
  absl::StatusOr<BackwardOutput> RunBackward(Call call, Context ctx, TensorView dout,
                                             MutableTensorView dx, MutableTensorView dweights,
                                             BackwardOptions options);

  const LayerConfig config_;
  const std::vector<RemoteLayer*> shards_;
  const std::vector<ExpertRange> ranges_;
  mutable std::mutex mu_;
  std::map<int, std::unique_ptr<DeviceState>> states_;
  std::map<uint64_t, Context> contexts_;
};

CudaShardedDevice::~CudaShardedDevice() {
  // The servers map the work blocks (CUDA IPC) until their regions are unregistered: first that,
  // then the frees. No call is in flight (the layer is going).
  for (RemoteLayer* shard : shards_) shard->connection().ReleaseIdleDeviceRegions().IgnoreError();
  for (auto& [device, state] : states_) {
    cuda::DeviceScope scope(device);
    for (auto it = contexts_.begin(); it != contexts_.end();) {
      if (it->second.state == state.get()) {
        state->index.Release(std::move(it->second.index), nullptr, /*reuse=*/false);
        it = contexts_.erase(it);
      } else {
        ++it;
      }
    }
    state.reset();
  }
}

absl::StatusOr<DeviceState*> CudaShardedDevice::StateFor(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = states_.find(device);
  if (it != states_.end()) return it->second.get();
  cuda::DeviceScope scope(device);
  if (!scope.ok()) return absl::InvalidArgumentError(absl::StrCat("x: cannot use ", scope.error()));
  auto state = std::make_unique<DeviceState>(
      device, shard_rows::SummaryInts(static_cast<int64_t>(shards_.size())));
  std::vector<int32_t> table(static_cast<size_t>(config_.num_experts), 0);
  for (size_t s = 0; s < ranges_.size(); ++s) {
    for (int64_t e = ranges_[s].first; e < ranges_[s].first + ranges_[s].count; ++e) {
      table[static_cast<size_t>(e)] = static_cast<int32_t>(s);
    }
  }
  void* p = nullptr;
  MOE_RETURN_IF_ERROR(CudaError(cudaMalloc(&p, table.size() * sizeof(int32_t)), "cudaMalloc"));
  state->shard_of = static_cast<int32_t*>(p);
  MOE_RETURN_IF_ERROR(CudaError(cudaMemcpy(p, table.data(), table.size() * sizeof(int32_t),
                                           cudaMemcpyHostToDevice),
                                "cudaMemcpy"));
  DeviceState* raw = state.get();
  states_[device] = std::move(state);
  return raw;
}

absl::StatusOr<CudaShardedDevice::Call> CudaShardedDevice::Begin(int device, void* stream) {
  Call call;
  MOE_ASSIGN_OR_RETURN(call.state, StateFor(device));
  cuda::DeviceScope scope(device);
  if (!scope.ok()) return absl::InvalidArgumentError(absl::StrCat("x: cannot use ", scope.error()));
  MOE_ASSIGN_OR_RETURN(call.lane, call.state->lanes.Acquire());
  call.caller = static_cast<cudaStream_t>(stream);
  absl::Status st = CudaError(cudaEventRecord(call.lane->start, call.caller), "cudaEventRecord");
  if (st.ok()) {
    st = CudaError(cudaStreamWaitEvent(call.lane->stream, call.lane->start, 0),
                   "cudaStreamWaitEvent");
  }
  if (!st.ok()) {
    call.state->lanes.Release(std::move(call.lane));
    return st;
  }
  call.work.resize(shards_.size());
  call.failed.assign(shards_.size(), false);
  return call;
}

absl::Status CudaShardedDevice::End(Call& call, bool keep_index) {
  const cudaStream_t lane = call.lane->stream;
  absl::Status st = CudaError(cudaEventRecord(call.lane->done, lane), "cudaEventRecord");
  if (st.ok()) {
    st = CudaError(cudaStreamWaitEvent(call.caller, call.lane->done, 0), "cudaStreamWaitEvent");
  }
  for (size_t s = 0; s < call.work.size(); ++s) {
    call.state->work.Release(std::move(call.work[s]), lane, !call.failed[s]);
  }
  if (keep_index) {
    if (absl::Status m = call.state->index.MarkUsed(*call.index, lane); st.ok()) st = m;
  } else {
    call.state->index.Release(std::move(call.index), lane, /*reuse=*/true);
  }
  call.state->lanes.Release(std::move(call.lane));
  return st;
}

std::future<absl::StatusOr<ForwardOutput>> CudaShardedDevice::Forward(
    const TensorView& x, const TensorView& ids, const TensorView& weights,
    const MutableTensorView& out, void* stream, uint64_t context_id) {
  const int device = x.location.device;
  for (auto [p, bytes, field] : {std::tuple{x.data, x.size_bytes, "x"},
                                 std::tuple{ids.data, ids.size_bytes, "expert_ids"},
                                 std::tuple{weights.data, weights.size_bytes, "weights"},
                                 std::tuple{static_cast<const void*>(out.data), out.size_bytes,
                                            "out"}}) {
    if (absl::Status st = CheckDeviceMemory(p, bytes, device, field); !st.ok()) {
      return Ready<ForwardOutput>(st);
    }
  }
  absl::StatusOr<Call> call = Begin(device, stream);
  if (!call.ok()) return Ready<ForwardOutput>(call.status());
  return std::async(std::launch::async, &CudaShardedDevice::RunForward, this, *std::move(call),
                    x, ids, weights, out, context_id);
}

absl::StatusOr<ForwardOutput> CudaShardedDevice::RunForward(Call call, TensorView x,
                                                            TensorView ids, TensorView weights,
                                                            MutableTensorView out,
                                                            uint64_t context_id) {
  const int device = call.state->device;
  cuda::DeviceScope scope(device);
  const cudaStream_t lane = call.lane->stream;
  const int64_t tokens = x.shape[0], d = config_.d_model, k = config_.top_k;
  const size_t n_shards = shards_.size();
  size_t temp = 0;
  absl::Status st = CudaError(shard_rows::SelectTempBytes(tokens, &temp), "SelectTempBytes");
  const IndexLayout index(tokens, static_cast<int64_t>(n_shards), temp);
  if (st.ok()) {
    absl::StatusOr<std::unique_ptr<Block>> b = call.state->index.Acquire(index.bytes, lane);
    if (b.ok()) call.index = *std::move(b);
    st = b.status();
  }
  // The shards' rows and their counts, the host's one wait on the GPU.
  int32_t* summary = call.lane->summary;
  if (st.ok()) {
    char* base = call.index->data;
    st = CudaError(
        shard_rows::SelectShardRows(
            ids.as<int32_t>(), tokens, static_cast<int32_t>(k), call.state->shard_of,
            static_cast<int32_t>(config_.num_experts), static_cast<int32_t>(n_shards),
            reinterpret_cast<uint8_t*>(base + index.flags), index.rows(*call.index, 0),
            reinterpret_cast<int32_t*>(base + index.summary), base + index.scratch, temp, lane),
        "selecting the shards' rows");
    if (st.ok()) {
      st = CudaError(cudaMemcpyAsync(summary, base + index.summary,
                                     shard_rows::SummaryInts(n_shards) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, lane),
                     "copying the row counts");
    }
    if (st.ok()) st = CudaError(cudaEventRecord(call.lane->counted, lane), "cudaEventRecord");
    if (st.ok()) st = CudaError(cudaEventSynchronize(call.lane->counted), "cudaEventSynchronize");
  }
  if (st.ok() && summary[n_shards] != shard_rows::kNoBadId) {
    const int64_t at = summary[n_shards];
    st = absl::InvalidArgumentError(absl::StrCat("expert_ids: id ", summary[n_shards + 1],
                                                 " at [", at / k, ",", at % k,
                                                 "] is outside [0, ", config_.num_experts, ")"));
  }
  // Each shard's rows gathered, and its call.
  std::vector<int64_t> counts(n_shards, 0);
  std::vector<std::future<absl::StatusOr<ForwardOutput>>> futures(n_shards);
  const WorkLayout work(tokens, d, k);
  const bool training = context_id != 0;
  for (size_t s = 0; st.ok() && s < n_shards; ++s) {
    counts[s] = summary[s];
    if (counts[s] == 0) continue;
    st = AcquireWork(call, s, work.bytes);
    if (!st.ok()) break;
    const Block& w = *call.work[s];
    const int32_t* rows = index.rows(*call.index, s);
    const int64_t n = counts[s];
    for (auto [src, row_bytes, offset] :
         {std::tuple{x.data, d * 4, int64_t{0}}, std::tuple{ids.data, k * 4, work.c},
          std::tuple{weights.data, k * 4, work.d}}) {
      if (st.ok()) {
        st = CudaError(kernels::LaunchGatherRows(src, static_cast<size_t>(row_bytes), rows, 1, n,
                                                 w.data + offset, lane),
                       "gathering a shard's rows");
      }
    }
    if (!st.ok()) break;
    futures[s] = shards_[s]->ForwardInto(In(w, 0, DType::kFloat32, n, d, device),
                                         In(w, work.c, DType::kInt32, n, k, device),
                                         In(w, work.d, DType::kFloat32, n, k, device),
                                         Out(w, work.b, n, d, device), lane, training);
  }
  std::vector<absl::StatusOr<ForwardOutput>> results;
  absl::Status shards_status = JoinAll(futures, &results);
  for (size_t s = 0; s < n_shards; ++s) call.failed[s] = !results[s].ok();
  if (st.ok()) st = shards_status;
  // out = 0 + partial_0 + partial_1 + ..., shard after shard.
  if (st.ok()) {
    st = CudaError(cudaMemsetAsync(out.data, 0, out.size_bytes, lane), "zeroing out");
  }
  for (size_t s = 0; st.ok() && s < n_shards; ++s) {
    if (counts[s] == 0) continue;
    st = CudaError(shard_rows::ScatterAddRows(
                       reinterpret_cast<const float*>(call.work[s]->data + work.b),
                       index.rows(*call.index, s), counts[s], d, static_cast<float*>(out.data),
                       lane),
                   "summing the shards' outputs");
  }
  const bool keep = st.ok() && training;
  if (absl::Status end = End(call, keep); st.ok()) st = end;
  if (!st.ok()) {
    if (keep) call.state->index.Release(std::move(call.index), nullptr, /*reuse=*/false);
    return st;
  }
  ForwardOutput result;
  if (keep) {
    Context ctx;
    ctx.state = call.state;
    ctx.tokens = tokens;
    ctx.counts = counts;
    for (size_t s = 0; s < n_shards; ++s) ctx.shard_context.push_back(results[s]->context_id);
    ctx.index = std::move(call.index);
    ctx.layout = index;
    std::lock_guard<std::mutex> lock(mu_);
    contexts_[context_id] = std::move(ctx);
    result.context_id = context_id;
  }
  return result;
}

std::future<absl::StatusOr<BackwardOutput>> CudaShardedDevice::Backward(
    uint64_t context_id, const TensorView& dout, const MutableTensorView& dx,
    const MutableTensorView& dweights, void* stream, const BackwardOptions& options) {
  Context ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(context_id);
    if (it == contexts_.end()) {
      return Ready<BackwardOutput>(absl::NotFoundError(
          absl::StrCat("context_id: no pending sharded context ", context_id)));
    }
    const int64_t t = it->second.tokens, d = config_.d_model, k = config_.top_k;
    const MemoryLocation where = MemoryLocation::Cuda(it->second.state->device);
    absl::Status st = CheckTensor(dout, "dout", DType::kFloat32, {t, d});
    if (st.ok()) st = CheckTensor(dx, "dx", DType::kFloat32, {t, d});
    if (st.ok()) st = CheckTensor(dweights, "dweights", DType::kFloat32, {t, k});
    for (auto [loc, p, bytes, field] :
         {std::tuple{dout.location, dout.data, dout.size_bytes, "dout"},
          std::tuple{dx.location, static_cast<const void*>(dx.data), dx.size_bytes, "dx"},
          std::tuple{dweights.location, static_cast<const void*>(dweights.data),
                     dweights.size_bytes, "dweights"}}) {
      if (st.ok() && loc != where) {
        st = absl::InvalidArgumentError(absl::StrCat(
            field, ": on ", loc.DebugString(), ", but the context's Forward ran on ",
            where.DebugString()));
      }
      if (st.ok()) st = CheckDeviceMemory(p, bytes, where.device, field);
    }
    if (!st.ok()) return Ready<BackwardOutput>(st);  // the context stays for a corrected call
    ctx = std::move(it->second);
    contexts_.erase(it);
  }
  absl::StatusOr<Call> call = Begin(ctx.state->device, stream);
  if (!call.ok()) {
    ctx.state->index.Release(std::move(ctx.index), nullptr, /*reuse=*/false);
    return Ready<BackwardOutput>(call.status());
  }
  return std::async(std::launch::async, &CudaShardedDevice::RunBackward, this, *std::move(call),
                    std::move(ctx), dout, dx, dweights, options);
}

absl::StatusOr<BackwardOutput> CudaShardedDevice::RunBackward(Call call, Context ctx,
                                                              TensorView dout,
                                                              MutableTensorView dx,
                                                              MutableTensorView dweights,
                                                              BackwardOptions options) {
  const int device = call.state->device;
  cuda::DeviceScope scope(device);
  const cudaStream_t lane = call.lane->stream;
  const int64_t d = config_.d_model, k = config_.top_k;
  const size_t n_shards = shards_.size();
  // The rows the Forward wrote (on another lane) are read after it: the context's block waits.
  absl::Status st = CudaError(cudaStreamWaitEvent(lane, ctx.index->last_use, 0),
                              "cudaStreamWaitEvent");
  call.index = std::move(ctx.index);
  const WorkLayout work(ctx.tokens, d, k);
  std::vector<std::future<absl::StatusOr<BackwardOutput>>> futures(n_shards);
  for (size_t s = 0; st.ok() && s < n_shards; ++s) {
    const int64_t n = ctx.counts[s];
    if (n == 0) continue;
    st = AcquireWork(call, s, work.bytes);
    if (!st.ok()) break;
    const Block& w = *call.work[s];
    st = CudaError(kernels::LaunchGatherRows(dout.data, static_cast<size_t>(d * 4),
                                             ctx.layout.rows(*call.index, s), 1, n, w.data, lane),
                   "gathering a shard's rows");
    if (!st.ok()) break;
    futures[s] = shards_[s]->BackwardInto(ctx.shard_context[s],
                                          In(w, 0, DType::kFloat32, n, d, device),
                                          Out(w, work.b, n, d, device),
                                          Out(w, work.d, n, k, device), lane, options);
  }
  std::vector<absl::StatusOr<BackwardOutput>> results;
  absl::Status shards_status = JoinAll(futures, &results);
  for (size_t s = 0; s < n_shards; ++s) call.failed[s] = !results[s].ok();
  if (st.ok()) st = shards_status;
  for (const MutableTensorView* v : {&dx, &dweights}) {
    if (st.ok()) st = CudaError(cudaMemsetAsync(v->data, 0, v->size_bytes, lane), "zeroing");
  }
  for (size_t s = 0; st.ok() && s < n_shards; ++s) {
    const int64_t n = ctx.counts[s];
    if (n == 0) continue;
    const char* w = call.work[s]->data;
    const int32_t* rows = ctx.layout.rows(*call.index, s);
    st = CudaError(shard_rows::ScatterAddRows(reinterpret_cast<const float*>(w + work.b), rows,
                                              n, d, static_cast<float*>(dx.data), lane),
                   "summing the shards' dx");
    if (st.ok()) {
      st = CudaError(shard_rows::ScatterAddRows(reinterpret_cast<const float*>(w + work.d), rows,
                                                n, k, static_cast<float*>(dweights.data), lane),
                     "summing the shards' dweights");
    }
  }
  if (absl::Status end = End(call, /*keep_index=*/false); st.ok()) st = end;
  if (!st.ok()) return st;
  return BackwardOutput{};
}

}  // namespace

std::unique_ptr<ShardedDevice> MakeShardedDevice(const LayerConfig& config,
                                                 std::vector<RemoteLayer*> shards,
                                                 std::vector<ExpertRange> ranges) {
  return std::make_unique<CudaShardedDevice>(config, std::move(shards), std::move(ranges));
}

}  // namespace moe::client
