// The shared Forward/Backward stream reactor (see micro_batch_reactor.h), compiled once for both
// methods. Sections: the stream's reactions, reading a micro-batch, admission, references,
// striping, running and answering.
#include "server/micro_batch_reactor.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "common/status_macros.h"
#include "server/request_validation.h"
#include "server/status_map.h"

namespace moe::server {

template <typename Req, typename Resp>
MicroBatchReactor<Req, Resp>::MicroBatchReactor(ExpertServiceImpl* service,
                                                grpc::CallbackServerContext* ctx,
                                                const char* method, std::vector<Input> inputs,
                                                std::vector<int> output_fields)
    : service_(service),
      ctx_(ctx),
      method_(method),
      session_(SessionOf(ctx)),
      caller_(service->Authenticate(ctx)),
      inputs_(std::move(inputs)),
      output_fields_(std::move(output_fields)),
      charge_(service->ledger().NewRequestCharge()) {
  for (const Input& in : inputs_) {
    input_fields_.push_back(in.field);
    assemblers_.emplace_back(in.name, in.sizing);
  }
  stream_carries_.assign(inputs_.size(), false);
  held_.assign(inputs_.size(), HeldBytes{});
  service_->metrics().StreamOpened(method_);
}

// --- The stream's reactions -----------------------------------------------------------------

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::Start() {
  if (!caller_.ok()) {
    Fail(caller_.status());
    return;
  }
  this->StartRead(&buffer_);
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::OnReadDone(bool ok) {
  // The inputs assembled here are the engine's to copy to the device: page-locked where the
  // engine provides that memory (common/host_memory.h).
  LargeTensorMemoryScope data_path;
  if (!ok) {
    // The client half-closed (clean end) or the call is cancelled/broken.
    if (ctx_->IsCancelled()) {
      Fail(Cancelled());
    } else if (in_batch_) {
      Fail(absl::InvalidArgumentError(
          "last_chunk: the stream ended in the middle of a micro-batch"));
    } else {
      this->Finish(grpc::Status::OK);
    }
    return;
  }
  const bool first = !in_batch_;
  if (first) {
    in_batch_ = true;
    receive_start_ = Clock::now();
  }
  absl::Status st =
      incoming_.Decode(&buffer_, input_fields_, &request_, Req::descriptor()->full_name());
  service_->metrics().BytesIn(method_, static_cast<int64_t>(incoming_.wire_bytes()));
  service_->metrics().TransportBytes("in", "tcp", static_cast<int64_t>(incoming_.wire_bytes()));
  // References first: a referencing micro-batch that is chunked or striped is refused before it
  // joins anything, and the header's reservations know which inputs come by reference.
  if (st.ok()) st = ReadMessageReferences(first);
  if (st.ok()) st = first ? BeginBatch() : CheckSameBatch();
  if (st.ok()) st = ChargeInputs();
  if (st.ok()) st = AddInputs();
  if (!st.ok()) {
    Fail(st);
    return;
  }
  if (!request_.last_chunk()) {
    this->StartRead(&buffer_);
    return;
  }
  service_->metrics().Stage(method_, "receive", SecondsSince(receive_start_));
  st = FinishInputs();
  if (!st.ok()) {
    Fail(st);
    return;
  }
  if (join_ == nullptr) {
    RunAlone();
  } else {
    ArriveStriped();
  }
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::OnWriteDone(bool ok) {
  if (!ok) {
    Fail(absl::CancelledError("the client went away while the response was being sent"));
    return;
  }
  service_->metrics().BytesOut(method_, static_cast<int64_t>(message_.Length()));
  service_->metrics().TransportBytes("out", "tcp", static_cast<int64_t>(message_.Length()));
  if (++next_ < response_.size()) {
    message_ = response_.Build(next_);
    this->StartWrite(&message_);
    return;
  }
  service_->metrics().Stage(method_, "send", SecondsSince(send_start_));
  service_->metrics().Request(method_, "OK");
  service_->metrics().TransportCall(method_, transport_);
  if (referenced_in_bytes_ > 0) {
    service_->metrics().TransportBytes("in", transport_, referenced_in_bytes_);
  }
  if (referenced_out_bytes_ > 0) {
    service_->metrics().TransportBytes("out", transport_, referenced_out_bytes_);
  }
  response_ = ChunkedResponse<Resp>();
  message_.Clear();
  in_batch_ = false;
  LeaveJoin();
  ResetInputs();
  this->StartRead(&buffer_);
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::OnCancel() {
  std::shared_ptr<StripeJoin> join;
  {
    std::lock_guard<std::mutex> lock(join_mu_);
    join = join_;
  }
  if (join) join->Fail(Cancelled());
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::OnDone() {
  service_->metrics().StreamClosed(method_);
  delete this;
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::AbortStripe(const absl::Status& status) {
  Fail(status);
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::Fail(const absl::Status& status) {
  // Failed before this stream counts itself out, so that the join outlives it for the siblings
  // still to come (StripeJoins::Leave).
  std::shared_ptr<StripeJoin> join;
  {
    std::lock_guard<std::mutex> lock(join_mu_);
    join = join_;
  }
  if (join) join->Fail(status);
  LeaveJoin();
  service_->metrics().Request(method_, GrpcCodeName(ToGrpcStatus(status).error_code()));
  this->Finish(ToGrpcStatus(status));
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::Cancelled() {
  std::lock_guard<std::mutex> lock(join_mu_);
  if (stripe_.count() == 0) return absl::CancelledError("stream cancelled");
  return absl::CancelledError(absl::StrCat("stripe ", stripe_.index(), " of ", stripe_.count(),
                                           ": the call was cancelled"));
}

// --- Reading a micro-batch ------------------------------------------------------------------

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::ReadMessageReferences(bool first) {
  MOE_ASSIGN_OR_RETURN(wire::MessageReferences refs,
                       wire::ReadReferences(request_, incoming_, first));
  if (first) refs_ = std::move(refs);
  return absl::OkStatus();
}

template <typename Req, typename Resp>
const wire::ResolvedTensor* MicroBatchReactor<Req, Resp>::InputRef(size_t i) const {
  return i < refs_.tensors.size() && refs_.tensors[i] ? &*refs_.tensors[i] : nullptr;
}

template <typename Req, typename Resp>
const v1::TensorRef* MicroBatchReactor<Req, Resp>::DestinationRef(size_t j) const {
  return j < refs_.destinations.size() && refs_.destinations[j] ? &*refs_.destinations[j]
                                                                : nullptr;
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::BeginBatch() {
  rows_ = 0;
  layer_ = request_.layer();
  context_id_ = request_.context_id();
  chunk_ = ResponseChunkBytes(request_.max_response_chunk_bytes());
  {
    std::lock_guard<std::mutex> lock(join_mu_);
    stripe_ = request_.stripe();
  }
  MOE_RETURN_IF_ERROR(AdmitBatch());
  MOE_RETURN_IF_ERROR(ReadHeader(request_));
  if (!striped()) return absl::OkStatus();
  if (context_id_ == 0) return ValidateStripe(stripe_, context_id_);
  // Principals never join each other's micro-batches: the principal qualifies the session.
  const std::string key = StripeJoins::Key(
      method_, layer_, absl::StrCat(caller().principal.size(), ":", caller().principal, session_),
      context_id_);
  std::shared_ptr<StripeJoin> join = service_->stripes().Enter(key, stripe_.index());
  {
    std::lock_guard<std::mutex> lock(join_mu_);
    join_ = join;
    join_key_ = key;
  }
  // Checked once in the join, so that a bad stripe fails the streams already waiting in it.
  MOE_RETURN_IF_ERROR(ValidateStripe(stripe_, context_id_));
  auto [names, values] = StripeHeader();
  MOE_RETURN_IF_ERROR(
      join->Register(stripe_.index(), {stripe_.count(), stripe_.total_rows(), names, values}));
  const int64_t total_rows = stripe_.total_rows();
  shared_inputs_ = std::static_pointer_cast<std::deque<wire::StripedAssembler>>(
      join->Shared([this, total_rows]() -> std::shared_ptr<void> {
        auto inputs = std::make_shared<std::deque<wire::StripedAssembler>>();
        for (const Input& in : inputs_) inputs->emplace_back(in.name, in.sizing, total_rows);
        return inputs;
      }));
  return absl::OkStatus();
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::CheckSameBatch() const {
  if (request_.layer() != layer_ || request_.context_id() != context_id_) {
    return absl::InvalidArgumentError(
        "layer and context_id must be the same in every chunk of a micro-batch");
  }
  const v1::Stripe& s = request_.stripe();
  if (s.index() != stripe_.index() || s.count() != stripe_.count() ||
      s.row_begin() != stripe_.row_begin() || s.total_rows() != stripe_.total_rows()) {
    return absl::InvalidArgumentError("stripe: must be the same in every chunk of a micro-batch");
  }
  return CheckSame(request_);
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::AddInputs() {
  for (size_t i = 0; i < assemblers_.size(); ++i) {
    const v1::Tensor* t = InputOf(request_, i);
    if (t == nullptr || InputRef(i) != nullptr) continue;
    const auto payload = incoming_.payload(input_fields_[i]);
    MOE_RETURN_IF_ERROR(
        shared_inputs_ ? (*shared_inputs_)[i].Add(stripe_.index(), stripe_.row_begin(), *t, payload)
                       : assemblers_[i].Add(*t, payload));
    if (i == 0 && t->shape_size() > 0) rows_ = t->shape(0);
    stream_carries_[i] = true;
  }
  return absl::OkStatus();
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::FinishInputs() {
  if (shared_inputs_) {  // the whole tensors are finished once every stream has arrived
    if (!stream_carries_[0]) {
      return absl::InvalidArgumentError(absl::StrCat(inputs_[0].name, ": missing"));
    }
    return absl::OkStatus();
  }
  views_.assign(assemblers_.size(), TensorView{});
  for (size_t i = 0; i < assemblers_.size(); ++i) {
    if (InputRef(i) != nullptr || (!inputs_[i].required && !assemblers_[i].seen())) continue;
    MOE_ASSIGN_OR_RETURN(views_[i], assemblers_[i].FinishView());
  }
  return absl::OkStatus();
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::ResetInputs() {
  views_.clear();
  for (wire::TensorAssembler& a : assemblers_) a.Reset();
  shared_inputs_.reset();
  stream_carries_.assign(inputs_.size(), false);
  held_.assign(inputs_.size(), HeldBytes{});
  charge_.Reset();
  refs_ = wire::MessageReferences();
  transport_ = "tcp";
  referenced_in_bytes_ = 0;
  referenced_out_bytes_ = 0;
}

// --- Admission ------------------------------------------------------------------------------

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::AdmitBatch() {
  if (auto entry = service_->FindLayer(layer_); entry.ok()) {
    MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(caller(), **entry, Access::kTrain, "layer"));
  }
  absl::Status st = service_->contexts().CheckSession(session_, caller().principal);
  if (st.code() == absl::StatusCode::kPermissionDenied) return st;
  return absl::OkStatus();
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::ChargeInputs() {
  int64_t total = 0;
  const char* grown = inputs_[0].name;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const v1::Tensor* t = InputOf(request_, i);
    // A tensor by reference is the client's memory, not the server's.
    if (t != nullptr && InputRef(i) == nullptr &&
        held_[i].Add(*t, incoming_.payload(input_fields_[i])) > 0) {
      grown = inputs_[i].name;
    }
    total = SaturatingAdd(total, held_[i].held());
  }
  return charge_.Set(total, grown);
}

template <typename Req, typename Resp>
absl::Status MicroBatchReactor<Req, Resp>::ReserveInput(size_t i, int64_t bytes) {
  held_[i].claimed = std::max(held_[i].claimed, bytes);
  int64_t total = 0;
  for (const HeldBytes& h : held_) total = SaturatingAdd(total, h.held());
  MOE_RETURN_IF_ERROR(charge_.Set(total, inputs_[i].name));
  assemblers_[i].Reserve(static_cast<size_t>(bytes));
  return absl::OkStatus();
}

// --- References -----------------------------------------------------------------------------

template <typename Req, typename Resp>
absl::StatusOr<typename MicroBatchReactor<Req, Resp>::Bound> MicroBatchReactor<Req, Resp>::Bind(
    const std::vector<TensorView>& inputs,
    const std::vector<std::optional<wire::ResolvedTensor>>& destinations) {
  Bound bound;
  bound.inputs = inputs;
  bound.destinations.assign(destinations.size(), MutableTensorView{});
  if (!refs_.any()) return bound;
  std::vector<wire::ResolvedTensor> in_refs, out_refs;
  std::vector<size_t> in_at, out_at;
  for (size_t i = 0; i < refs_.tensors.size() && i < bound.inputs.size(); ++i) {
    if (!refs_.tensors[i]) continue;
    in_refs.push_back(*refs_.tensors[i]);
    in_at.push_back(i);
  }
  for (size_t j = 0; j < destinations.size(); ++j) {
    if (!destinations[j]) continue;
    out_refs.push_back(*destinations[j]);
    out_at.push_back(j);
  }
  MOE_ASSIGN_OR_RETURN(bound.call,
                       service_->regions().ResolveCall({caller().principal, session_}, in_refs,
                                                       out_refs, refs_.event_id));
  bool cuda = false;
  int64_t in_bytes = 0, out_bytes = 0, copied = 0;
  for (size_t k = 0; k < in_at.size(); ++k) {
    const RegionRegistry::View& v = bound.call.inputs[k];
    cuda = cuda || !v.location.is_host();
    in_bytes += v.size_bytes;
    TensorView view{v.dtype, v.shape, v.data, static_cast<size_t>(v.size_bytes),
                    v.location};
    if (inputs_[in_at[k]].indexes && view.location.is_host()) {
      // Charged as the request's own bytes, since it is the server's memory now.
      copied = SaturatingAdd(copied, v.size_bytes);
      int64_t held = 0;
      for (const HeldBytes& h : held_) held = SaturatingAdd(held, h.held());
      MOE_RETURN_IF_ERROR(charge_.Set(SaturatingAdd(held, copied), inputs_[in_at[k]].name));
      Tensor copy = Tensor::Uninitialized(v.dtype, v.shape);
      std::memcpy(copy.bytes.data(), v.data, static_cast<size_t>(v.size_bytes));
      view = copy.view();  // its bytes stay where they are when the Tensor moves
      bound.copies.push_back(std::move(copy));
    }
    bound.inputs[in_at[k]] = std::move(view);
  }
  for (size_t k = 0; k < out_at.size(); ++k) {
    const RegionRegistry::View& v = bound.call.outputs[k];
    cuda = cuda || !v.location.is_host();
    out_bytes += v.size_bytes;
    bound.destinations[out_at[k]] = MutableTensorView{
        v.dtype, v.shape, v.data, static_cast<size_t>(v.size_bytes), v.location};
  }
  bound.order.wait_event = bound.call.events.wait_event();
  bound.order.done_event = bound.call.events.done_event();
  transport_ = cuda ? "cuda_ipc" : "shared_memory";
  referenced_in_bytes_ = in_bytes;
  referenced_out_bytes_ = out_bytes;
  return bound;
}

template <typename Req, typename Resp>
std::vector<std::optional<v1::Tensor>> MicroBatchReactor<Req, Resp>::WrittenInPlace(
    const Bound& bound) const {
  std::vector<std::optional<v1::Tensor>> out(bound.destinations.size());
  for (size_t j = 0; j < out.size(); ++j) {
    const MutableTensorView& d = bound.destinations[j];
    const v1::TensorRef* ref = DestinationRef(j);
    if (d.empty() || ref == nullptr) continue;
    v1::Tensor t;
    wire::SetTensorRef(d.dtype, d.shape, ref->region_id(), ref->offset(), &t);
    out[j] = std::move(t);
  }
  return out;
}

// --- Striping -------------------------------------------------------------------------------

template <typename Req, typename Resp>
std::shared_ptr<StripeJoin> MicroBatchReactor<Req, Resp>::LeaveJoin() {
  std::shared_ptr<StripeJoin> join;
  std::string key;
  {
    std::lock_guard<std::mutex> lock(join_mu_);
    join = std::move(join_);
    join_ = nullptr;
    key = std::move(join_key_);
    stripe_.Clear();
  }
  if (join) service_->stripes().Leave(key, join);
  return join;
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::ArriveStriped() {
  row_begin_ = stripe_.row_begin();
  absl::StatusOr<std::vector<StripeJoin::Part*>> arrived =
      join_->Arrive(stripe_.index(), row_begin_, rows_, this);
  if (!arrived.ok()) {
    Fail(arrived.status());
    return;
  }
  if (arrived->empty()) return;  // the last stream to arrive runs it, or the join aborts this
  // Every stream is here and waits: this reaction owns them until it answers each.
  std::vector<Self*> streams;
  for (StripeJoin::Part* p : *arrived) streams.push_back(static_cast<Self*>(p));
  absl::StatusOr<std::vector<Tensor>> inputs = FinishShared(stripe_.count());
  if (!inputs.ok()) {
    for (Self* s : streams) s->Fail(inputs.status());
    return;
  }
  // The streams' charges stay with the whole inputs until the micro-batch has run.
  auto charges = std::make_shared<std::vector<MemoryLedger::RequestCharge>>();
  for (Self* s : streams) {
    charges->push_back(std::move(s->charge_));
    s->ResetInputs();
  }
  auto shared = std::make_shared<const std::vector<Tensor>>(std::move(*inputs));
  ExpertServiceImpl* service = service_;
  const std::string method = method_;
  service_->executor().Submit([this, service, method, streams, shared, charges](double queued) {
    service->metrics().Stage(method, "queue", queued);
    service->metrics().StripedMicroBatch(method);
    std::vector<grpc::CallbackServerContext*> calls;
    absl::Status alive;
    for (Self* s : streams) {
      calls.push_back(s->ctx_);
      if (alive.ok()) alive = CallAlive(s->ctx_);
    }
    absl::StatusOr<Computed<Resp>> computed = absl::UnknownError("not run");
    if (alive.ok()) {
      std::vector<TensorView> views;
      for (const Tensor& t : *shared) views.push_back(t.empty() ? TensorView{} : t.view());
      const Clock::time_point t0 = Clock::now();
      // `this` is one of `streams`, all still open.
      computed = GuardAllocation(method, [&] { return Compute(views, calls); });
      service->metrics().Stage(method, "compute", SecondsSince(t0));
    } else {
      computed = alive;
    }
    // Each stream may finish and go away as soon as it is answered: only `streams` is used.
    for (Self* s : streams) {
      if (computed.ok()) {
        s->Send(*computed);
      } else {
        s->Fail(computed.status());
      }
    }
  });
}

template <typename Req, typename Resp>
absl::StatusOr<std::vector<Tensor>> MicroBatchReactor<Req, Resp>::FinishShared(uint32_t streams) {
  std::vector<Tensor> out(inputs_.size());
  for (size_t i = 0; i < inputs_.size(); ++i) {
    wire::StripedAssembler& a = (*shared_inputs_)[i];
    if (!a.seen()) continue;  // optional and absent (input 0 every stream checked)
    MOE_ASSIGN_OR_RETURN(out[i], a.Finish(streams));
  }
  return out;
}

// --- Running and answering ------------------------------------------------------------------

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::RunAlone() {
  service_->executor().Submit([this](double queued) {
    absl::StatusOr<Computed<Resp>> computed = TimedWork(
        service_->metrics(), method_, queued, ctx_,
        [this] { return GuardAllocation(method_, [this] { return Compute(views_, {ctx_}); }); });
    if (!computed.ok()) {
      Fail(computed.status());
      return;
    }
    Send(*computed);
  });
}

template <typename Req, typename Resp>
void MicroBatchReactor<Req, Resp>::Send(const Computed<Resp>& computed) {
  const int64_t row_end = striped() ? row_begin_ + rows_ : -1;
  response_ = ChunkedResponse<Resp>(computed.tensors, striped() ? row_begin_ : 0, row_end,
                                    output_fields_, chunk_, computed.header);
  send_start_ = Clock::now();
  next_ = 0;
  message_ = response_.Build(0);
  this->StartWrite(&message_);
}

template class MicroBatchReactor<v1::ForwardRequest, v1::ForwardResponse>;
template class MicroBatchReactor<v1::BackwardRequest, v1::BackwardResponse>;

}  // namespace moe::server
