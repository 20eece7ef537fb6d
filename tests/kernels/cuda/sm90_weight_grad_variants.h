// Test-only access to the weight-gradient kernel instantiations that the public launchers
// (LaunchSm90WeightGradW2/W13) do not choose but bench/sm90_weight_grad_bench.cu times, so
// sm90_weight_grad_test can hold every timed kernel to the CPU reference. Plain C++ (the test
// is a host .cc); the instantiations live in sm90_weight_grad_variants.cu.
#ifndef MOE_TESTS_KERNELS_CUDA_SM90_WEIGHT_GRAD_VARIANTS_H_
#define MOE_TESTS_KERNELS_CUDA_SM90_WEIGHT_GRAD_VARIANTS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe::kernels::testing {

int WeightGradVariantCount();
const char* WeightGradVariantName(int i);

// C[e] (+)= sum over expert e's slots s of A[a_row(s)]^T B[b_row(s)], as the launchers: with
// gather_a (dW2) A's rows are entries[s] / top_k and B's are s; without (dW13) the other way.
// a [*, m], b [*, n] bf16; c [experts, m, n] fp32; slot_rows: rows of the slot-order operand.
cudaError_t LaunchWeightGradVariant(int i, bool gather_a, const uint16_t* a, const uint16_t* b,
                                    const int32_t* offsets, const int32_t* entries, float* c,
                                    int32_t experts, int32_t m, int32_t n, int32_t top_k,
                                    int32_t slot_rows, bool accumulate, cudaStream_t stream);

}  // namespace moe::kernels::testing

#endif  // MOE_TESTS_KERNELS_CUDA_SM90_WEIGHT_GRAD_VARIANTS_H_
