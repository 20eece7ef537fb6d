// The instantiations behind sm90_weight_grad_variants.h: the same list (names and template
// arguments) as the directly launched variants of bench/sm90_weight_grad_bench.cu.
#include <cuda_bf16.h>

#include "kernels/cuda/sm90/impls/weight_grad.cuh"
#include "tests/kernels/cuda/sm90_weight_grad_variants.h"

namespace moe::kernels::testing {
namespace {

using sm90::LaunchWeightGradKernel;
using sm90::WeightGradParams;
using LaunchFn = cudaError_t (*)(const WeightGradParams&, cudaStream_t);

struct Variant {
  const char* name;
  LaunchFn gather_a;  // dW2
  LaunchFn gather_b;  // dW13
};

constexpr Variant kVariants[] = {
    {"2cta_n128_s64_drain", LaunchWeightGradKernel<128, 64, true, true, 2>,
     LaunchWeightGradKernel<128, 64, false, true, 2>},
    {"2cta_n128_s48_drain", LaunchWeightGradKernel<128, 48, true, true, 2>,
     LaunchWeightGradKernel<128, 48, false, true, 2>},
    {"2cta_n128_tma", LaunchWeightGradKernel<128, 64, true, true, 2, true>,
     LaunchWeightGradKernel<128, 64, false, true, 2, true>},
};

}  // namespace

int WeightGradVariantCount() { return static_cast<int>(sizeof(kVariants) / sizeof(kVariants[0])); }

const char* WeightGradVariantName(int i) { return kVariants[i].name; }

cudaError_t LaunchWeightGradVariant(int i, bool gather_a, const uint16_t* a, const uint16_t* b,
                                    const int32_t* offsets, const int32_t* entries, float* c,
                                    int32_t experts, int32_t m, int32_t n, int32_t top_k,
                                    int32_t slot_rows, bool accumulate, cudaStream_t stream) {
  const WeightGradParams params = sm90::MakeWeightGradParams(a, b, offsets, entries, c, experts, m,
                                                             n, top_k, slot_rows, accumulate);
  return (gather_a ? kVariants[i].gather_a : kVariants[i].gather_b)(params, stream);
}

}  // namespace moe::kernels::testing
