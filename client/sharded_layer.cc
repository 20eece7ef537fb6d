// ShardedLayer: one client-routed layer whose experts are spread over several servers (see
// client.h). Each shard gets only the tokens with a top-K pick in its range, gathered into a
// dense micro-batch; their partial outputs and gradients are scattered back and summed in
// float32 here, so a shard with no routed tokens gets no call. Device tensors are checked here
// and handed to the device path (sharded_device.h).
#include <cmath>
#include <cstring>
#include <future>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/device.h"
#include "client/sharded_device.h"
#include "common/host_memory.h"
#include "common/status_macros.h"

namespace moe::client {
namespace {

// Rows `rows` of a row-major [T, ...] tensor.
Tensor GatherRows(const Tensor& t, const std::vector<int64_t>& rows) {
  Tensor out;
  out.dtype = t.dtype;
  out.shape = t.shape;
  out.shape[0] = static_cast<int64_t>(rows.size());
  const size_t row = t.shape[0] ? t.bytes.size() / t.shape[0] : 0;
  out.bytes.resize(rows.size() * row);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.bytes.data() + i * row, t.bytes.data() + rows[i] * row, row);
  }
  return out;
}

// dst[rows[i], :] += src[i, :], float32.
void ScatterAdd(const Tensor& src, const std::vector<int64_t>& rows, Tensor* dst) {
  const int64_t width = dst->shape.size() > 1 ? dst->shape[1] : 1;
  const float* s = src.as<float>();
  float* d = dst->as<float>();
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t j = 0; j < width; ++j) d[rows[i] * width + j] += s[i * width + j];
  }
}

// Waits for every shard's call (an invalid future: the shard got none) and hands each result to
// use(shard, result); the first shard's error, once all are done.
template <typename Out, typename Use>
absl::Status JoinShards(std::vector<std::future<absl::StatusOr<Out>>>& futures, Use use) {
  absl::Status first_error;
  for (size_t s = 0; s < futures.size(); ++s) {
    if (!futures[s].valid()) continue;
    absl::StatusOr<Out> r = futures[s].get();
    if (r.ok()) {
      use(s, *r);
    } else if (first_error.ok()) {
      first_error = r.status();
    }
  }
  return first_error;
}

// InvalidArgument naming the first view that is not in host memory.
absl::Status HostOnly(std::initializer_list<std::pair<const TensorView*, const char*>> views) {
  for (const auto& [v, field] : views) {
    if (!v->empty() && !v->location.is_host()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": on ", v->location.DebugString(),
          "; Forward and Backward take host tensors (ForwardInto and BackwardInto take device "
          "tensors)"));
    }
  }
  return absl::OkStatus();
}

template <typename Out>
std::future<absl::StatusOr<Out>> Ready(absl::Status st) {
  std::promise<absl::StatusOr<Out>> p;
  p.set_value(std::move(st));
  return p.get_future();
}

// One tensor of an Into call: whether it was given, where it is, its field.
struct Placed {
  bool given;
  MemoryLocation where;
  const char* field;
};

// Where an Into call's given tensors are: the first's place (the call's first input, always
// given), which every other must share. A device place in a client built without CUDA is
// InvalidArgument naming the tensor, as Connection's calls say it.
absl::StatusOr<MemoryLocation> CallPlace(std::initializer_list<Placed> parts) {
  const Placed& first = *parts.begin();
  for (const Placed& p : parts) {
    if (!p.given) continue;
    if (p.where.is_cuda() && !device::Built()) {
      return absl::InvalidArgumentError(
          absl::StrCat(p.field, ": a tensor on ", p.where.DebugString(),
                       ", but this client was built without CUDA; pass host tensors"));
    }
    if (p.where != first.where) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.field, ": on ", p.where.DebugString(), ", but ", first.field, " is on ",
          first.where.DebugString(), " (a sharded layer's call has its tensors in one place)"));
    }
  }
  return first.where;
}

// Copies a host result into the caller's destination (empty: the result stays returned).
absl::Status Into(Tensor& result, const MutableTensorView& dest, const char* field) {
  if (dest.empty()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(CheckTensor(dest, field, result.dtype, result.shape));
  ParallelMemcpy(dest.data, result.bytes.data(), result.bytes.size());
  result = Tensor();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedLayer>> ShardedLayer::Create(
    std::vector<std::shared_ptr<Connection>> conns, const std::string& name,
    const LayerConfig& config) {
  if (conns.empty()) return absl::InvalidArgumentError("conns: at least one server is needed");
  if (config.routing != RoutingMode::kClient) {
    return absl::InvalidArgumentError(
        "config.routing: a sharded layer needs client routing (the client must know where each "
        "token goes)");
  }
  if (config.dtype != DType::kFloat32) {
    return absl::InvalidArgumentError("config.dtype: a sharded layer sums partials in float32");
  }
  const int64_t n = static_cast<int64_t>(conns.size());
  if (config.num_experts < n) {
    return absl::InvalidArgumentError(absl::StrCat("config.num_experts: ", config.num_experts,
                                                   " experts cannot be split over ", n,
                                                   " servers"));
  }
  std::unique_ptr<ShardedLayer> s(new ShardedLayer());
  s->config_ = config;
  s->config_.expert_first = 0;
  s->config_.expert_count = -1;
  int64_t first = 0;
  std::vector<RemoteLayer*> shards;
  std::vector<ExpertRange> ranges;
  for (int64_t i = 0; i < n; ++i) {
    LayerConfig c = s->config_;
    c.expert_first = first;
    c.expert_count = config.num_experts / n + (i < config.num_experts % n ? 1 : 0);
    first += c.expert_count;
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<RemoteLayer> layer,
                         RemoteLayer::Create(conns[i], name, c));
    shards.push_back(layer.get());
    ranges.push_back({layer->config().expert_first, layer->config().local_experts()});
    s->shards_.push_back(std::move(layer));
  }
  s->device_ = MakeShardedDevice(s->config_, std::move(shards), std::move(ranges));
  return s;
}

ShardedLayer::~ShardedLayer() = default;

std::future<absl::StatusOr<ForwardOutput>> ShardedLayer::Forward(const TensorView& x,
                                                                 const TensorView& ids,
                                                                 const TensorView& weights,
                                                                 bool training) {
  if (absl::Status st = HostOnly({{&x, "x"}, {&ids, "expert_ids"}, {&weights, "weights"}});
      !st.ok()) {
    return Ready<ForwardOutput>(st);
  }
  return std::async(std::launch::async, &ShardedLayer::RunForward, this, ToTensor(x), ToTensor(ids),
                    ToTensor(weights), training);
}

std::future<absl::StatusOr<BackwardOutput>> ShardedLayer::Backward(uint64_t context_id,
                                                                   const TensorView& dout) {
  if (absl::Status st = HostOnly({{&dout, "dout"}}); !st.ok()) return Ready<BackwardOutput>(st);
  return std::async(std::launch::async, &ShardedLayer::RunBackward, this, context_id,
                    ToTensor(dout));
}

std::future<absl::StatusOr<ForwardOutput>> ShardedLayer::ForwardInto(
    const TensorView& x, const TensorView& ids, const TensorView& weights,
    const MutableTensorView& out, void* stream, bool training) {
  const int64_t d = config_.d_model, k = config_.top_k;
  const int64_t tokens = x.shape.empty() ? -1 : x.shape[0];
  absl::StatusOr<MemoryLocation> place = CallPlace({{true, x.location, "x"},
                                                     {!ids.empty(), ids.location, "expert_ids"},
                                                     {!weights.empty(), weights.location, "weights"},
                                                     {!out.empty(), out.location, "out"}});
  if (!place.ok()) return Ready<ForwardOutput>(place.status());
  absl::Status st = CheckTensor(x, "x", DType::kFloat32, {-1, d});
  if (st.ok()) st = CheckTensor(ids, "expert_ids", DType::kInt32, {tokens, k});
  if (st.ok()) st = CheckTensor(weights, "weights", DType::kFloat32, {tokens, k});
  if (st.ok() && out.empty() && place->is_cuda()) {
    st = absl::InvalidArgumentError(
        "out: device tensors need a device destination (the sum is made on the GPU)");
  }
  if (st.ok() && !out.empty()) st = CheckTensor(out, "out", DType::kFloat32, {tokens, d});
  if (st.ok() && place->is_cuda() && tokens * k > INT32_MAX) {
    st = absl::InvalidArgumentError(
        absl::StrCat("x: ", tokens, " tokens of ", k, " picks are more than a device call takes"));
  }
  if (!st.ok()) return Ready<ForwardOutput>(st);
  if (place->is_host()) {
    return std::async(std::launch::async,
                      [this, out, x = ToTensor(x), ids = ToTensor(ids), w = ToTensor(weights),
                       training]() mutable -> absl::StatusOr<ForwardOutput> {
                        MOE_ASSIGN_OR_RETURN(
                            ForwardOutput r,
                            RunForward(std::move(x), std::move(ids), std::move(w), training));
                        MOE_RETURN_IF_ERROR(Into(r.out, out, "out"));
                        return r;
                      });
  }
  return device_->Forward(x, ids, weights, out, stream, training ? next_id_++ : 0);
}

std::future<absl::StatusOr<BackwardOutput>> ShardedLayer::BackwardInto(
    uint64_t context_id, const TensorView& dout, const MutableTensorView& dx,
    const MutableTensorView& dweights, void* stream, const BackwardOptions& options) {
  absl::StatusOr<MemoryLocation> place =
      CallPlace({{true, dout.location, "dout"},
                 {!dx.empty(), dx.location, "dx"},
                 {!dweights.empty(), dweights.location, "dweights"}});
  if (!place.ok()) return Ready<BackwardOutput>(place.status());
  absl::Status st = CheckTensor(dout, "dout", DType::kFloat32, {-1, config_.d_model});
  if (st.ok() && !dx.empty()) st = CheckTensor(dx, "dx", DType::kFloat32, dout.shape);
  if (st.ok() && !dweights.empty()) {
    st = CheckTensor(dweights, "dweights", DType::kFloat32, {dout.shape[0], config_.top_k});
  }
  if (!st.ok()) return Ready<BackwardOutput>(st);
  const bool device_context = device_ != nullptr && device_->Has(context_id);
  if (device_context != place->is_cuda()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (device_context || pending_.count(context_id)) {
      return Ready<BackwardOutput>(absl::InvalidArgumentError(absl::StrCat(
          "dout: on ", place->DebugString(), ", but context ", context_id, "'s Forward took ",
          device_context ? "device" : "host", " tensors (its Backward takes the same)")));
    }
  }
  if (place->is_cuda()) {
    if (dx.empty() || dweights.empty()) {
      return Ready<BackwardOutput>(absl::InvalidArgumentError(absl::StrCat(
          dx.empty() ? "dx" : "dweights",
          ": device tensors need a device destination (the sum is made on the GPU)")));
    }
    return device_->Backward(context_id, dout, dx, dweights, stream, options);
  }
  return std::async(std::launch::async,
                    [this, context_id, dx, dweights,
                     dout = ToTensor(dout)]() mutable -> absl::StatusOr<BackwardOutput> {
                      MOE_ASSIGN_OR_RETURN(BackwardOutput r,
                                           RunBackward(context_id, std::move(dout)));
                      MOE_RETURN_IF_ERROR(Into(r.dx, dx, "dx"));
                      MOE_RETURN_IF_ERROR(Into(r.dweights, dweights, "dweights"));
                      return r;
                    });
}

absl::StatusOr<ForwardOutput> ShardedLayer::RunForward(Tensor x, Tensor ids, Tensor weights,
                                                       bool training) {
  const int64_t d = config_.d_model, k = config_.top_k;
  MOE_RETURN_IF_ERROR(CheckTensor(x.view(), "x", DType::kFloat32, {-1, d}));
  const int64_t tokens = x.shape[0];
  MOE_RETURN_IF_ERROR(CheckTensor(ids.view(), "expert_ids", DType::kInt32, {tokens, k}));
  MOE_RETURN_IF_ERROR(CheckTensor(weights.view(), "weights", DType::kFloat32, {tokens, k}));
  Pending pending;
  pending.tokens = tokens;
  pending.shard_context.assign(shards_.size(), 0);
  pending.rows.resize(shards_.size());
  const int32_t* id = ids.as<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (size_t s = 0; s < shards_.size(); ++s) {
      const LayerConfig& c = shards_[s]->config();
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = id[t * k + j];
        if (e < 0 || e >= config_.num_experts) {
          return absl::InvalidArgumentError(absl::StrCat("expert_ids: id ", e, " at [", t, ",", j,
                                                         "] is outside [0, ", config_.num_experts,
                                                         ")"));
        }
        if (e >= c.expert_first && e < c.expert_first + c.local_experts()) {
          pending.rows[s].push_back(t);
          break;
        }
      }
    }
  }
  std::vector<Tensor> xs(shards_.size()), is(shards_.size()), ws(shards_.size());
  std::vector<std::future<absl::StatusOr<ForwardOutput>>> futures(shards_.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (pending.rows[s].empty()) continue;
    xs[s] = GatherRows(x, pending.rows[s]);
    is[s] = GatherRows(ids, pending.rows[s]);
    ws[s] = GatherRows(weights, pending.rows[s]);
    futures[s] = shards_[s]->Forward(xs[s].view(), is[s].view(), ws[s].view(), training);
  }
  ForwardOutput out;
  out.out = Tensor::Zeros(DType::kFloat32, {tokens, d});
  // On an error, the shards' contexts die with their TTL or the session.
  MOE_RETURN_IF_ERROR(JoinShards(futures, [&](size_t s, const ForwardOutput& r) {
    ScatterAdd(r.out, pending.rows[s], &out.out);
    pending.shard_context[s] = r.context_id;
  }));
  if (training) {
    out.context_id = next_id_++;
    std::lock_guard<std::mutex> lock(mu_);
    pending_[out.context_id] = std::move(pending);
  }
  return out;
}

absl::StatusOr<BackwardOutput> ShardedLayer::RunBackward(uint64_t context_id, Tensor dout) {
  const int64_t d = config_.d_model, k = config_.top_k;
  Pending pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(context_id);
    if (it == pending_.end()) {
      return absl::NotFoundError(
          absl::StrCat("context_id: no pending sharded context ", context_id));
    }
    // A dout of the wrong shape leaves the context for a corrected call.
    MOE_RETURN_IF_ERROR(
        CheckTensor(dout.view(), "dout", DType::kFloat32, {it->second.tokens, d}));
    pending = std::move(it->second);
    pending_.erase(it);
  }
  std::vector<Tensor> douts(shards_.size());
  std::vector<std::future<absl::StatusOr<BackwardOutput>>> futures(shards_.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (pending.rows[s].empty()) continue;
    douts[s] = GatherRows(dout, pending.rows[s]);
    futures[s] = shards_[s]->Backward(pending.shard_context[s], douts[s].view());
  }
  BackwardOutput out;
  out.dx = Tensor::Zeros(DType::kFloat32, {pending.tokens, d});
  out.dweights = Tensor::Zeros(DType::kFloat32, {pending.tokens, k});
  MOE_RETURN_IF_ERROR(JoinShards(futures, [&](size_t s, const BackwardOutput& r) {
    ScatterAdd(r.dx, pending.rows[s], &out.dx);
    ScatterAdd(r.dweights, pending.rows[s], &out.dweights);
  }));
  return out;
}

absl::StatusOr<StepOutput> ShardedLayer::Step() {
  StepOutput out;
  out.tokens_per_expert.assign(config_.num_experts, 0);
  // All shards step at once (each is an RPC that runs the shard's optimizer); their results are
  // combined in shard order.
  std::vector<std::future<absl::StatusOr<StepOutput>>> steps;
  for (auto& shard : shards_) {
    steps.push_back(std::async(std::launch::async, [&shard] { return shard->Step(); }));
  }
  std::vector<absl::StatusOr<StepOutput>> results;
  for (auto& f : steps) results.push_back(f.get());
  double sq = 0;
  for (absl::StatusOr<StepOutput>& result : results) {
    MOE_ASSIGN_OR_RETURN(const StepOutput r, std::move(result));
    out.step = r.step;
    sq += r.grad_norm * r.grad_norm;
    for (size_t i = 0; i < r.tokens_per_expert.size(); ++i) {
      out.tokens_per_expert[r.expert_first + i] = r.tokens_per_expert[i];
    }
  }
  out.grad_norm = std::sqrt(sq);
  return out;
}

}  // namespace moe::client
