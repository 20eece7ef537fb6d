// The tensor-core side of the sm90 kernels: shared-memory matrix descriptors for the 128-byte
// swizzle (K-major, and MN-major read with wgmma's transpose flag) and the two wgmma shapes the
// kernels issue, m64n128k16 and m64n256k16 (bf16 in, fp32 accumulators), with Wgmma<kN>
// choosing between them at compile time.
//
// A stage is staged in the 128-byte swizzle because that is the layout wgmma reads without bank
// conflicts; a k16 step then moves a K-major descriptor 32 bytes and an MN-major one 16 whole
// 128-byte lines, which keeps the 1024-byte swizzle phase (no base offset needed).
#ifndef MOE_KERNELS_CUDA_SM90_MMA_CUH_
#define MOE_KERNELS_CUDA_SM90_MMA_CUH_

#include <cstdint>

#include "kernels/cuda/sm90/params.cuh"

namespace moe::kernels::sm90 {

// Shared-memory matrix descriptor for a K-major operand in the 128-byte swizzle: 8-row core
// groups 1024 bytes apart (stride byte offset), leading byte offset unused for this layout.
// The tile base must be 1024-byte aligned; stepping k by 16 elements adds 32 bytes to the start.
__device__ __forceinline__ uint64_t MakeSmemDesc(uint32_t addr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>(1) << 16;
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// The same descriptor in the 128-byte swizzle with both byte offsets explicit, for layouts
// where the leading offset matters (MN-major operands read with wgmma's transpose flag, whose
// 64-element-wide swizzle atoms repeat along M/N): lbo and sbo in bytes, multiples of 16.
__device__ __forceinline__ uint64_t MakeSmemDescSw128(uint32_t addr, uint32_t lbo_bytes,
                                                      uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// An MN-major operand stored as consecutive blocks of 64 k-rows x 64 MN elements (8 KB, each
// 128-byte line one k-row of 64 consecutive MN elements, 16-byte chunk c of k-row r at chunk
// c ^ (r % 8), which is what a TMA box {64, 64} in SWIZZLE_128B writes). In the PTX ISA's
// canonical MN-major 128-byte-swizzle layout, the leading byte offset is the step between
// 64-element MN blocks and the stride byte offset the step between groups of 8 k-rows; a k16
// step is 16 whole lines (2048 bytes), which keeps the 1024-byte swizzle phase, so no base
// offset is needed as long as the block base is 1024-byte aligned.
constexpr uint32_t kMnBlockBytes = 64 * kBlockK * 2;  // one 64 x 64 bf16 block
constexpr uint32_t kMnLbo = kMnBlockBytes;
constexpr uint32_t kMnSbo = 8 * 128;
constexpr uint32_t kMnK16Bytes = 16 * 128;
__device__ __forceinline__ uint64_t MakeMnMajorDesc(uint32_t addr) {
  return MakeSmemDescSw128(addr, kMnLbo, kMnSbo);
}

// D[64x128] (+)= A[64x16] * B[128x16]^T from 128-byte-swizzled shared memory. kTransA/kTransB
// = 1 reads that operand MN-major (the wgmma transpose flag, bf16 only); 0 is K-major.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// D[64x256] (+)= A[64x16] * B[256x16]^T; operand majors as for the 64x128 form.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void WgmmaM64N256K16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127"
      "}, %128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// kTransB: B MN-major (A is always K-major here).
template <int kN, int kTransB = 0>
struct Wgmma;
template <int kTransB>
struct Wgmma<128, kTransB> {
  __device__ __forceinline__ static void Run(float (&d)[64], uint64_t a, uint64_t b) {
    WgmmaM64N128K16<0, kTransB>(d, a, b, 1);
  }
};
template <int kTransB>
struct Wgmma<256, kTransB> {
  __device__ __forceinline__ static void Run(float (&d)[128], uint64_t a, uint64_t b) {
    WgmmaM64N256K16<0, kTransB>(d, a, b, 1);
  }
};

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_MMA_CUH_
