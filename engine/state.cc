// State tensor names and import validation shared by every engine (see state.h).
#include "common/status_macros.h"
#include "engine/state.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

struct Suffix {
  StateKind kind;
  const char* text;
};
constexpr Suffix kSuffixes[] = {{StateKind::kExpAvg, "exp_avg"},
                                {StateKind::kExpAvgSq, "exp_avg_sq"},
                                {StateKind::kMomentum, "momentum"},
                                {StateKind::kMaster, "master"}};

// Whether a layer with this config keeps state of `kind` for each of its params.
bool LayerKeeps(const LayerConfig& config, StateKind kind) {
  const bool adamw = config.optimizer.kind == OptimizerKind::kAdamW;
  switch (kind) {
    case StateKind::kWeight:
    case StateKind::kStep:
      return true;
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq:
      return adamw;
    case StateKind::kMomentum:
      return !adamw;
    case StateKind::kMaster:
      return config.dtype == DType::kBFloat16;
  }
  return false;
}

}  // namespace

StateName ParseStateName(const std::string& name) {
  if (name == "step") return {"", StateKind::kStep};
  const size_t dot = name.find('.');
  if (dot == std::string::npos) return {name, StateKind::kWeight};
  const std::string suffix = name.substr(dot + 1);
  for (const Suffix& s : kSuffixes) {
    if (suffix == s.text) return {name.substr(0, dot), s.kind};
  }
  // An unknown suffix keeps the whole name as the param, which no layer has.
  return {name, StateKind::kWeight};
}

std::string StateTensorName(const std::string& param, StateKind kind) {
  if (kind == StateKind::kStep) return "step";
  for (const Suffix& s : kSuffixes) {
    if (s.kind == kind) return absl::StrCat(param, ".", s.text);
  }
  return param;
}

absl::Status ValidateStateTensor(
    const LayerConfig& config, const std::string& name, const Tensor& tensor,
    const std::function<const std::vector<int64_t>*(const std::string&)>& param_shape) {
  const std::string field = absl::StrCat("state[\"", name, "\"]");
  const StateName parsed = ParseStateName(name);
  if (parsed.kind == StateKind::kStep) {
    MOE_RETURN_IF_ERROR(CheckTensor(tensor.view(), field, DType::kInt64, {1}));
    if (tensor.as<int64_t>()[0] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": step must be >= 0"));
    }
    return absl::OkStatus();
  }
  const std::vector<int64_t>* shape = param_shape(parsed.param);
  if (shape == nullptr || !LayerKeeps(config, parsed.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": this layer has no state tensor of that name"));
  }
  const DType want = parsed.kind == StateKind::kWeight ? config.dtype : DType::kFloat32;
  MOE_RETURN_IF_ERROR(CheckTensor(tensor.view(), field, want, *shape));
  const TensorView v = tensor.view();
  const bool nonnegative = parsed.kind == StateKind::kExpAvgSq;
  for (int64_t i = 0; i < v.num_elements(); ++i) {
    const float x = LoadFloat(v, i);
    if (!std::isfinite(x) || (nonnegative && x < 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": element ", i, " = ", x,
                       nonnegative ? " (must be finite and >= 0)" : " is not finite"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LayerStateBytesFor(const LayerConfig& config, int64_t bytes_per_param) {
  MOE_RETURN_IF_ERROR(ValidateLayerConfig(config));
  const int64_t d = config.d_model, h = config.d_hidden, count = config.local_experts();
  // Every product and sum is checked: a valid config bounds the expert weights, not the router
  // (d * E) nor the product with the bytes per parameter.
  int64_t expert = 0, per_expert = 0, router = 0, params = 0, bytes = 0;
  const int64_t matrices = config.gated() ? 3 : 2;  // w1, [w3], w2, each [h, d] or [d, h]
  const bool overflow = __builtin_mul_overflow(d, h, &per_expert) ||
                        __builtin_mul_overflow(per_expert, matrices, &per_expert) ||
                        __builtin_mul_overflow(per_expert, count, &expert) ||
                        (config.routing == RoutingMode::kServer &&
                         __builtin_mul_overflow(d, config.num_experts, &router)) ||
                        __builtin_add_overflow(expert, router, &params) ||
                        __builtin_mul_overflow(params, bytes_per_param, &bytes);
  if (overflow) {
    return absl::ResourceExhaustedError("layer config: its state would need more than 2^63 bytes");
  }
  return bytes;
}

absl::StatusOr<int64_t> EstimatedBytes(double bytes, absl::string_view what) {
  constexpr double kMax = static_cast<double>(int64_t{1} << 62);
  if (!(bytes >= 0) || bytes > kMax) {  // also NaN
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": would need more than 2^62 bytes of memory"));
  }
  return static_cast<int64_t>(std::ceil(bytes));
}

std::map<std::string, StateTensorSpec> FullStateSpec(const LayerConfig& config,
                                                     bool include_optimizer) {
  const int64_t count = config.local_experts();
  const int64_t d = config.d_model;
  const int64_t h = config.d_hidden;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params = {{"w1", {count, h, d}}};
  if (config.gated()) params.push_back({"w3", {count, h, d}});
  params.push_back({"w2", {count, d, h}});
  if (config.routing == RoutingMode::kServer) params.push_back({"router", {d, config.num_experts}});
  std::map<std::string, StateTensorSpec> out;
  for (const auto& [param, shape] : params) {
    out[param] = {config.dtype, shape};
    if (!include_optimizer) continue;
    for (StateKind kind :
         {StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kMomentum, StateKind::kMaster}) {
      if (LayerKeeps(config, kind)) out[StateTensorName(param, kind)] = {DType::kFloat32, shape};
    }
  }
  if (include_optimizer) out["step"] = {DType::kInt64, {1}};
  return out;
}

}  // namespace moe
