// Proto <-> engine conversions and tensor chunking (see wire.h). Defaults for zero-valued proto
// fields are filled here, once, so the server and the client agree on what "unset" means.
#include "common/status_macros.h"
#include "wire/wire.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe::wire {

absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_INT32:
      return DType::kInt32;
    case v1::DTYPE_INT64:
      return DType::kInt64;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": unknown dtype ", dtype, " (expected FLOAT32, BFLOAT16, INT32 or INT64)"));
  }
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kInt32:
      return v1::DTYPE_INT32;
    case DType::kInt64:
      return v1::DTYPE_INT64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<LayerConfig> LayerConfigFromProto(const v1::LayerConfig& p) {
  LayerConfig c;
  c.num_experts = p.num_experts();
  c.top_k = p.top_k();
  c.d_model = p.d_model();
  c.d_hidden = p.d_hidden();
  switch (p.activation()) {
    case v1::ACTIVATION_UNSPECIFIED:
    case v1::ACTIVATION_SWIGLU:
      c.activation = Activation::kSwiGLU;
      break;
    case v1::ACTIVATION_SILU:
      c.activation = Activation::kSiLU;
      break;
    case v1::ACTIVATION_GELU_TANH:
      c.activation = Activation::kGeLUTanh;
      break;
    case v1::ACTIVATION_RELU:
      c.activation = Activation::kReLU;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("config.activation: unknown activation ", p.activation()));
  }
  if (p.dtype() == v1::DTYPE_UNSPECIFIED) {
    c.dtype = DType::kFloat32;
  } else {
    auto dtype = DTypeFromProto(p.dtype(), "config.dtype");
    if (!dtype.ok()) return dtype.status();
    if (*dtype != DType::kFloat32 && *dtype != DType::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.dtype: ", DTypeName(*dtype), " is not a storage dtype (FLOAT32 or BFLOAT16)"));
    }
    c.dtype = *dtype;
  }
  switch (p.routing()) {
    case v1::ROUTING_UNSPECIFIED:
    case v1::ROUTING_CLIENT:
      c.routing = RoutingMode::kClient;
      break;
    case v1::ROUTING_SERVER:
      c.routing = RoutingMode::kServer;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("config.routing: unknown routing mode ", p.routing()));
  }
  c.expert_first = p.expert_first();
  c.expert_count = p.expert_count() == 0 ? -1 : p.expert_count();
  if (c.expert_count == -1 && c.expert_first != 0) {
    return absl::InvalidArgumentError(
        "config.expert_count: must be set when config.expert_first is not 0");
  }
  c.seed = p.seed();
  c.init_scale = p.init_scale() == 0 ? 1.0 : p.init_scale();
  c.renormalize = !p.no_renormalize();
  c.aux_loss_coef = p.aux_loss_coef();
  c.z_loss_coef = p.z_loss_coef();
  c.recompute_h = p.recompute_h();
  const v1::OptimizerConfig& o = p.optimizer();
  switch (o.kind()) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_ADAMW:
      c.optimizer.kind = OptimizerKind::kAdamW;
      break;
    case v1::OPTIMIZER_SGD:
      c.optimizer.kind = OptimizerKind::kSgd;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("config.optimizer.kind: unknown optimizer ", o.kind()));
  }
  if (o.learning_rate() != 0) c.optimizer.learning_rate = o.learning_rate();
  if (o.beta1() != 0) c.optimizer.beta1 = o.beta1();
  if (o.beta2() != 0) c.optimizer.beta2 = o.beta2();
  if (o.epsilon() != 0) c.optimizer.epsilon = o.epsilon();
  c.optimizer.weight_decay = o.weight_decay();
  c.optimizer.momentum = o.momentum();
  c.optimizer.max_grad_norm = o.max_grad_norm();
  absl::Status valid = ValidateLayerConfig(c);
  if (!valid.ok()) return valid;
  return c;
}

v1::LayerConfig LayerConfigToProto(const LayerConfig& c) {
  v1::LayerConfig p;
  p.set_num_experts(c.num_experts);
  p.set_top_k(c.top_k);
  p.set_d_model(c.d_model);
  p.set_d_hidden(c.d_hidden);
  switch (c.activation) {
    case Activation::kSwiGLU:
      p.set_activation(v1::ACTIVATION_SWIGLU);
      break;
    case Activation::kSiLU:
      p.set_activation(v1::ACTIVATION_SILU);
      break;
    case Activation::kGeLUTanh:
      p.set_activation(v1::ACTIVATION_GELU_TANH);
      break;
    case Activation::kReLU:
      p.set_activation(v1::ACTIVATION_RELU);
      break;
  }
  p.set_dtype(DTypeToProto(c.dtype));
  p.set_routing(c.routing == RoutingMode::kServer ? v1::ROUTING_SERVER : v1::ROUTING_CLIENT);
  p.set_expert_first(c.expert_first);
  p.set_expert_count(c.local_experts());
  p.set_seed(c.seed);
  p.set_init_scale(c.init_scale);
  p.set_no_renormalize(!c.renormalize);
  p.set_aux_loss_coef(c.aux_loss_coef);
  p.set_z_loss_coef(c.z_loss_coef);
  p.set_recompute_h(c.recompute_h);
  v1::OptimizerConfig* o = p.mutable_optimizer();
  o->set_kind(c.optimizer.kind == OptimizerKind::kSgd ? v1::OPTIMIZER_SGD : v1::OPTIMIZER_ADAMW);
  o->set_learning_rate(c.optimizer.learning_rate);
  o->set_beta1(c.optimizer.beta1);
  o->set_beta2(c.optimizer.beta2);
  o->set_epsilon(c.optimizer.epsilon);
  o->set_weight_decay(c.optimizer.weight_decay);
  o->set_momentum(c.optimizer.momentum);
  o->set_max_grad_norm(c.optimizer.max_grad_norm);
  return p;
}

void SetTensorHeader(DType dtype, const std::vector<int64_t>& shape, v1::Tensor* proto) {
  proto->set_dtype(DTypeToProto(dtype));
  proto->clear_shape();
  for (int64_t s : shape) proto->add_shape(s);
}

absl::Status TensorAssembler::Add(const v1::Tensor& chunk) {
  const absl::string_view data = chunk.data();
  return Add(chunk, absl::MakeConstSpan(&data, 1));
}

absl::Status TensorAssembler::Add(const v1::Tensor& chunk,
                                  absl::Span<const absl::string_view> pieces) {
  // A refused chunk changes nothing: the first accepted chunk fixes dtype and shape.
  int64_t expected = expected_;
  if (!seen_) {
    absl::StatusOr<DType> dtype = DTypeFromProto(chunk.dtype(), field_);
    if (!dtype.ok()) return dtype.status();
    absl::StatusOr<int64_t> bytes = CheckedByteSize(chunk.shape(), *dtype, field_);
    if (!bytes.ok()) return bytes.status();
    expected = *bytes;
  } else if (chunk.dtype() != dtype_ || !std::equal(shape_.begin(), shape_.end(),
                                                    chunk.shape().begin(), chunk.shape().end())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_, ": dtype or shape changed between chunks of one micro-batch"));
  }
  if (chunk.offset() != static_cast<int64_t>(bytes_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_, ": chunk at byte offset ", chunk.offset(), ", but ", bytes_.size(),
                     " bytes of it had arrived (chunks out of order, repeated or lost)"));
  }
  size_t n = 0;
  for (absl::string_view p : pieces) n += p.size();
  if (n > static_cast<size_t>(expected) - bytes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ": ", bytes_.size() + n, " bytes, more than its shape holds (", expected, ")"));
  }
  if (!seen_) {
    seen_ = true;
    dtype_ = chunk.dtype();
    shape_.assign(chunk.shape().begin(), chunk.shape().end());
    expected_ = expected;
    // Past 4 GiB the buffer grows as bytes come (a shape that large is more likely a peer's
    // bug than a tensor to send in one call).
    constexpr int64_t kMaxReserve = int64_t{4} << 30;
    if (sizing_ != Sizing::kGrow && expected_ <= kMaxReserve) {
      claimed_ = static_cast<size_t>(expected_);
    }
  }
  const size_t arrived = bytes_.size() + n;
  if (claimed_ > 0 && (sizing_ == Sizing::kClaimedAtOnce || arrived >= claimed_ / 8)) {
    bytes_.reserve(claimed_);
    claimed_ = 0;
  }
  for (absl::string_view p : pieces) {
    const auto* data = reinterpret_cast<const std::byte*>(p.data());
    bytes_.insert(bytes_.end(), data, data + p.size());
  }
  return absl::OkStatus();
}

absl::Status TensorAssembler::CheckComplete(DType* dtype) {
  if (!seen_) return absl::InvalidArgumentError(absl::StrCat(field_, ": missing"));
  auto d = DTypeFromProto(dtype_, field_);
  if (!d.ok()) return d.status();
  *dtype = *d;
  absl::StatusOr<int64_t> want = CheckedByteSize(shape_, *dtype, field_);
  if (!want.ok()) return want.status();
  if (bytes_.size() != static_cast<size_t>(*want)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ": ", bytes_.size(), " bytes do not match shape [", absl::StrJoin(shape_, ","),
        "] of ", DTypeName(*dtype), " (", *want, " bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> TensorAssembler::Finish() {
  DType dtype;
  absl::Status s = CheckComplete(&dtype);
  if (!s.ok()) return s;
  Tensor t;
  t.dtype = dtype;
  t.shape = shape_;
  t.bytes = std::move(bytes_);
  bytes_.clear();  // moved-from: make "no bytes collected" explicit
  return t;
}

absl::StatusOr<TensorView> TensorAssembler::FinishView() {
  DType dtype;
  absl::Status s = CheckComplete(&dtype);
  if (!s.ok()) return s;
  return TensorView{dtype, shape_, bytes_.data(), bytes_.size()};
}

void TensorAssembler::Reset() {
  seen_ = false;
  expected_ = -1;
  claimed_ = 0;
  dtype_ = 0;
  shape_.clear();
  bytes_.clear();
}

int64_t TiledRows(std::vector<std::pair<int64_t, int64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  int64_t next = 0;
  for (const auto& [begin, rows] : ranges) {
    if (begin != next) break;
    next += rows;
  }
  return next;
}

absl::Status StripedAssembler::Add(uint32_t stream, int64_t row_begin, const v1::Tensor& chunk,
                                   absl::Span<const absl::string_view> pieces) {
  const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  if (shape.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_, ": a striped micro-batch's tensors need a row (first) dimension"));
  }
  // Every chunk's extents (later streams' rows included), before any is used in a product.
  MOE_RETURN_IF_ERROR(CheckedNumElements(shape, field_).status());
  size_t n = 0;
  for (absl::string_view p : pieces) n += p.size();
  std::byte* dst = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A refused chunk changes nothing: the first accepted chunk fixes dtype and extents.
    DType dtype = dtype_;
    size_t row_bytes = row_bytes_;
    if (!seen_) {
      absl::StatusOr<DType> d = DTypeFromProto(chunk.dtype(), field_);
      if (!d.ok()) return d.status();
      // One row, this stream's rows and the whole tensor, each within CheckedByteSize's bounds.
      std::vector<int64_t> whole = shape;
      whole[0] = 1;
      absl::StatusOr<int64_t> row = CheckedByteSize(whole, *d, field_);
      if (!row.ok()) return row.status();
      MOE_RETURN_IF_ERROR(CheckedByteSize(shape, *d, field_).status());
      whole[0] = total_rows_;
      absl::StatusOr<int64_t> all = CheckedByteSize(whole, *d, field_);
      if (!all.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("stripe.total_rows: ", all.status().message()));
      }
      dtype = *d;
      row_bytes = static_cast<size_t>(*row);
    } else if (chunk.dtype() != DTypeToProto(dtype_) || shape.size() != shape_.size() ||
               !std::equal(shape.begin() + 1, shape.end(), shape_.begin() + 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_,
                       ": every stream of a striped micro-batch must send the same dtype and "
                       "extents past the first"));
    }
    auto it = streams_.find(stream);
    const bool fresh = it == streams_.end();
    Stream candidate{row_begin, shape[0], 0, {}};
    if (fresh) {
      // A stream's first chunk: its rows must lie in [0, total_rows) and overlap no other's
      // (row_begin checked first, so total_rows_ - row_begin cannot overflow).
      bool bad = row_begin < 0 || shape[0] > total_rows_ - row_begin;
      for (const auto& [other, o] : streams_) {
        if (!bad && row_begin < o.row_begin + o.rows && o.row_begin < row_begin + shape[0]) {
          bad = true;
        }
      }
      if (bad) {
        return absl::InvalidArgumentError(absl::StrCat(
            "stripe.row_begin: ", field_, " rows [", row_begin, ", +", shape[0], ") of stream ",
            stream, " leave [0, ", total_rows_, ") or overlap another stream's"));
      }
      if (chunk.offset() != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field_, ": stream ", stream, "'s first chunk at byte offset ",
                         chunk.offset(), ", not 0 (chunks out of order, repeated or lost)"));
      }
    } else if (row_begin != it->second.row_begin || shape[0] != it->second.rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_, ": dtype or shape changed between chunks of one micro-batch"));
    }
    const Stream& current = fresh ? candidate : it->second;
    if (chunk.offset() != static_cast<int64_t>(current.received)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_, ": stream ", stream, " sent a chunk at byte offset ", chunk.offset(),
                       ", but ", current.received,
                       " bytes of its rows had arrived (chunks out of order, repeated or lost)"));
    }
    const size_t capacity = static_cast<size_t>(current.rows) * row_bytes;
    if (n > capacity - current.received) {
      return absl::InvalidArgumentError(absl::StrCat(field_, ": stream ", stream,
                                                     " sent more bytes than its ", current.rows,
                                                     " rows hold (", capacity, ")"));
    }
    if (!seen_) {
      seen_ = true;
      dtype_ = dtype;
      shape_ = shape;
      row_bytes_ = row_bytes;
    }
    if (fresh) it = streams_.emplace(stream, std::move(candidate)).first;
    Stream& s = it->second;
    const size_t whole = static_cast<size_t>(total_rows_) * row_bytes_;
    if (!allocated_ && (sizing_ == Sizing::kClaimedAtOnce || arrived_ + n >= whole / 8)) {
      AllocateLocked();
    }
    if (allocated_) {
      dst = whole_.data() + static_cast<size_t>(s.row_begin) * row_bytes_ + s.received;
    } else {
      for (absl::string_view p : pieces) {
        const auto* data = reinterpret_cast<const std::byte*>(p.data());
        s.pending.insert(s.pending.end(), data, data + p.size());
      }
    }
    s.received += n;
    arrived_ += n;
  }
  // Outside the lock: the streams' rows are disjoint and the buffer never moves once allocated.
  for (absl::string_view p : pieces) {
    if (dst == nullptr) break;
    if (p.empty()) continue;
    std::memcpy(dst, p.data(), p.size());
    dst += p.size();
  }
  return absl::OkStatus();
}

void StripedAssembler::AllocateLocked() {
  whole_.resize(static_cast<size_t>(total_rows_) * row_bytes_);
  for (auto& [id, s] : streams_) {
    if (s.pending.empty()) continue;  // memcpy's pointers must be valid even for 0 bytes
    std::memcpy(whole_.data() + static_cast<size_t>(s.row_begin) * row_bytes_, s.pending.data(),
                s.pending.size());
    TensorBytes().swap(s.pending);
  }
  allocated_ = true;
}

bool StripedAssembler::seen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_;
}

absl::StatusOr<Tensor> StripedAssembler::Finish(uint32_t streams) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!seen_) return absl::InvalidArgumentError(absl::StrCat(field_, ": missing"));
  if (streams_.size() != streams) {
    return absl::InvalidArgumentError(absl::StrCat(field_, ": carried by ", streams_.size(),
                                                   " of the ", streams,
                                                   " streams of a striped micro-batch"));
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& [id, s] : streams_) {
    if (s.received != static_cast<size_t>(s.rows) * row_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(field_, ": stream ", id, " sent ", s.received,
                                                     " bytes for its ", s.rows, " rows (",
                                                     s.rows * row_bytes_, ")"));
    }
    ranges.emplace_back(s.row_begin, s.rows);
  }
  if (TiledRows(std::move(ranges)) != total_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("stripe.row_begin: the streams' rows of ",
                                                   field_, " do not cover [0, ", total_rows_, ")"));
  }
  if (!allocated_) AllocateLocked();
  Tensor t;
  t.dtype = dtype_;
  t.shape = shape_;
  t.shape[0] = total_rows_;
  t.bytes = std::move(whole_);
  whole_.clear();
  streams_.clear();
  allocated_ = false;
  return t;
}

ChunkPlan::ChunkPlan(std::vector<size_t> sizes, size_t max_chunk_bytes)
    : sizes_(std::move(sizes)), chunk_(std::max<size_t>(max_chunk_bytes, 1)) {
  size_t total = 0;
  for (size_t s : sizes_) {
    starts_.push_back(total);
    total += s;
  }
  messages_ = std::max<size_t>(1, total / chunk_ + (total % chunk_ != 0));
}

std::vector<Piece> ChunkPlan::Pieces(size_t m) const {
  std::vector<Piece> pieces;
  const size_t begin = m * chunk_;
  for (size_t i = 0; i < sizes_.size(); ++i) {
    // The overlap of [begin, begin + chunk_) with tensor i's [starts_[i], + sizes_[i]).
    const size_t from = std::max(begin, starts_[i]);
    const size_t to = std::min(begin + chunk_, starts_[i] + sizes_[i]);
    if (from < to) pieces.push_back({static_cast<int>(i), from - starts_[i], to - from});
  }
  return pieces;
}

size_t ChunkPlan::Offset(int tensor, size_t m) const {
  const size_t i = static_cast<size_t>(tensor);
  const size_t begin = m * chunk_;
  if (begin <= starts_[i]) return 0;
  return std::min(begin - starts_[i], sizes_[i]);
}

std::vector<std::vector<Piece>> PlanChunks(const std::vector<size_t>& sizes,
                                           size_t max_chunk_bytes) {
  const ChunkPlan plan(sizes, max_chunk_bytes);
  std::vector<std::vector<Piece>> messages;
  for (size_t m = 0; m < plan.size(); ++m) messages.push_back(plan.Pieces(m));
  return messages;
}

}  // namespace moe::wire
