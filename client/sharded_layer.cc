// ShardedLayer: one client-routed layer whose experts are spread over several servers (see
// client.h). Each shard gets only the tokens with a top-K pick in its range, gathered into a
// dense micro-batch; their partial outputs and gradients are scattered back and summed in
// float32 here, so a shard with no routed tokens gets no call.
#include <cmath>
#include <cstring>
#include <future>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client.h"
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
          "; a sharded layer gathers each shard's rows in host memory, so it takes host tensors"));
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
  for (int64_t i = 0; i < n; ++i) {
    LayerConfig c = s->config_;
    c.expert_first = first;
    c.expert_count = config.num_experts / n + (i < config.num_experts % n ? 1 : 0);
    first += c.expert_count;
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<RemoteLayer> layer,
                         RemoteLayer::Create(conns[i], name, c));
    s->shards_.push_back(std::move(layer));
  }
  return s;
}

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
  Pending pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(context_id);
    if (it == pending_.end()) {
      return absl::NotFoundError(
          absl::StrCat("context_id: no pending sharded context ", context_id));
    }
    pending = std::move(it->second);
    pending_.erase(it);
  }
  const int64_t d = config_.d_model, k = config_.top_k;
  MOE_RETURN_IF_ERROR(CheckTensor(dout.view(), "dout", DType::kFloat32, {pending.tokens, d}));
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
  double sq = 0;
  for (auto& shard : shards_) {
    MOE_ASSIGN_OR_RETURN(const StepOutput r, shard->Step());
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
