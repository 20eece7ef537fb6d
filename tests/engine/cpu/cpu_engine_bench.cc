// Throughput of the CPU engine: forward (training), backward and optimizer step of one layer,
// with random routing, reporting wall time and expert-GEMM GFLOP/s, plus peak resident memory.
//
// FLOPs counted are the expert GEMMs only (router and element-wise work excluded), per routed
// (t, k) entry: forward 2dh per weight matrix (3 gated, 2 plain), backward twice that
// (data and weight gradients) plus 2dh for dp's dO W2. Usage:
//   moe_cpu_engine_bench [T=4096] [d=1024] [h=2048] [E=8] [K=2] [dtype=fp32|bf16] [iters=3]
//                        [routing=client|server] [activation=swiglu|silu|gelu|relu]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "engine/cpu_engine.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/thread_pool.h"

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, const char* def) { return std::string(argc > i ? argv[i] : def); };
  const int64_t t = std::atoll(arg(1, "4096").c_str()), d = std::atoll(arg(2, "1024").c_str());
  const int64_t h = std::atoll(arg(3, "2048").c_str()), e = std::atoll(arg(4, "8").c_str());
  const int64_t k = std::atoll(arg(5, "2").c_str());
  const bool bf16 = arg(6, "fp32") == "bf16";
  const int iters = std::atoi(arg(7, "3").c_str());
  const bool server = arg(8, "client") == "server";
  const std::string act = arg(9, "swiglu");

  moe::LayerConfig c;
  c.num_experts = e;
  c.top_k = k;
  c.d_model = d;
  c.d_hidden = h;
  c.dtype = bf16 ? moe::DType::kBFloat16 : moe::DType::kFloat32;
  c.routing = server ? moe::RoutingMode::kServer : moe::RoutingMode::kClient;
  c.activation = act == "silu"   ? moe::Activation::kSiLU
                 : act == "gelu" ? moe::Activation::kGeLUTanh
                 : act == "relu" ? moe::Activation::kReLU
                                 : moe::Activation::kSwiGLU;
  c.aux_loss_coef = server ? 0.01 : 0.0;
  auto engine = moe::CreateCpuEngine();
  auto layer_or = engine->CreateLayer(c);
  if (!layer_or.ok()) {
    std::fprintf(stderr, "%s\n", layer_or.status().ToString().c_str());
    return 1;
  }
  auto& layer = *layer_or;

  // Inputs: x ~ deterministic pseudo-random, routing round-robin-with-stride (K distinct ids).
  moe::Tensor x = moe::Tensor::Zeros(c.dtype, {t, d}), dout = moe::Tensor::Zeros(c.dtype, {t, d});
  for (int64_t i = 0; i < t * d; ++i) {
    const float v = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    if (bf16) {
      x.as<uint16_t>()[i] = moe::FloatToBFloat16(v);
      dout.as<uint16_t>()[i] = moe::FloatToBFloat16(0.5f * v);
    } else {
      x.as<float>()[i] = v;
      dout.as<float>()[i] = 0.5f * v;
    }
  }
  moe::Tensor ids = moe::Tensor::Zeros(moe::DType::kInt32, {t, k});
  moe::Tensor w = moe::Tensor::Zeros(moe::DType::kFloat32, {t, k});
  for (int64_t i = 0; i < t; ++i) {
    const int64_t base = (i * 7919) % e;
    for (int64_t j = 0; j < k; ++j) {
      ids.as<int32_t>()[i * k + j] = static_cast<int32_t>((base + j) % e);
      w.as<float>()[i * k + j] = 1.0f / k;
    }
  }
  moe::ForwardRequest req;
  req.x = x.view();
  if (!server) {
    req.expert_ids = ids.view();
    req.weights = w.view();
  }
  const double mats = c.gated() ? 3.0 : 2.0;
  const double fwd_flops = 2.0 * d * h * mats * t * k;
  const double bwd_flops = 2.0 * fwd_flops + 2.0 * d * h * t * k;
  std::printf("T=%ld d=%ld h=%ld E=%ld K=%ld %s %s %s threads=%d sgemm=%s\n", (long)t, (long)d,
              (long)h, (long)e, (long)k, bf16 ? "bf16" : "fp32", server ? "server" : "client",
              act.c_str(), moe::kernels::ThreadPool::Default().num_threads(),
              moe::kernels::SgemmKernelName());
  for (int it = 0; it < iters; ++it) {
    const double t0 = Now();
    auto fwd = layer->Forward(req);
    const double t1 = Now();
    if (!fwd.ok()) {
      std::fprintf(stderr, "forward: %s\n", fwd.status().ToString().c_str());
      return 1;
    }
    const int64_t ctx_bytes = fwd->context->bytes();
    auto bwd = layer->Backward(std::move(fwd->context), dout.view());
    const double t2 = Now();
    if (!bwd.ok()) {
      std::fprintf(stderr, "backward: %s\n", bwd.status().ToString().c_str());
      return 1;
    }
    auto st = layer->Step();
    const double t3 = Now();
    std::printf(
        "iter %d: forward %.3f s (%.1f GFLOP/s)  backward %.3f s (%.1f GFLOP/s)  step %.3f s  "
        "context %.1f MiB\n",
        it, t1 - t0, fwd_flops / (t1 - t0) * 1e-9, t2 - t1, bwd_flops / (t2 - t1) * 1e-9, t3 - t2,
        ctx_bytes / 1048576.0);
  }
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  std::printf("peak RSS %.2f GiB, layer resident %.2f GiB\n", ru.ru_maxrss / 1048576.0,
              layer->resident_bytes() / 1073741824.0);
  return 0;
}
