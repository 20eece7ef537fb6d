// A float64 reference of the layer contract (engine/layer.h), written as plain loops with no
// code shared with the engines, for forward checks and finite-difference gradients.
#ifndef MOE_TESTS_ENGINE_CPU_REFERENCE_H_
#define MOE_TESTS_ENGINE_CPU_REFERENCE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/layer.h"

namespace moe::testing {

// Local weights of one layer (w1/w3/w2 of its shard; the full router), as doubles.
struct RefParams {
  std::map<std::string, std::vector<double>> w;  // "w1", "w3", "w2", "router"
};

struct RefResult {
  std::vector<double> out;   // [T, d]
  std::vector<int32_t> idx;  // [T, K] routing used
  std::vector<double> p;     // [T, K]
  double aux = 0.0;
  double z = 0.0;
};

// Forward of `config` on x [T, d]; client routing reads idx/p, server routing ignores them.
// round_bf16: round to bf16 at the contract's rounding points (H1, H3, A, Y, out), to check
// that an engine's bf16 path rounds where docs/CONTRACT.md says.
RefResult RefForward(const LayerConfig& config, const RefParams& params,
                     const std::vector<double>& x, int64_t t, const std::vector<int32_t>& idx,
                     const std::vector<double>& p, bool round_bf16 = false);

// The scalar whose gradient Backward returns: <dout, out> (+ aux + z on the shard that owns
// expert 0, server routing).
double RefLoss(const LayerConfig& config, const RefParams& params, const std::vector<double>& x,
               int64_t t, const std::vector<int32_t>& idx, const std::vector<double>& p,
               const std::vector<double>& dout);

// ||got - want|| / max(||want||, 1e-30).
double RelError(const std::vector<double>& got, const std::vector<double>& want);

}  // namespace moe::testing

#endif  // MOE_TESTS_ENGINE_CPU_REFERENCE_H_
