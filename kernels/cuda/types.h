// Element types shared by the CUDA kernels' host entry points.
//
// Kernels are templates over float and __nv_bfloat16; their launchers take this enum so that
// plain C++ callers (the engine, compiled by g++) never see CUDA device types. Every launcher
// switches on it once and names the unsupported value in its error.
#ifndef MOE_KERNELS_CUDA_TYPES_H_
#define MOE_KERNELS_CUDA_TYPES_H_

#include <cstddef>

namespace moe::kernels {

enum class ElemType : int { kFloat32 = 0, kBFloat16 = 1 };

inline size_t ElemSize(ElemType t) { return t == ElemType::kFloat32 ? 4 : 2; }

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_TYPES_H_
