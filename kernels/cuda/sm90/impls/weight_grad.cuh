// sm90_weight_grad_kernel: the weight-gradient grouped GEMM of the fused expert backward. For
// every local expert e, C_e[M, N] (+)= sum over its routed rows s of A[row_a(s)]^T (outer)
// B[row_b(s)], with fp32 C stored row-major, experts contiguous.
//
// Unlike the forward's grouped GEMM, the REDUCTION runs over the expert's routed rows (a
// per-expert length known only on the device), while M and N are the fixed weight sizes. So
// the tile grid is (experts with rows) x M/128 x N/kN and each tile walks its expert's rows a
// slab (64 rows in the launchers) at a time. Both operands arrive row by row with the output's
// dimension contiguous in memory, i.e. MN-major for wgmma: each slab is stored as blocks of
// slab-rows x 64 elements (one 128-byte line per row, 16-byte chunk c of row r at chunk
// c ^ (r % 8): the 128-byte swizzle) and read with wgmma's transpose flags (descriptor: next
// 8-row group 1024 bytes on, next 64-element block one block on; the test fails with the two
// offsets swapped or with the swizzle left out). One operand's rows are GATHERED through the
// dispatch index (token = entries[s] / top_k) while loading, the other is read in slot order;
// rows past the expert's count are zero-filled by cp.async, so ragged counts need no masking
// in the math. The kernel is bound by the instructions that address and issue those copies as
// much as by the tensor cores, hence the multiply-shift division and the per-warp fetch of the
// gathered index below (together 1.2-1.7x faster on the presets). The load ring, the
// kStages-2 look-ahead across tile boundaries and the 256 threads that both load and multiply
// follow the grouped GEMM's plain kernel (grouped_gemm.cuh), whose PTX wrappers and wgmma
// shapes this reuses. Each output element belongs to exactly one tile and is summed in a fixed
// order, so results are deterministic without atomics; the epilogue stores (or adds) fp32 pairs
// straight from the accumulator fragments, where each quad of lanes covers one full 32-byte
// sector.
// The epilogue runs with the tensor cores idle in a CTA. Two CTAs an SM with 128 x 128 tiles
// (kCtasPerSm = 2: registers capped at 128, half the ring each) overlap it with the other CTA's
// main loop, but gain little over 128 x 256 tiles where they gain at all, and a
// warp-specialised ping-pong measured slower: the main loop (operand copies and wgmma) is what
// bounds the kernel. Reading the slot-order operand by TMA (kTmaSlots) helps more
// (docs/decisions/0001-sm90-kernel-choice.md). No Abseil, gRPC or protobuf here.
#ifndef MOE_KERNELS_CUDA_SM90_IMPLS_WEIGHT_GRAD_CUH_
#define MOE_KERNELS_CUDA_SM90_IMPLS_WEIGHT_GRAD_CUH_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sm90/launch.cuh"
#include "kernels/cuda/sm90/mma.cuh"
#include "kernels/cuda/sm90/params.cuh"
#include "kernels/cuda/sm90/ptx.cuh"

namespace moe::kernels::sm90 {

// Division by the run-time top_k in a few instructions (entries[s] / top_k runs for every
// gathered row of every step, and a full integer division would cost more than the copy):
// q = (umulhi(n, magic) + n) >> shift, exact for every n < 2^31 (Granlund and Montgomery's
// round-up method; the sum cannot overflow because umulhi(n, magic) <= n).
struct FastDivisor {
  uint32_t magic;
  uint32_t shift;
};
inline FastDivisor MakeFastDivisor(uint32_t d) {
  uint32_t shift = 0;
  while ((uint64_t{1} << shift) < d) ++shift;
  const uint64_t magic = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
  return FastDivisor{static_cast<uint32_t>(magic), shift};
}
__device__ __forceinline__ int FastDivide(int n, FastDivisor div) {
  const uint32_t u = static_cast<uint32_t>(n);
  return static_cast<int>((__umulhi(u, div.magic) + u) >> div.shift);
}

// Everything the kernel reads (by value, __grid_constant__).
struct WeightGradParams {
  // kTmaSlots only: a 2-D map over the operand read in slot order ([slot_rows, cols] bf16,
  // boxes of 64 columns x kSlabRows rows, 128-byte swizzle), encoded by the launch function.
  CUtensorMap slot_map;
  int32_t slot_rows;       // rows of that operand (>= offsets[experts]), for the map
  const __nv_bfloat16* a;  // [rows, m_dim]: columns become C's rows
  const __nv_bfloat16* b;  // [rows, n_dim]: columns become C's columns
  const int32_t* offsets;  // [experts + 1]
  const int32_t* entries;  // [N]: t * top_k + k
  float* c;                // [experts, m_dim, n_dim] fp32
  int32_t num_experts;
  int32_t m_dim;
  int32_t n_dim;
  FastDivisor top_k;
  int32_t accumulate;  // 0: C = sum, 1: C += sum
};

// The parameters of one launch (a, b: the operands' raw bf16 bits; slot_rows: rows of the
// operand read in slot order, the TMA map's extent). The launchers and the test's direct
// launches of other instantiations fill it the same way.
inline WeightGradParams MakeWeightGradParams(const uint16_t* a, const uint16_t* b,
                                             const int32_t* offsets, const int32_t* entries,
                                             float* c, int32_t experts, int32_t m_dim,
                                             int32_t n_dim, int32_t top_k, int32_t slot_rows,
                                             bool accumulate) {
  WeightGradParams params = {};
  params.a = reinterpret_cast<const __nv_bfloat16*>(a);
  params.b = reinterpret_cast<const __nv_bfloat16*>(b);
  params.offsets = offsets;
  params.entries = entries;
  params.c = c;
  params.num_experts = experts;
  params.m_dim = m_dim;
  params.n_dim = n_dim;
  params.top_k = MakeFastDivisor(static_cast<uint32_t>(top_k));
  params.slot_rows = slot_rows;
  params.accumulate = accumulate ? 1 : 0;
  return params;
}

constexpr int kWgradThreads = 256;  // two consumer warpgroups, 64 C rows each
constexpr int kWgradBlockM = 128;
constexpr int kWgradRingBytes = 192 * 1024;  // shared memory given to the load ring
// With two CTAs per SM each gets half (2 x (96 KB ring + 5 KB) fits the SM's 228 KB).
template <int kCtasPerSm>
__host__ __device__ constexpr int WgradRingBytes() {
  return kCtasPerSm == 1 ? kWgradRingBytes : 96 * 1024;
}

// wgmma descriptor offsets for a slab of kSlabRows reduction rows stored as blocks of
// kSlabRows x 64 columns: the next 8-row group of the reduction is 1024 bytes on (stride
// byte offset), the next 64-column block one block on (leading byte offset). A k16 step moves
// 16 rows = 2048 bytes down every block; descriptors count 16-byte units.
template <int kSlabRows>
struct MnMajorSlab {
  static constexpr int kBlockBytes = kSlabRows * 128;
  static constexpr uint32_t kLbo = kBlockBytes;
  static constexpr uint32_t kSbo = 1024;
  static constexpr uint64_t kK16DescStep = (16 * 128) >> 4;
};

template <int kN>
struct WgmmaMnMajor;
template <>
struct WgmmaMnMajor<128> {
  __device__ __forceinline__ static void Run(float (&d)[64], uint64_t a, uint64_t b) {
    WgmmaM64N128K16<1, 1>(d, a, b, 1);
  }
};
template <>
struct WgmmaMnMajor<256> {
  __device__ __forceinline__ static void Run(float (&d)[128], uint64_t a, uint64_t b) {
    WgmmaM64N256K16<1, 1>(d, a, b, 1);
  }
};

// How the 256 threads share one kSlabRows x kCols slab: each thread copies one 16-byte chunk
// of kRows rows, kRowStep rows apart (so all of a thread's rows have the same r % 8).
template <int kCols, int kSlabRows>
struct SlabShape {
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kRowStep = kWgradThreads / kChunksPerRow;
  static constexpr int kRows = kSlabRows / kRowStep;
  static_assert(kWgradThreads % kChunksPerRow == 0 && kSlabRows % kRowStep == 0 && kRows >= 1,
                "slab split");
  __device__ __forceinline__ static int Row(int tid, int j) {
    return tid / kChunksPerRow + j * kRowStep;
  }
};

// Copies this thread's share of one slab into the swizzled MN-major layout at `dst`: row j
// from row_ptr[j] (already offset to this thread's column). Rows at or past `rows_valid`, and
// every row when !col_ok, are zero-filled without reading.
template <int kCols, int kSlabRows>
__device__ __forceinline__ void LoadSlab(
    uint32_t dst, const __nv_bfloat16* const (&row_ptr)[SlabShape<kCols, kSlabRows>::kRows],
    bool col_ok, int rows_valid, const __nv_bfloat16* any_valid, int tid) {
  using S = SlabShape<kCols, kSlabRows>;
  const int q = tid % S::kChunksPerRow;  // chunk within the slab's row
  const uint32_t block = dst + (q >> 3) * MnMajorSlab<kSlabRows>::kBlockBytes;
#pragma unroll
  for (int j = 0; j < S::kRows; ++j) {
    const int r = S::Row(tid, j);
    const bool ok = col_ok && r < rows_valid;
    CpAsync16(block + r * 128 + (((q & 7) ^ (r & 7)) << 4), ok ? row_ptr[j] : any_valid, ok);
  }
}

// One output tile: its expert, that expert's first slot and row count, the tile's first C row
// and column, and the number of reduction steps.
struct WgradTile {
  int expert;
  int slot0;
  int count;
  int m0;
  int n0;
  int num_k;
};

// Tiles are numbered expert-major over the experts that have rows (`active`), then column
// block, then row block, so the CTAs running at one time share a few experts' operand rows in
// L2.
template <int kN, int kSlabRows>
__device__ __forceinline__ WgradTile DecodeWgradTile(int tile, int m_tiles, int n_tiles,
                                                     const int* active, const int* offs) {
  const int per_expert = m_tiles * n_tiles;
  const int j = tile / per_expert;
  const int rem = tile - j * per_expert;
  const int nt = rem / m_tiles;
  WgradTile ti;
  ti.expert = active[j];
  ti.slot0 = offs[ti.expert];
  ti.count = offs[ti.expert + 1] - ti.slot0;
  ti.m0 = (rem - nt * m_tiles) * kWgradBlockM;
  ti.n0 = nt * kN;
  ti.num_k = (ti.count + kSlabRows - 1) / kSlabRows;
  return ti;
}

template <int kN, int kSlabRows>
__host__ __device__ constexpr int WgradStageBytes() {
  return (kWgradBlockM + kN) * kSlabRows * 2;
}
// Ring depth: as many stages as fit kWgradRingBytes, at most 10 (cp.async.wait_group's count,
// stages - 3, stays small).
template <int kN, int kSlabRows, int kCtasPerSm = 1>
__host__ __device__ constexpr int WgradStages() {
  return WgradRingBytes<kCtasPerSm>() / WgradStageBytes<kN, kSlabRows>() < 10
             ? WgradRingBytes<kCtasPerSm>() / WgradStageBytes<kN, kSlabRows>()
             : 10;
}
template <int kN, int kSlabRows, int kCtasPerSm = 1>
__host__ __device__ constexpr int WgradSmemBytes() {
  return WgradStages<kN, kSlabRows, kCtasPerSm>() * WgradStageBytes<kN, kSlabRows>() +
         1024 /* alignment */ + (2 * kMaxExperts + 2) * 4 /* offsets, active list, its length */ +
         WgradStages<kN, kSlabRows, kCtasPerSm>() * 8 /* kTmaSlots: a TMA mbarrier a stage */;
}

// Epilogue: each thread owns, per 8-column block i, the pair of columns 2*(lane%4) of rows
// lane/4 and lane/4 + 8 of its warp's 16 (the wgmma fragment), stored as float2. With
// accumulate, all old values are read first so the loads overlap.
template <int kN>
__device__ __forceinline__ void StoreWgradTile(const WeightGradParams& p, const WgradTile& ti,
                                               float (&acc)[kN / 2], int tid) {
  const int lane = tid & 31;
  const int row0 = ti.m0 + (tid >> 7) * 64 + ((tid & 127) >> 5) * 16 + (lane >> 2);
  const int col0 = ti.n0 + 2 * (lane & 3);
  float* c = p.c + static_cast<int64_t>(ti.expert) * p.m_dim * p.n_dim;
  if (p.accumulate) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + 8 * hr;
#pragma unroll
      for (int i = 0; i < kN / 8; ++i) {
        const int col = col0 + 8 * i;
        if (row < p.m_dim && col < p.n_dim) {
          const float2 old =
              *reinterpret_cast<const float2*>(c + static_cast<int64_t>(row) * p.n_dim + col);
          acc[4 * i + 2 * hr] += old.x;
          acc[4 * i + 2 * hr + 1] += old.y;
        }
      }
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + 8 * hr;
    if (row >= p.m_dim) continue;
    float* crow = c + static_cast<int64_t>(row) * p.n_dim;
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      const int col = col0 + 8 * i;
      if (col < p.n_dim) {
        *reinterpret_cast<float2*>(crow + col) =
            make_float2(acc[4 * i + 2 * hr], acc[4 * i + 2 * hr + 1]);
      }
    }
  }
}

// With accumulate, the epilogue reads the tile's old values; kAhead steps before it (when the
// load cursor issues the tile's last slab), each thread asks L2 for its share of the lines
// (2 threads a row, kN/2 columns each), so those reads find L2 instead of stalling the SM on
// device memory between two tiles (accumulating launches 1.1-1.3x faster on the presets).
template <int kN>
__device__ __forceinline__ void PrefetchWgradTile(const WeightGradParams& p, const WgradTile& ti,
                                                  int tid) {
  const int row = ti.m0 + (tid >> 1);
  if (row >= p.m_dim) return;
  const float* line = p.c + static_cast<int64_t>(ti.expert) * p.m_dim * p.n_dim +
                      static_cast<int64_t>(row) * p.n_dim;
#pragma unroll
  for (int i = 0; i < kN / 2 / 32; ++i) {  // 32 floats = one 128-byte line
    const int col = ti.n0 + (tid & 1) * (kN / 2) + 32 * i;
    if (col < p.n_dim) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line + col));
  }
}

// kN: wgmma N (C columns per tile, 128 or 256). kSlabRows: reduction rows per ring stage
// (a multiple of 16); the ring depth follows (WgradStages). kGatherA: A's rows are gathered
// through entries (dW2: dout) and B's are in slot order, or the other way round (dW13: B = x).
// kDrain: each step waits for ALL its wgmmas before the next barrier, so a stage is free one
// step after its use and loads run stages-1 steps ahead (more bytes in flight, at the cost of
// an empty tensor pipe at every barrier); otherwise the previous step's wgmmas may still run,
// and loads run stages-2 ahead. kCtasPerSm: 2 runs two CTAs on each SM (registers capped at
// 128 a thread, half the ring each), so one CTA's epilogue overlaps the other's main loop.
// kTmaSlots: the operand read in slot order comes by TMA (p.slot_map, thread 0, completing a
// per-stage mbarrier) for every FULL slab; a tile's last, partial slab still comes by cp.async
// with its rows past the expert's count zero-filled (thread 0 then arrives with no bytes), so
// no row of a neighbouring expert ever enters the ring: its NaN or Inf could not leak in.
template <int kN, int kSlabRows, bool kGatherA, bool kDrain = false, int kCtasPerSm = 1,
          bool kTmaSlots = false>
__global__ void __launch_bounds__(kWgradThreads, kCtasPerSm)
    sm90_weight_grad_kernel(const __grid_constant__ WeightGradParams p) {
  using ShapeA = SlabShape<kWgradBlockM, kSlabRows>;
  using ShapeB = SlabShape<kN, kSlabRows>;
  using ShapeG = SlabShape<kGatherA ? kWgradBlockM : kN, kSlabRows>;  // the gathered operand
  using Slab = MnMajorSlab<kSlabRows>;
  constexpr int kStages = WgradStages<kN, kSlabRows, kCtasPerSm>();
  constexpr int kTileABytes = kWgradBlockM * kSlabRows * 2;
  constexpr int kStageBytes = WgradStageBytes<kN, kSlabRows>();
  constexpr int kAhead = kDrain ? kStages - 1 : kStages - 2;
  constexpr int kAcc = kN / 2;
  static_assert(kSlabRows % 16 == 0, "a ring stage holds whole k16 steps");
  static_assert(kAhead >= 1, "need at least 3 stages");
  static_assert(Slab::kBlockBytes % 1024 == 0, "swizzled blocks must stay 1024-byte aligned");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  int* offs = reinterpret_cast<int*>(smem_raw + (base - raw_addr) + kStages * kStageBytes);
  int* active = offs + (kMaxExperts + 1);
  int* num_active = active + kMaxExperts;
  uint64_t* tma_bar = reinterpret_cast<uint64_t*>(num_active + 1);  // kTmaSlots: one a stage

  const int tid = threadIdx.x;
  const int num_experts = p.num_experts;

  // ---- Phase 0: offsets cached in shared memory; warp 0 lists the experts with rows, in
  // order (experts with none get no tile, so their C blocks are never touched).
  if (kTmaSlots && tid == 32) {
    for (int s = 0; s < kStages; ++s) MbarInit(SmemAddr(&tma_bar[s]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int e = tid; e <= num_experts; e += kWgradThreads) offs[e] = p.offsets[e];
  __syncthreads();
  if (tid < 32) {
    int n = 0;
    for (int e0 = 0; e0 < num_experts; e0 += 32) {
      const int e = e0 + tid;
      const bool has_rows = e < num_experts && offs[e + 1] > offs[e];
      const uint32_t mask = __ballot_sync(0xffffffffu, has_rows);
      if (has_rows) active[n + __popc(mask & ((1u << tid) - 1u))] = e;
      n += __popc(mask);
    }
    if (tid == 0) *num_active = n;
  }
  __syncthreads();

  const int m_tiles = (p.m_dim + kWgradBlockM - 1) / kWgradBlockM;
  const int n_tiles = (p.n_dim + kN - 1) / kN;
  const int total = *num_active * m_tiles * n_tiles;
  if (static_cast<int>(blockIdx.x) >= total) return;  // no barrier follows for this CTA

  // ---- Load cursor: (ld_tile, ld_kt) runs kAhead steps ahead of the math, across tiles.
  // The gathered operand's index: the 32 lanes of a warp load the same few rows (8 with
  // 64-row slabs; its slab split gives each row to 16 or 32 consecutive threads), so lanes
  // 0..7 fetch one entry each, one step early, and at use the token (entry / top_k) reaches
  // the other lanes by shuffle: one load and one division a thread per step instead of eight.
  int ld_tile = blockIdx.x;
  int ld_kt = 0;
  WgradTile ld = DecodeWgradTile<kN, kSlabRows>(ld_tile, m_tiles, n_tiles, active, offs);
  constexpr int kRowSetLanes = 32 / ShapeG::kChunksPerRow;  // lanes per j: 1 or 2
  static_assert(32 % ShapeG::kChunksPerRow == 0 && ShapeG::kRows * kRowSetLanes <= 32,
                "a warp's gathered rows must fit its lanes");
  const int lane = tid & 31;
  const bool fetcher = lane < ShapeG::kRows * kRowSetLanes;
  const int fetch_row = (tid - lane) / ShapeG::kChunksPerRow + lane % kRowSetLanes +
                        (lane / kRowSetLanes) * ShapeG::kRowStep;
  int raw = 0;
  auto fetch_raw = [&]() {
    const int r = ld_kt * kSlabRows + fetch_row;
    raw = (fetcher && r < ld.count) ? p.entries[ld.slot0 + r] : 0;
  };
  fetch_raw();
  // Row j of this thread's gathered share, as a token index (all 32 lanes must call).
  auto gathered_token = [&](int tok, int j) {
    return __shfl_sync(0xffffffffu, tok, j * kRowSetLanes + lane / ShapeG::kChunksPerRow);
  };
  const int col_a = (tid % ShapeA::kChunksPerRow) * 8;  // this thread's column in each slab
  const int col_b = (tid % ShapeB::kChunksPerRow) * 8;

  auto issue_load = [&](int stage) {
    if (ld_tile < total) {
      const uint32_t s_a = base + stage * kStageBytes;
      const uint32_t s_b = s_a + kTileABytes;
      const int rows_valid = ld.count - ld_kt * kSlabRows;
      const int slot_base = ld.slot0 + ld_kt * kSlabRows;
      const __nv_bfloat16* a_ptr[ShapeA::kRows];
      const __nv_bfloat16* b_ptr[ShapeB::kRows];
      const __nv_bfloat16* a_col = p.a + ld.m0 + col_a;
      const __nv_bfloat16* b_col = p.b + ld.n0 + col_b;
      const int tok = FastDivide(raw, p.top_k);
      if constexpr (kGatherA) {
#pragma unroll
        for (int j = 0; j < ShapeA::kRows; ++j) {
          a_ptr[j] = a_col + static_cast<int64_t>(gathered_token(tok, j)) * p.m_dim;
        }
        const __nv_bfloat16* b0 =
            b_col + static_cast<int64_t>(slot_base + ShapeB::Row(tid, 0)) * p.n_dim;
#pragma unroll
        for (int j = 0; j < ShapeB::kRows; ++j) {
          b_ptr[j] = b0 + static_cast<int64_t>(j * ShapeB::kRowStep) * p.n_dim;
        }
      } else {
        const __nv_bfloat16* a0 =
            a_col + static_cast<int64_t>(slot_base + ShapeA::Row(tid, 0)) * p.m_dim;
#pragma unroll
        for (int j = 0; j < ShapeA::kRows; ++j) {
          a_ptr[j] = a0 + static_cast<int64_t>(j * ShapeA::kRowStep) * p.m_dim;
        }
#pragma unroll
        for (int j = 0; j < ShapeB::kRows; ++j) {
          b_ptr[j] = b_col + static_cast<int64_t>(gathered_token(tok, j)) * p.n_dim;
        }
      }
      // With kTmaSlots a full slab of the slot-order operand comes by TMA instead.
      const bool tma = kTmaSlots && rows_valid >= kSlabRows;
      if (!(tma && !kGatherA)) {
        LoadSlab<kWgradBlockM, kSlabRows>(s_a, a_ptr, ld.m0 + col_a < p.m_dim, rows_valid, p.a,
                                          tid);
      }
      if (!(tma && kGatherA)) {
        LoadSlab<kN, kSlabRows>(s_b, b_ptr, ld.n0 + col_b < p.n_dim, rows_valid, p.b, tid);
      }
      if (kTmaSlots && tid == 0) {
        const uint32_t bar = SmemAddr(&tma_bar[stage]);
        if (tma) {
          constexpr int kSlotCols = kGatherA ? kN : kWgradBlockM;
          MbarArriveExpectTx(bar, kSlotCols * kSlabRows * 2);
#pragma unroll
          for (int q = 0; q < kSlotCols / 64; ++q) {
            TmaLoad2d((kGatherA ? s_b : s_a) + q * MnMajorSlab<kSlabRows>::kBlockBytes, &p.slot_map,
                      bar, (kGatherA ? ld.n0 : ld.m0) + 64 * q, slot_base);
          }
        } else {
          MbarArrive(bar);  // the cp.async path: the phase completes with no bytes
        }
      }
      // The cursor's last slab of a tile is kAhead steps before that tile's epilogue.
      if (p.accumulate && ld_kt == ld.num_k - 1) PrefetchWgradTile<kN>(p, ld, tid);
      if (++ld_kt == ld.num_k) {
        ld_kt = 0;
        ld_tile += gridDim.x;
        if (ld_tile < total) {
          ld = DecodeWgradTile<kN, kSlabRows>(ld_tile, m_tiles, n_tiles, active, offs);
        }
      }
      if (ld_tile < total) fetch_raw();
    }
    CpAsyncCommit();  // always one group per step, so the wait counts stay exact
  };

  const int wg = tid >> 7;
  for (int s = 0; s < kAhead; ++s) issue_load(s);

  uint32_t it = 0;  // steps consumed by this CTA across tiles: the ring stage
  float acc[kAcc];
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const WgradTile ti = DecodeWgradTile<kN, kSlabRows>(tile, m_tiles, n_tiles, active, offs);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

    // ---- Main loop over the expert's rows, kSlabRows per step.
    for (int kt = 0; kt < ti.num_k; ++kt, ++it) {
      const int stage = it % kStages;
      CpAsyncWait<kAhead - 1>();
      if constexpr (kTmaSlots) MbarWait(SmemAddr(&tma_bar[stage]), (it / kStages) & 1);
      FenceProxyAsync();
      __syncthreads();  // stage visible to all; the stage the loads below refill is idle
      const uint32_t s_a = base + stage * kStageBytes + wg * Slab::kBlockBytes;
      const uint32_t s_b = base + stage * kStageBytes + kTileABytes;
      const uint64_t desc_a = MakeSmemDescSw128(s_a, Slab::kLbo, Slab::kSbo);
      const uint64_t desc_b = MakeSmemDescSw128(s_b, Slab::kLbo, Slab::kSbo);
      FenceOperands(acc);
      WgmmaFence();
#pragma unroll
      for (int j = 0; j < kSlabRows / 16; ++j) {
        WgmmaMnMajor<kN>::Run(acc, desc_a + j * Slab::kK16DescStep,
                              desc_b + j * Slab::kK16DescStep);
      }
      WgmmaCommit();
      FenceOperands(acc);
      issue_load((it + kAhead) % kStages);
      WgmmaWait<kDrain ? 0 : 1>();
      FenceOperands(acc);
    }
    WgmmaWait<0>();
    FenceOperands(acc);

    // ---- Epilogue (the cursor's loads for the next tile are already in flight).
    StoreWgradTile<kN>(p, ti, acc, tid);
  }
  CpAsyncWait<0>();
}

// Host side: one launch of an instantiation, kCtasPerSm CTAs per SM (the tile count is known
// only on the device). Kept with the kernel so a benchmark can time instantiations the public
// launchers do not choose.
template <int kN, int kSlabRows, bool kGatherA, bool kDrain = false, int kCtasPerSm = 1,
          bool kTmaSlots = false>
cudaError_t LaunchWeightGradKernel(const WeightGradParams& params_in, cudaStream_t stream) {
  auto* kernel = sm90_weight_grad_kernel<kN, kSlabRows, kGatherA, kDrain, kCtasPerSm, kTmaSlots>;
  WeightGradParams params = params_in;
  if constexpr (kTmaSlots) {
    const cudaError_t encoded =
        EncodeSlotRowsMap(&params.slot_map, kGatherA ? params.b : params.a, params.slot_rows,
                          kGatherA ? params.n_dim : params.m_dim, kSlabRows);
    if (encoded != cudaSuccess) return encoded;
  }
  constexpr int kSmem = WgradSmemBytes<kN, kSlabRows, kCtasPerSm>();
  static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 per-block limit");
  static_assert(kCtasPerSm == 1 || kSmem <= 113 * 1024, "two CTAs must fit one SM's 228 KB");
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (kCtasPerSm > 1 && err == cudaSuccess) {  // all of the SM's shared memory, for both CTAs
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  if (err != cudaSuccess) return err;
  const int sms = SmCount();
  if (sms <= 0) return cudaErrorNoDevice;
  kernel<<<sms * kCtasPerSm, kWgradThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_IMPLS_WEIGHT_GRAD_CUH_
