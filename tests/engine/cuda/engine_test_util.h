// Helpers shared by the CUDA engine's tests against the CPU engine (cuda_engine_test.cc and
// recompute_test.cc, one binary): random inputs and the normalised error both hold the GPU's
// tensors to.
#ifndef MOE_TESTS_ENGINE_CUDA_ENGINE_TEST_UTIL_H_
#define MOE_TESTS_ENGINE_CUDA_ENGINE_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace moe::testing {

// Every element as a double, whatever the tensor's dtype.
inline std::vector<double> AsDouble(const Tensor& t) {
  std::vector<double> v(t.num_elements());
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (t.dtype == DType::kInt32) {
      v[i] = t.as<int32_t>()[i];
    } else if (t.dtype == DType::kInt64) {
      v[i] = static_cast<double>(t.as<int64_t>()[i]);
    } else {
      v[i] = LoadFloat(t.view(), i);
    }
  }
  return v;
}

// ||a - b|| / ||b||; infinity for any NaN or a shape mismatch.
inline double NormErr(const Tensor& a, const Tensor& b) {
  if (a.shape != b.shape || a.dtype != b.dtype) return INFINITY;
  const std::vector<double> x = AsDouble(a), y = AsDouble(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INFINITY;
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// Normal(0, scale) values, rounded to bf16 for bf16 tensors.
inline Tensor RandomFloat(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                          float scale) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  std::normal_distribution<float> nd(0.f, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const float v = nd(rng);
    if (dtype == DType::kBFloat16) {
      t.as<uint16_t>()[i] = FloatToBFloat16(v);
    } else {
      t.as<float>()[i] = v;
    }
  }
  return t;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_ENGINE_CUDA_ENGINE_TEST_UTIL_H_
