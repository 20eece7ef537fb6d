// Fused Hopper (sm_90a) expert kernels: the problem, the tile config, the check, and the forward's
// launchers. Plain C++ (no device syntax), so the engine's .cc files include it.
//
// The forward of a SwiGLU expert layer from the dispatch structures of kernels/cpu/dispatch.h
// (offsets/entries/slot_of, built on the device by the engine), in three launches:
//   1. LaunchSm90ExpertUp:   H = [x W1_e^T | x W3_e^T] and A = silu(H1) * H3 for every routed
//      (token, k) in ONE persistent launch over all experts; rows of x are gathered through
//      `entries` while loading, weights arrive by TMA, SwiGLU runs on the accumulators.
//   2. LaunchSm90ExpertDown: Y[t*K+k] = A[slot] W2_e^T, each (token, k) row written contiguously.
//   3. LaunchSm90Combine:    out[t] = sum_k p[t,k] Y[t*K+k] over the k routed to this shard.
// Layouts (row-major, bf16 given as its 16 raw bits; N = offsets[num_experts] routed entries):
//   x [T, d]   w1, w3 [experts, h, d] (or stacked, see w13_expert_stride)   w2 [experts, d, h]
//   H [N, 2h]   A [N, h]   Y [T*K, d] (rows outside the shard unwritten)   p [T*K] fp32
//   out [T, d]
// Every launcher takes raw device pointers and sizes, the stream last, returns cudaError_t and
// never synchronises; it refuses (cudaErrorInvalidValue) a problem Sm90CanImplement refuses, a
// pointer not 16-byte aligned, or a config it has no kernel for. Which config to pass is the
// caller's choice (the engine's: engine/cuda/kernel_selection.h).
#ifndef MOE_KERNELS_CUDA_SM90_EXPERT_FORWARD_H_
#define MOE_KERNELS_CUDA_SM90_EXPERT_FORWARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe::kernels {

// The sizes of one fused call. `num_routed` is only a hint for tile choice (the exact count
// lives on the device in offsets); negative means num_tokens * top_k.
struct Sm90ExpertProblem {
  int64_t num_tokens = 0;   // T
  int32_t top_k = 0;        // K
  int32_t num_experts = 0;  // local experts in this shard
  int32_t d_model = 0;      // d
  int32_t d_hidden = 0;     // h
  int64_t num_routed = -1;  // N hint
  // Elements from expert e's W1 (and W3) block to expert e+1's. -1: d_hidden * d_model, i.e.
  // separate [experts, h, d] tensors. For weights stacked per expert as [experts, 2h, d]
  // ([W1_e; W3_e], the CUDA engine's layout) pass w1 = w13, w3 = w13 + h*d and 2*h*d here.
  int64_t w13_expert_stride = -1;
};

// Which kernel runs a GEMM and with which tiles. block_n: the wgmma N, 128 or 256 (for the
// up-projection half of it are W1 rows, half the matching W3 rows); the ring depth follows.
// group_m: row blocks per rasterisation band. tma_weights: weights by TMA, else cp.async.
// warp_specialized: a producer warpgroup loads while two consumers multiply (TMA only).
// ping_pong: the same producer, consumers taking whole tiles in turn (TMA only; wins over
// warp_specialized); 128 x 128 (block_n 128) or 64 x 256 (block_n 256) consumer tiles.
// multicast_b (ping_pong only): 2-CTA clusters share each weight tile by TMA multicast.
// The weight gradients read block_n and tma_weights (there: the operand read in slot order by
// TMA, block_n 256 only).
struct Sm90GemmConfig {
  int block_n = 256;
  bool tma_weights = true;
  int group_m = 16;
  bool warp_specialized = false;
  bool ping_pong = false;
  bool multicast_b = false;
};

// nullptr when the fused kernels take the problem, else a message naming the field that stops
// them (sizes positive, d_model and d_hidden multiples of 8 for 16-byte rows, 1 <= num_experts
// <= 512, T*K within int32, w13_expert_stride -1 or >= h*d and a multiple of 8).
const char* Sm90CanImplement(const Sm90ExpertProblem& problem);

// True when `device` is compute capability 9.0 (the kernels are built for sm_90a only).
bool Sm90DeviceSupported(int device);

// H [N, 2h] and A [N, h] for all local experts. offsets [experts+1], entries [N] on device.
cudaError_t LaunchSm90ExpertUp(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                               const uint16_t* x, const uint16_t* w1, const uint16_t* w3,
                               const int32_t* offsets, const int32_t* entries, uint16_t* h,
                               uint16_t* a, cudaStream_t stream);

// Y[entries[s]] = A[s] W2_e^T for every slot s of expert e. Y is [T*K, d].
cudaError_t LaunchSm90ExpertDown(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* a, const uint16_t* w2, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* y, cudaStream_t stream);

// out[t] = sum_k p[t*K+k] * Y[t*K+k] over k with slot_of[t*K+k] >= 0 (fp32 sums, bf16 out).
cudaError_t LaunchSm90Combine(const Sm90ExpertProblem& problem, const uint16_t* y, const float* p,
                              const int32_t* slot_of, uint16_t* out, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_SM90_EXPERT_FORWARD_H_
