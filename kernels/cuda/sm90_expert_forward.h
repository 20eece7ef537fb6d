// Fused Hopper (sm_90a) expert forward: host entry points, in plain C++ so the engine (.cc,
// compiled by g++) can include this header without seeing any CUDA device syntax.
//
// Three launches make the forward of a SwiGLU expert layer from the dispatch structures of
// kernels/cpu/dispatch.h (counts/offsets/entries/slot_of, built on the device by the engine):
//   1. LaunchSm90ExpertUp:   H = [x W1_e^T | x W3_e^T] and A = silu(H1) * H3 for every routed
//      (token, k) in ONE persistent launch over all experts; rows of x are gathered through
//      `entries` while loading, weights arrive by TMA, SwiGLU runs on the accumulators.
//   2. LaunchSm90ExpertDown: Y[t*K+k] = A[slot] W2_e^T, each (token, k) row written contiguously.
//   3. LaunchSm90Combine:    out[t] = sum_k p[t,k] Y[t*K+k] over the k routed to this shard.
// Layouts (row-major, bf16 given as its 16 raw bits; N = offsets[num_experts] routed entries):
//   x [T, d]   w1, w3 [experts, h, d] (or stacked, see w13_expert_stride)   w2 [experts, d, h]
//   H [N, 2h]   A [N, h]
//   Y [T*K, d] (rows of entries outside the shard are not written)   p [T*K] fp32   out [T, d]
// Every launcher takes raw device pointers and sizes, the stream last, returns cudaError_t, and
// never synchronises. Call Sm90CanImplement first; where it refuses (or the device is not
// sm_90), use the unfused path. All pointers must be 16-byte aligned (cudaErrorInvalidValue
// otherwise).
#ifndef MOE_KERNELS_CUDA_SM90_EXPERT_FORWARD_H_
#define MOE_KERNELS_CUDA_SM90_EXPERT_FORWARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe::kernels {

// The sizes of one fused forward. `num_routed` is only a hint for the tile heuristics (the
// exact count lives on the device in offsets); negative means num_tokens * top_k.
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

// The GEMMs whose tiles Sm90ChooseConfig picks: the forward's two projections, the backward's
// data gradients (sm90_expert_backward.h: dA_u = dout W2_e, dXg = dH W13_e) and its weight
// gradients (dW2 [d, h] and dW13 [2h, d]; for these only block_n, 256 when the gradient has
// more than 128 columns, else 128, and tma_weights are chosen). kBackwardDH is the dA GEMM with the
// SwiGLU backward as its epilogue (LaunchSm90BackwardDH), whose heavier epilogue favours other
// tiles.
enum class Sm90Projection {
  kUpSwiGLU = 0,
  kDown = 1,
  kBackwardDA = 2,
  kBackwardDX = 3,
  kWeightGradW2 = 4,
  kWeightGradW13 = 5,
  kBackwardDH = 6,
};

// Tile choice. Tiles are 128 rows (two consumer warpgroups of 64); block_n is the wgmma N
// (128 or 256): for the up-projection half of it are W1 rows and half the matching W3 rows.
// The ring depth follows (4 stages for 128x256, 6 for 128x128, ~192 KB either way). group_m
// row blocks form one rasterisation band (weights stream from memory once per band).
// tma_weights = false loads weights by cp.async instead of TMA. warp_specialized = true (TMA
// only) runs a producer warpgroup that loads while two consumer warpgroups multiply, with no
// CTA-wide barrier per k-step. ping_pong = true (TMA only; takes precedence over
// warp_specialized) runs the same producer, but each consumer warpgroup takes whole tiles in
// turn, so that one's epilogue overlaps the other's MMAs; its tiles per consumer are 128 x 128
// (block_n 128) or 64 x 256 (block_n 256), and group_m still counts 128 rows. multicast_b
// (with ping_pong) runs CTAs in clusters of 2 on row-adjacent tiles that split each weight tile's
// load and multicast it to both, halving the weight traffic per tile; the launchers refuse it
// without ping_pong (cudaErrorInvalidValue).
// The weight gradients read only block_n and tma_weights, which there means that the operand
// read in slot order (pA for dW2, dH for dW13) comes by TMA (block_n 256 only; like the other
// fields' defaults, tma_weights = true is what a default-constructed config asks for).
struct Sm90GemmConfig {
  int block_n = 256;
  bool tma_weights = true;
  int group_m = 16;
  bool warp_specialized = false;
  bool ping_pong = false;
  bool multicast_b = false;
};

// nullptr when the fused kernels take the problem, else a message naming the field that
// stops them (sizes must be positive, d_model and d_hidden multiples of 8 for 16-byte rows,
// 1 <= num_experts <= 512, T*K within int32, w13_expert_stride -1 or >= h*d and a multiple
// of 8).
const char* Sm90CanImplement(const Sm90ExpertProblem& problem);

// True when `device` is compute capability 9.0 (the kernels are built for sm_90a only).
bool Sm90DeviceSupported(int device);

// The one heuristics function: tile width for a projection, given the SM count.
Sm90GemmConfig Sm90ChooseConfig(const Sm90ExpertProblem& problem, Sm90Projection projection,
                                int num_sms);

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
