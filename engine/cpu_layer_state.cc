// The CPU layer's state (engine/cpu_layer.h): parameter initialisation, the optimizer step
// (AdamW or SGD with momentum, global-norm clipping, fp32 masters for bf16 storage), export and
// import of the full state, and the element-wise helpers the forward and backward share.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/cpu_layer.h"
#include "engine/init.h"
#include "engine/routing.h"
#include "engine/state.h"

namespace moe::cpu_engine_internal {

// Calls fn(begin, end) over [0, n) in chunks of `grain`, spread over the pool.
void ParallelChunks(ThreadPool* pool, int64_t n, int64_t grain,
                    const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  pool->ParallelFor(chunks, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

void RoundBf16InPlace(ThreadPool* pool, float* p, int64_t n) {
  ParallelChunks(pool, n, 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = RoundBf16(p[i]);
  });
}

void ToFloatParallel(ThreadPool* pool, const TensorView& v, float* out) {
  const int64_t n = v.num_elements();
  ParallelChunks(pool, n, 1 << 16, [&](int64_t b, int64_t e) {
    if (v.dtype == DType::kBFloat16) {
      const uint16_t* src = v.as<uint16_t>();
      for (int64_t i = b; i < e; ++i) out[i] = BFloat16ToFloat(src[i]);
    } else {
      std::memcpy(out + b, v.as<float>() + b, (e - b) * sizeof(float));
    }
  });
}

// n fp32 values -> `dst` as `dtype` (bf16: RNE rounding).
void WriteFromFloat(ThreadPool* pool, const float* src, DType dtype, int64_t n, void* dst) {
  if (dtype == DType::kBFloat16) {
    uint16_t* d16 = static_cast<uint16_t*>(dst);
    ParallelChunks(pool, n, 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) d16[i] = FloatToBFloat16(src[i]);
    });
  } else if (n > 0) {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

// fp32 values -> a tensor of `dtype`.
Tensor FromFloat(ThreadPool* pool, const float* src, DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  WriteFromFloat(pool, src, dtype, t.num_elements(), t.bytes.data());
  return t;
}

// An output: into the caller's destination `dst` when it names one (its shape and dtype already
// checked), else into a new tensor `*out`.
void EmitOutput(ThreadPool* pool, const float* src, DType dtype, std::vector<int64_t> shape,
                const MutableTensorView& dst, Tensor* out) {
  if (dst.empty()) {
    *out = FromFloat(pool, src, dtype, std::move(shape));
  } else {
    WriteFromFloat(pool, src, dtype, NumElements(shape), dst.data);
  }
}

absl::Status CpuLayer::Init() {
  const int64_t d = cfg_.d_model, h = cfg_.d_hidden, count = cfg_.local_experts();
  params_.reserve(4);
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    Param p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    params_.push_back(std::move(p));
  };
  add("w1", {count, h, d});
  if (cfg_.gated()) add("w3", {count, h, d});
  add("w2", {count, d, h});
  if (cfg_.routing == RoutingMode::kServer) add("router", {d, cfg_.num_experts});
  const bool adamw = cfg_.optimizer.kind == OptimizerKind::kAdamW;
  for (Param& p : params_) {
    const size_t n = static_cast<size_t>(NumElements(p.shape));
    p.w.resize(n);
    MOE_RETURN_IF_ERROR(InitLayerWeight(cfg_, p.name, p.w.data()));
    if (bf16()) {
      p.master = p.w;
      for (float& v : p.w) v = RoundBf16(v);
    }
    p.grad.assign(n, 0.0f);
    p.m.assign(n, 0.0f);
    if (adamw) p.v.assign(n, 0.0f);
  }
  w1_ = Find("w1");
  w3_ = Find("w3");
  w2_ = Find("w2");
  router_ = Find("router");
  tokens_seen_.assign(count, 0);
  accounted_bytes_ = resident_bytes();
  memory_->fetch_add(accounted_bytes_);
  return absl::OkStatus();
}

Param* CpuLayer::Find(const std::string& name) {
  for (Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

absl::StatusOr<StepResult> CpuLayer::Step() {
  const OptimizerConfig& o = cfg_.optimizer;
  // Global L2 norm over every gradient, in double with a fixed chunk order.
  double sq = 0.0;
  for (const Param& p : params_) {
    constexpr int64_t kChunk = 1 << 16;
    const int64_t n = p.size(), chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> part(chunks, 0.0);
    pool_->ParallelFor(chunks, [&](int64_t c) {
      double s = 0.0;
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i)
        s += static_cast<double>(p.grad[i]) * p.grad[i];
      part[c] = s;
    });
    for (double s : part) sq += s;
  }
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) {
    (void)ZeroGrad();
    return absl::FailedPreconditionError(
        absl::StrCat("gradients: global norm is ", norm, "; step skipped and gradients cleared"));
  }
  // torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6) when that is below 1.
  double clip = 1.0;
  if (o.max_grad_norm > 0.0) clip = std::min(1.0, o.max_grad_norm / (norm + 1e-6));
  ++step_;
  const bool adamw = o.kind == OptimizerKind::kAdamW;
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step_));
  const float lr = static_cast<float>(o.learning_rate);
  const float wd = static_cast<float>(o.weight_decay);
  const float b1 = static_cast<float>(o.beta1), b2 = static_cast<float>(o.beta2);
  const float eps = static_cast<float>(o.epsilon), mom = static_cast<float>(o.momentum);
  const float step_size = static_cast<float>(o.learning_rate / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float fclip = static_cast<float>(clip);
  const bool round = bf16();
  for (Param& p : params_) {
    float* mw = round ? p.master.data() : p.w.data();
    ParallelChunks(pool_, p.size(), 1 << 15, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = p.grad[i] * fclip;
        float x = mw[i];
        if (adamw) {
          x -= lr * wd * x;  // decoupled weight decay
          p.m[i] = b1 * p.m[i] + (1.0f - b1) * g;
          p.v[i] = b2 * p.v[i] + (1.0f - b2) * g * g;
          x -= step_size * p.m[i] / (std::sqrt(p.v[i]) * inv_sqrt_bc2 + eps);
        } else {
          const float gd = g + wd * x;  // L2 weight decay, as torch.optim.SGD
          p.m[i] = mom * p.m[i] + gd;
          x -= lr * p.m[i];
        }
        mw[i] = x;
        if (round) p.w[i] = RoundBf16(x);
        p.grad[i] = 0.0f;
      }
    });
  }
  StepResult res;
  res.step = step_;
  res.grad_norm = norm;
  res.tokens_per_expert = tokens_seen_;
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  return res;
}

absl::Status CpuLayer::ZeroGrad() {
  for (Param& p : params_) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, Tensor>> CpuLayer::ExportState(bool include_optimizer) const {
  std::map<std::string, Tensor> out;
  for (const Param& p : params_) {
    out[p.name] = FromFloat(pool_, p.w.data(), cfg_.dtype, p.shape);
    if (!include_optimizer) continue;
    if (cfg_.optimizer.kind == OptimizerKind::kAdamW) {
      out[p.name + ".exp_avg"] = FromFloat(pool_, p.m.data(), DType::kFloat32, p.shape);
      out[p.name + ".exp_avg_sq"] = FromFloat(pool_, p.v.data(), DType::kFloat32, p.shape);
    } else {
      out[p.name + ".momentum"] = FromFloat(pool_, p.m.data(), DType::kFloat32, p.shape);
    }
    if (bf16())
      out[p.name + ".master"] = FromFloat(pool_, p.master.data(), DType::kFloat32, p.shape);
  }
  if (include_optimizer) {
    Tensor s = Tensor::Zeros(DType::kInt64, {1});
    s.as<int64_t>()[0] = step_;
    out["step"] = std::move(s);
  }
  return out;
}

absl::Status CpuLayer::ImportState(const std::map<std::string, Tensor>& state) {
  // Pass 1: validate everything; pass 2: apply. A rejected import changes nothing.
  const auto shape_of = [this](const std::string& param) -> const std::vector<int64_t>* {
    const Param* p = Find(param);
    return p == nullptr ? nullptr : &p->shape;
  };
  for (const auto& [name, tensor] : state) {
    MOE_RETURN_IF_ERROR(ValidateStateTensor(cfg_, name, tensor, shape_of));
  }
  // Weights first, then masters: a bf16 weight import resets its master to the imported value
  // unless the master is imported too.
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [name, tensor] : state) {
      const StateName parsed = ParseStateName(name);
      if (parsed.kind == StateKind::kStep) {
        if (pass == 0) step_ = tensor.as<int64_t>()[0];
        continue;
      }
      Param* p = Find(parsed.param);
      const TensorView v = tensor.view();
      if (pass == 0 && parsed.kind == StateKind::kWeight) {
        ToFloat(v, p->w.data());
        if (bf16()) p->master = p->w;
      } else if (pass == 1 && parsed.kind == StateKind::kMaster) {
        ToFloat(v, p->master.data());
        for (int64_t i = 0; i < p->size(); ++i) p->w[i] = RoundBf16(p->master[i]);
      } else if (pass == 0 &&
                 (parsed.kind == StateKind::kExpAvg || parsed.kind == StateKind::kMomentum)) {
        ToFloat(v, p->m.data());
      } else if (pass == 0 && parsed.kind == StateKind::kExpAvgSq) {
        ToFloat(v, p->v.data());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe::cpu_engine_internal
