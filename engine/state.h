// The names of a layer's state tensors, and the checks every engine runs before an import.
//
// ExportState/ImportState speak one vocabulary (layer.h): "<param>" for a weight in the layer
// dtype, "<param>.exp_avg" / ".exp_avg_sq" (AdamW), ".momentum" (SGD), ".master" (bf16 storage),
// all fp32, and "step" ([1] int64). Keeping the parsing and validation here means the CPU and
// CUDA engines accept and reject exactly the same imports with the same messages.
#ifndef MOE_ENGINE_STATE_H_
#define MOE_ENGINE_STATE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor.h"
#include "engine/layer.h"

namespace moe {

enum class StateKind { kWeight, kExpAvg, kExpAvgSq, kMomentum, kMaster, kStep };

struct StateName {
  std::string param;  // "w1", "w3", "w2", "router"; empty for kStep
  StateKind kind = StateKind::kWeight;
};

// "w1.exp_avg" -> {"w1", kExpAvg}. Does not check that the param exists or that this layer
// keeps that kind of state; ValidateStateTensor does.
StateName ParseStateName(const std::string& name);

// The tensor name of `param`'s state of `kind` (inverse of ParseStateName).
std::string StateTensorName(const std::string& param, StateKind kind);

// Checks one tensor of an import against a layer: the name is one this layer keeps (params
// looked up through `param_shape`, which returns null for an unknown param), dtype and shape
// match exactly, values are finite (and exp_avg_sq >= 0), step >= 0. InvalidArgument naming
// state["<name>"] otherwise.
absl::Status ValidateStateTensor(
    const LayerConfig& config, const std::string& name, const Tensor& tensor,
    const std::function<const std::vector<int64_t>*(const std::string&)>& param_shape);

// The bytes of a layer's state on an engine that keeps `bytes_per_param` bytes for each of its
// parameters (weights, gradient, optimizer state and master together): the layer's parameter
// count (w1, w3 when gated, w2 of its local experts, the router with server routing) times
// that. Validates the config first (ValidateLayerConfig); ResourceExhausted, naming the layer
// config, when the product does not fit in int64.
absl::StatusOr<int64_t> LayerStateBytesFor(const LayerConfig& config, int64_t bytes_per_param);

// A byte count an engine estimated in floating point (an upper bound built from a config's
// sizes, whose exact product could overflow) as an int64, rounded up; ResourceExhausted naming
// `what` past 2^62 bytes.
absl::StatusOr<int64_t> EstimatedBytes(double bytes, absl::string_view what);

// The dtype and shape of one state tensor.
struct StateTensorSpec {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
};

// Every tensor a layer with `config` gives from ExportState(include_optimizer), by name: the
// weights (w1, w3 when gated, w2, router with server routing) in the layer dtype and, with the
// optimizer, their fp32 optimizer state (and masters for bf16 storage) and "step". A whole-state
// import (a checkpoint) must hold exactly these; ImportState alone accepts any subset.
std::map<std::string, StateTensorSpec> FullStateSpec(const LayerConfig& config,
                                                     bool include_optimizer);

}  // namespace moe

#endif  // MOE_ENGINE_STATE_H_
