// The CPU engine's layer (engine/cpu_engine.h is its public face): the layer class, its saved
// context and parameters, and the element-wise helpers its files share. Internal to the engine:
// cpu_engine.cc holds the forward and backward math and the engine, cpu_layer_state.cc the
// initialisation, the optimizer step and state export and import.
#ifndef MOE_ENGINE_CPU_LAYER_H_
#define MOE_ENGINE_CPU_LAYER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "engine/layer.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/thread_pool.h"

namespace moe::cpu_engine_internal {

using kernels::ActKind;
using kernels::ThreadPool;

// Same rounding as FloatToBFloat16 (RNE, NaN kept), inline so the element-wise loops vectorise.
inline float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// Calls fn(begin, end) over [0, n) in chunks of `grain`, spread over the pool.
void ParallelChunks(kernels::ThreadPool* pool, int64_t n, int64_t grain,
                    const std::function<void(int64_t, int64_t)>& fn);
// Rounds n fp32 values to bf16 in place.
void RoundBf16InPlace(kernels::ThreadPool* pool, float* p, int64_t n);
// A float tensor (fp32 or bf16) as fp32.
void ToFloatParallel(kernels::ThreadPool* pool, const TensorView& v, float* out);
// n fp32 values -> `dst` as `dtype` (bf16: RNE rounding).
void WriteFromFloat(kernels::ThreadPool* pool, const float* src, DType dtype, int64_t n, void* dst);
// fp32 values -> a tensor of `dtype`.
Tensor FromFloat(kernels::ThreadPool* pool, const float* src, DType dtype,
                 std::vector<int64_t> shape);
// An output: into the caller's destination `dst` when it names one (its shape and dtype already
// checked), else into a new tensor `*out`.
void EmitOutput(kernels::ThreadPool* pool, const float* src, DType dtype,
                std::vector<int64_t> shape, const MutableTensorView& dst, Tensor* out);

// One trainable tensor: the values the GEMMs use, the fp32 master (bf16 storage only), the
// accumulated gradient and the optimizer state (AdamW: m = exp_avg, v = exp_avg_sq; SGD: m =
// momentum buffer).
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> w;
  std::vector<float> master;
  std::vector<float> grad;
  std::vector<float> m;
  std::vector<float> v;

  int64_t size() const { return static_cast<int64_t>(w.size()); }
  int64_t bytes() const {
    return static_cast<int64_t>(w.size() + master.size() + grad.size() + m.size() + v.size()) * 4;
  }
};

class CpuContext : public SavedContext {
 public:
  int64_t num_tokens() const override { return t; }
  int64_t bytes() const override {
    return static_cast<int64_t>(x.size() +
                                4 * (idx.size() + p.size() + counts.size() + offsets.size() +
                                     entries.size() + slot_of.size() + h32.size()) +
                                2 * h16.size());
  }

  const void* owner = nullptr;
  int64_t t = 0;
  DType x_dtype = DType::kFloat32;
  std::vector<std::byte> x;                                // [T, d], layer dtype, as received
  std::vector<int32_t> idx;                                // [T, K] routing used
  std::vector<float> p;                                    // [T, K]
  std::vector<int32_t> counts, offsets, entries, slot_of;  // dispatch
  std::vector<float> h32;                                  // [N, hw] with fp32 storage
  std::vector<uint16_t> h16;                               // [N, hw] with bf16 storage
  bool recompute_h = false;  // h32 and h16 empty: the backward recomputes H
};

class CpuLayer : public Layer {
 public:
  CpuLayer(const LayerConfig& config, std::shared_ptr<std::atomic<int64_t>> memory,
           std::shared_ptr<ThreadPool> own_pool)
      : cfg_(config),
        memory_(std::move(memory)),
        own_pool_(std::move(own_pool)),
        pool_(own_pool_ ? own_pool_.get() : &ThreadPool::Default()) {}
  ~CpuLayer() override { memory_->fetch_sub(accounted_bytes_); }

  absl::Status Init();

  const LayerConfig& config() const override { return cfg_; }
  absl::StatusOr<ForwardResult> Forward(const ForwardRequest& request) override {
    try {
      return ForwardImpl(request);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("forward: out of host memory");
    }
  }
  using Layer::Backward;
  absl::StatusOr<BackwardResult> Backward(std::unique_ptr<SavedContext> context,
                                          const BackwardRequest& request) override {
    try {
      return BackwardImpl(std::move(context), request);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("backward: out of host memory");
    }
  }
  absl::StatusOr<StepResult> Step() override;
  absl::Status ZeroGrad() override;
  int64_t step() const override { return step_; }
  absl::StatusOr<std::map<std::string, Tensor>> ExportState(bool include_optimizer) const override;
  absl::Status ImportState(const std::map<std::string, Tensor>& state) override;
  int64_t resident_bytes() const override {
    int64_t b = 0;
    for (const Param& p : params_) b += p.bytes();
    return b;
  }

 private:
  absl::StatusOr<ForwardResult> ForwardImpl(const ForwardRequest& request);
  absl::StatusOr<BackwardResult> BackwardImpl(std::unique_ptr<SavedContext> context,
                                              const BackwardRequest& request);
  void RouteServer(const float* xf, int64_t t, int32_t* idx, float* p, double* aux, double* z);
  void RouterBackward(const CpuContext& ctx, const float* xf, const float* dp, double aux_scale,
                      float* dxf);
  // H [n, hw] = [X W1_l^T | X W3_l^T] for local expert l on the gathered rows xl [n, d],
  // rounded to bf16 with bf16 storage. Forward and recompute-mode Backward both call this, which
  // is what makes the two modes bitwise equal.
  void UpProject(int64_t l, const float* xl, int64_t n, float* hb);
  // A = act(H1) (* H3), rounded to bf16 with bf16 storage.
  void Activate(const float* h, int64_t n, float* a);
  Param* Find(const std::string& name);

  int64_t hw() const { return cfg_.gated() ? 2 * cfg_.d_hidden : cfg_.d_hidden; }
  bool bf16() const { return cfg_.dtype == DType::kBFloat16; }
  ActKind act() const { return static_cast<ActKind>(static_cast<int>(cfg_.activation)); }

  LayerConfig cfg_;
  std::shared_ptr<std::atomic<int64_t>> memory_;
  std::shared_ptr<ThreadPool> own_pool_;  // null: the process-wide pool
  ThreadPool* pool_;
  std::vector<Param> params_;  // w1, [w3], w2, [router]
  Param* w1_ = nullptr;
  Param* w3_ = nullptr;
  Param* w2_ = nullptr;
  Param* router_ = nullptr;
  int64_t step_ = 0;
  std::vector<int64_t> tokens_seen_;
  int64_t accounted_bytes_ = 0;  // what Init added to the engine's memory counter
};

}  // namespace moe::cpu_engine_internal

#endif  // MOE_ENGINE_CPU_LAYER_H_
