// ExpertService handlers and reactors (see service.h for the threading rules).
//
// Forward and Backward share one reactor template: read chunks until `last_chunk`, hand the
// assembled micro-batch to the executor, write the response chunks, then read the next
// micro-batch. Exactly one operation is outstanding at a time, so the reactor needs no lock; a
// failure finishes the stream with that micro-batch's status.
#include "server/service.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/host_memory.h"
#include "common/status_macros.h"
#include "wire/raw_message.h"
#include "wire/wire.h"
#include "server/auth.h"
#include "server/checkpoint.h"
#include "server/held_bytes.h"
#include "server/request_validation.h"
#include "server/status_map.h"
#include "server/stripe_join.h"

namespace moe::server {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Cancelled / DeadlineExceeded when the call is already over, OK otherwise.
absl::Status CallAlive(grpc::CallbackServerContext* ctx) {
  if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  if (ctx->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline passed before the work started");
  }
  return absl::OkStatus();
}

// At most this many principals in a layer's shared_with: the list is kept per layer and
// searched on every call.
constexpr int kMaxSharedWith = 64;

absl::StatusOr<std::set<std::string>> SharedWith(
    const google::protobuf::RepeatedPtrField<std::string>& list) {
  if (list.size() > kMaxSharedWith) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_with: at most ", kMaxSharedWith, " principals, got ", list.size()));
  }
  std::set<std::string> out;
  for (int i = 0; i < list.size(); ++i) {
    absl::Status st = ValidatePrincipal(list[i], absl::StrCat("shared_with[", i, "]"));
    if (!st.ok()) return st;
    out.insert(list[i]);
  }
  return out;
}

std::string SessionOf(grpc::CallbackServerContext* ctx) {
  auto it = ctx->client_metadata().find(kSessionMetadataKey);
  if (it == ctx->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
}

// A micro-batch's response (wire/raw_message.h): the result tensors, kept until the last message
// that refers to them is sent, cut into messages of at most the requested payload bytes. Message m
// is encoded only when it is about to be written (the first on the executor, the others in
// OnWriteDone), so the device executor hands the tensors over and takes the next micro-batch at
// once; and the encoding refers to the tensors' bytes instead of copying them into protobuf's
// strings and again into gRPC's buffers (docs/decisions/0007-lazy-response-encoding.md).
template <typename Resp>
using ChunkedResponse = wire::ChunkedMessages<Resp>;

// --- Forward / Backward -------------------------------------------------------------------
// What a micro-batch computed: its result tensors (each [T, ...] or empty) and the response's
// small fields; shared by the streams of a striped micro-batch, each of which sends its rows.
template <typename Resp>
struct Computed {
  std::shared_ptr<const std::vector<Tensor>> tensors;
  typename ChunkedResponse<Resp>::Header header;
};

// Reads and writes raw buffers (the service registers Forward and Backward as raw methods):
// each request is split into its small fields, parsed as `Req`, and its tensors' bytes, which
// are copied once into the assembled inputs; responses are encoded by reference.
//
// A striped micro-batch (moe.proto `Stripe`, stripe_join.h) is one reactor per stream: each
// copies its rows straight into the micro-batch's inputs, which the streams share (assembled in
// place, wire::StripedAssembler), and the stream that arrives last runs the micro-batch on the
// executor once and hands each stream its rows of the result to send.
template <typename Req, typename Resp>
class MicroBatchReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                          public StripeJoin::Part {
 public:
  // An input tensor of Req: its field number and name, whether a micro-batch must carry it, and
  // how its buffer is sized.
  struct Input {
    int field;
    const char* name;
    bool required;
    wire::TensorAssembler::Sizing sizing;
  };

  MicroBatchReactor(ExpertServiceImpl* service, grpc::CallbackServerContext* ctx,
                    const char* method, std::vector<Input> inputs, std::vector<int> output_fields)
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

  // A caller that does not authenticate gets its status before any message is read.
  void Start() {
    if (!caller_.ok()) {
      Fail(caller_.status());
      return;
    }
    this->StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
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

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Fail(absl::CancelledError("the client went away while the response was being sent"));
      return;
    }
    service_->metrics().BytesOut(method_, static_cast<int64_t>(message_.Length()));
    if (++next_ < response_.size()) {
      message_ = response_.Build(next_);
      this->StartWrite(&message_);
      return;
    }
    service_->metrics().Stage(method_, "send", SecondsSince(send_start_));
    service_->metrics().Request(method_, "OK");
    response_ = ChunkedResponse<Resp>();
    message_.Clear();
    in_batch_ = false;
    LeaveJoin();
    ResetInputs();
    this->StartRead(&buffer_);
  }

  // A stream of a striped micro-batch cancelled while it waits for the others is answered by
  // the join (nothing else would wake it); the streams still reading see their reads fail.
  void OnCancel() override {
    std::shared_ptr<StripeJoin> join;
    {
      std::lock_guard<std::mutex> lock(join_mu_);
      join = join_;
    }
    if (join) join->Fail(Cancelled());
  }

  void OnDone() override {
    service_->metrics().StreamClosed(method_);
    delete this;
  }

  void AbortStripe(const absl::Status& status) override { Fail(status); }

 protected:
  // The first message of a micro-batch: the derived reactor's own small fields.
  virtual absl::Status ReadHeader(const Req& first) = 0;
  // A later message: those fields must not change.
  virtual absl::Status CheckSame(const Req& chunk) const = 0;
  // Input i's proto tensor in `chunk`, or nullptr when the message does not carry it.
  virtual const v1::Tensor* InputOf(const Req& chunk, size_t i) const = 0;
  // The fields every stream of a striped micro-batch must repeat: their names (for the error)
  // and values.
  virtual std::pair<std::string, std::string> StripeHeader() const = 0;
  // Runs the micro-batch on the executor: `inputs` in the order of the Inputs (empty views for
  // absent ones), `calls` every stream that carried it (one unless striped).
  virtual absl::StatusOr<Computed<Resp>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>& calls) = 0;

  bool striped() const { return stripe_.count() != 0; }
  // Room for `bytes` of input i before its first chunk, charged to the memory ledger first
  // (ResourceExhausted, nothing reserved, when it does not fit).
  absl::Status ReserveInput(size_t i, int64_t bytes) {
    held_[i].claimed = std::max(held_[i].claimed, bytes);
    int64_t total = 0;
    for (const HeldBytes& h : held_) total = SaturatingAdd(total, h.held());
    if (absl::Status st = charge_.Set(total, inputs_[i].name); !st.ok()) return st;
    assemblers_[i].Reserve(static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  wire::TensorAssembler& assembler(size_t i) { return assemblers_[i]; }
  const Caller& caller() const { return *caller_; }  // authenticated once Start() reads

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  const std::string method_;
  const std::string session_;
  const absl::StatusOr<Caller> caller_;
  std::string layer_;
  uint64_t context_id_ = 0;

 private:
  using Self = MicroBatchReactor<Req, Resp>;

  // Finishes the stream with `status`; a striped micro-batch still collecting fails with it on
  // every stream.
  void Fail(const absl::Status& status) {
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

  // This stream's call was cancelled; the message says which stripe, for the other streams.
  absl::Status Cancelled() {
    std::lock_guard<std::mutex> lock(join_mu_);
    if (stripe_.count() == 0) return absl::CancelledError("stream cancelled");
    return absl::CancelledError(absl::StrCat("stripe ", stripe_.index(), " of ", stripe_.count(),
                                             ": the call was cancelled"));
  }

  absl::Status BeginBatch() {
    rows_ = 0;
    layer_ = request_.layer();
    context_id_ = request_.context_id();
    chunk_ = ResponseChunkBytes(request_.max_response_chunk_bytes());
    {
      std::lock_guard<std::mutex> lock(join_mu_);
      stripe_ = request_.stripe();
    }
    // Refused at its first message, before a byte of its tensors is buffered; Compute checks
    // again, on the executor, against the layer it runs on.
    if (auto entry = service_->FindLayer(layer_); entry.ok()) {
      absl::Status allowed = service_->AuthorizeLayer(caller(), **entry, Access::kTrain, "layer");
      if (!allowed.ok()) return allowed;
    }
    // Another principal's session is refused at once (not-open is left to the work that needs
    // the session).
    absl::Status st = service_->contexts().CheckSession(session_, caller().principal);
    if (st.code() != absl::StatusCode::kPermissionDenied) st = absl::OkStatus();
    if (st.ok()) st = ReadHeader(request_);
    if (!st.ok() || !striped()) return st;
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
    if (st = ValidateStripe(stripe_, context_id_); !st.ok()) return st;
    auto [names, values] = StripeHeader();
    st = join->Register(stripe_.index(), {stripe_.count(), stripe_.total_rows(), names, values});
    if (!st.ok()) return st;
    const int64_t total_rows = stripe_.total_rows();
    shared_inputs_ = std::static_pointer_cast<std::deque<wire::StripedAssembler>>(
        join->Shared([this, total_rows]() -> std::shared_ptr<void> {
          auto inputs = std::make_shared<std::deque<wire::StripedAssembler>>();
          for (const Input& in : inputs_) inputs->emplace_back(in.name, in.sizing, total_rows);
          return inputs;
        }));
    return absl::OkStatus();
  }

  absl::Status CheckSameBatch() const {
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

  // Charges this message's tensors to the memory ledger before they are copied in (HeldBytes);
  // past the budget the micro-batch fails with ResourceExhausted and nothing of it is added.
  absl::Status ChargeInputs() {
    int64_t total = 0;
    const char* grown = inputs_[0].name;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const v1::Tensor* t = InputOf(request_, i);
      if (t != nullptr && held_[i].Add(*t, incoming_.payload(input_fields_[i])) > 0) {
        grown = inputs_[i].name;
      }
      total = SaturatingAdd(total, held_[i].held());
    }
    return charge_.Set(total, grown);
  }

  absl::Status AddInputs() {
    for (size_t i = 0; i < assemblers_.size(); ++i) {
      const v1::Tensor* t = InputOf(request_, i);
      if (t == nullptr) continue;
      const auto payload = incoming_.payload(input_fields_[i]);
      absl::Status st = shared_inputs_ ? (*shared_inputs_)[i].Add(stripe_.index(),
                                                                  stripe_.row_begin(), *t, payload)
                                       : assemblers_[i].Add(*t, payload);
      if (!st.ok()) return st;
      if (i == 0 && t->shape_size() > 0) rows_ = t->shape(0);
      stream_carries_[i] = true;
    }
    return absl::OkStatus();
  }

  absl::Status FinishInputs() {
    if (shared_inputs_) {  // the whole tensors are finished once every stream has arrived
      if (!stream_carries_[0]) {
        return absl::InvalidArgumentError(absl::StrCat(inputs_[0].name, ": missing"));
      }
      return absl::OkStatus();
    }
    views_.assign(assemblers_.size(), TensorView{});
    for (size_t i = 0; i < assemblers_.size(); ++i) {
      if (!inputs_[i].required && !assemblers_[i].seen()) continue;
      absl::StatusOr<TensorView> v = assemblers_[i].FinishView();
      if (!v.ok()) return v.status();
      views_[i] = *v;
    }
    return absl::OkStatus();
  }

  void ResetInputs() {
    views_.clear();
    for (wire::TensorAssembler& a : assemblers_) a.Reset();
    shared_inputs_.reset();
    stream_carries_.assign(inputs_.size(), false);
    held_.assign(inputs_.size(), HeldBytes{});
    charge_.Reset();
  }

  // Counts this stream out of its join; returns the join (null when not striped).
  std::shared_ptr<StripeJoin> LeaveJoin() {
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

  // Starts sending this stream's rows of `computed` (all of it unless striped).
  void Send(const Computed<Resp>& computed) {
    const int64_t row_end = striped() ? row_begin_ + rows_ : -1;
    response_ = ChunkedResponse<Resp>(computed.tensors, striped() ? row_begin_ : 0, row_end,
                                      output_fields_, chunk_, computed.header);
    send_start_ = Clock::now();
    next_ = 0;
    message_ = response_.Build(0);
    this->StartWrite(&message_);
  }

  void RunAlone() {
    service_->executor().Submit([this](double queued) {
      service_->metrics().Stage(method_, "queue", queued);
      absl::Status alive = CallAlive(ctx_);
      absl::StatusOr<Computed<Resp>> computed = absl::UnknownError("not run");
      if (alive.ok()) {
        const Clock::time_point t0 = Clock::now();
        computed = GuardAllocation(method_, [&] { return Compute(views_, {ctx_}); });
        service_->metrics().Stage(method_, "compute", SecondsSince(t0));
      } else {
        computed = alive;
      }
      if (!computed.ok()) {
        Fail(computed.status());
        return;
      }
      Send(*computed);
    });
  }

  void ArriveStriped() {
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

  // The striped micro-batch's whole inputs, once all `streams` streams have arrived.
  absl::StatusOr<std::vector<Tensor>> FinishShared(uint32_t streams) {
    std::vector<Tensor> out(inputs_.size());
    for (size_t i = 0; i < inputs_.size(); ++i) {
      wire::StripedAssembler& a = (*shared_inputs_)[i];
      if (!a.seen()) continue;  // optional and absent (input 0 every stream checked)
      absl::StatusOr<Tensor> t = a.Finish(streams);
      if (!t.ok()) return t.status();
      out[i] = std::move(*t);
    }
    return out;
  }

  const std::vector<Input> inputs_;
  std::vector<int> input_fields_;
  const std::vector<int> output_fields_;
  std::vector<wire::TensorAssembler> assemblers_;  // unless striped
  std::vector<TensorView> views_;  // the assembled inputs, from the last message to the compute
  grpc::ByteBuffer buffer_;        // the request being read
  wire::IncomingMessage incoming_;
  Req request_;  // its small fields
  int64_t chunk_ = kDefaultResponseChunkBytes;
  ChunkedResponse<Resp> response_;
  grpc::ByteBuffer message_;  // the message being written: response_'s message next_
  size_t next_ = 0;
  bool in_batch_ = false;
  Clock::time_point receive_start_;
  Clock::time_point send_start_;
  // Striping: this stream's rows, which inputs it carried, the inputs its micro-batch's streams
  // share, and its join (read by OnCancel on any thread).
  int64_t row_begin_ = 0;
  int64_t rows_ = 0;
  std::vector<bool> stream_carries_;
  // What the inputs of the micro-batch being read hold, and its charge to the memory ledger.
  std::vector<HeldBytes> held_;
  MemoryLedger::RequestCharge charge_;
  std::shared_ptr<std::deque<wire::StripedAssembler>> shared_inputs_;
  std::mutex join_mu_;
  v1::Stripe stripe_;
  std::shared_ptr<StripeJoin> join_;
  std::string join_key_;
};

class ForwardReactor final : public MicroBatchReactor<v1::ForwardRequest, v1::ForwardResponse> {
  using Sizing = wire::TensorAssembler::Sizing;

 public:
  // The client's claimed shapes are reserved only once an eighth of each tensor has arrived.
  ForwardReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx)
      : MicroBatchReactor(
            s, ctx, "Forward",
            {{v1::ForwardRequest::kXFieldNumber, "x", true, Sizing::kClaimedOnceAnEighthArrived},
             {v1::ForwardRequest::kExpertIdsFieldNumber, "expert_ids", false,
              Sizing::kClaimedOnceAnEighthArrived},
             {v1::ForwardRequest::kWeightsFieldNumber, "weights", false,
              Sizing::kClaimedOnceAnEighthArrived}},
            {v1::ForwardResponse::kOutFieldNumber, v1::ForwardResponse::kExpertIdsFieldNumber,
             v1::ForwardResponse::kWeightsFieldNumber}) {
    Start();
  }

 protected:
  absl::Status ReadHeader(const v1::ForwardRequest& first) override {
    training_ = first.training();
    return absl::OkStatus();
  }
  absl::Status CheckSame(const v1::ForwardRequest& c) const override {
    if (c.training() != training_) {
      return absl::InvalidArgumentError(
          "training: must be the same in every chunk of a micro-batch");
    }
    return absl::OkStatus();
  }
  const v1::Tensor* InputOf(const v1::ForwardRequest& c, size_t i) const override {
    switch (i) {
      case 0:
        return c.has_x() ? &c.x() : nullptr;
      case 1:
        return c.has_expert_ids() ? &c.expert_ids() : nullptr;
      default:
        return c.has_weights() ? &c.weights() : nullptr;
    }
  }
  std::pair<std::string, std::string> StripeHeader() const override {
    return {"training", training_ ? "true" : "false"};
  }

  absl::StatusOr<Computed<v1::ForwardResponse>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>& calls) override {
    auto entry = service_->FindLayer(layer_);
    if (!entry.ok()) return entry.status();
    if (absl::Status st = service_->AuthorizeLayer(caller(), **entry, Access::kTrain, "layer");
        !st.ok()) {
      return st;
    }
    if (training_) {
      if (absl::Status st = service_->contexts().CheckSession(session_, caller().principal);
          !st.ok()) {
        return st;
      }
    }
    ForwardRequest request;
    request.training = training_;
    request.x = inputs[0];
    request.expert_ids = inputs[1];
    request.weights = inputs[2];
    LayerEntry& e = **entry;
    // An x the engine will refuse is left to its error; any other is admitted first.
    MemoryLedger::RequestCharge working;
    if (CheckTensor(request.x, "x", e.config.dtype, {-1, e.config.d_model}).ok()) {
      MOE_ASSIGN_OR_RETURN(working, service_->AdmitEngineCall(
                                        e, request.x.shape[0],
                                        training_ ? EngineCall::kTrainingForward
                                                  : EngineCall::kForward));
    }
    auto result = e.layer->Forward(request);
    working.Reset();  // the call's buffers are freed; its context is admitted on its own below
    if (!result.ok()) return result.status();
    const int64_t tokens = request.x.shape.empty() ? 0 : request.x.shape[0];
    if (training_) {
      if (!result->context) return absl::InternalError("engine returned no training context");
      for (grpc::CallbackServerContext* call : calls) {
        if (call->IsCancelled()) return absl::CancelledError("the client cancelled the call");
      }
      absl::Status put = service_->contexts().Put(layer_, context_id_, caller().principal, session_,
                                                  std::move(result->context));
      if (!put.ok()) return put;
    }
    service_->metrics().Tokens(layer_, "forward", tokens);
    service_->metrics().ExpertTokens(layer_, e.config.expert_first,
                                     result->tokens_per_local_expert);
    const double aux = result->aux_loss, z = result->z_loss;
    const uint64_t id = context_id_;
    const bool has_ids = !result->expert_ids.empty(), has_weights = !result->weights.empty();
    auto tensors = std::make_shared<std::vector<Tensor>>();
    tensors->push_back(std::move(result->out));
    tensors->push_back(std::move(result->expert_ids));
    tensors->push_back(std::move(result->weights));
    return Computed<v1::ForwardResponse>{std::move(tensors), [=](v1::ForwardResponse* r) {
                                           r->set_context_id(id);
                                           r->set_aux_loss(aux);
                                           r->set_z_loss(z);
                                           return std::vector<v1::Tensor*>{
                                               r->mutable_out(),
                                               has_ids ? r->mutable_expert_ids() : nullptr,
                                               has_weights ? r->mutable_weights() : nullptr};
                                         }};
  }

 private:
  bool training_ = false;
};

class BackwardReactor final : public MicroBatchReactor<v1::BackwardRequest, v1::BackwardResponse> {
 public:
  BackwardReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx)
      : MicroBatchReactor(
            s, ctx, "Backward",
            {{v1::BackwardRequest::kDoutFieldNumber, "dout", true,
              wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived}},
            {v1::BackwardResponse::kDxFieldNumber, v1::BackwardResponse::kDweightsFieldNumber}) {
    Start();
  }

 protected:
  absl::Status ReadHeader(const v1::BackwardRequest&) override {
    if (striped()) return absl::OkStatus();  // each stream's share is its own claim
    // dout is [tokens, d_model] of the saved context: room for exactly that, from the server's
    // own numbers, not the client's claim (Compute still checks the shape).
    auto entry = service_->FindLayer(layer_);
    auto tokens = service_->contexts().NumTokens(layer_, context_id_, caller().principal);
    if (entry.ok() && tokens.ok()) {
      return ReserveInput(0, *tokens * (*entry)->config.d_model *
                                 static_cast<int64_t>(DTypeSize((*entry)->config.dtype)));
    }
    return absl::OkStatus();
  }
  absl::Status CheckSame(const v1::BackwardRequest&) const override { return absl::OkStatus(); }
  const v1::Tensor* InputOf(const v1::BackwardRequest& c, size_t) const override {
    return c.has_dout() ? &c.dout() : nullptr;
  }
  std::pair<std::string, std::string> StripeHeader() const override { return {"", ""}; }

  absl::StatusOr<Computed<v1::BackwardResponse>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>&) override {
    auto entry = service_->FindLayer(layer_);
    if (!entry.ok()) return entry.status();
    if (absl::Status st = service_->AuthorizeLayer(caller(), **entry, Access::kTrain, "layer");
        !st.ok()) {
      return st;
    }
    LayerEntry& e = **entry;
    auto tokens = service_->contexts().NumTokens(layer_, context_id_, caller().principal);
    if (!tokens.ok()) return tokens.status();
    const TensorView& dout = inputs[0];
    // Checked here, before the context is consumed, so a bad dout or a call that does not fit
    // does not lose it.
    absl::Status shape = CheckTensor(dout, "dout", e.config.dtype, {*tokens, e.config.d_model});
    if (!shape.ok()) return shape;
    MOE_ASSIGN_OR_RETURN(MemoryLedger::RequestCharge working,
                         service_->AdmitEngineCall(e, *tokens, EngineCall::kBackward));
    auto context = service_->contexts().Take(layer_, context_id_, caller().principal);
    if (!context.ok()) return context.status();
    auto result = e.layer->Backward(std::move(*context), dout);
    if (!result.ok()) return result.status();
    service_->metrics().Tokens(layer_, "backward", *tokens);
    const uint64_t id = context_id_;
    const bool has_dweights = !result->dweights.empty();
    auto tensors = std::make_shared<std::vector<Tensor>>();
    tensors->push_back(std::move(result->dx));
    tensors->push_back(std::move(result->dweights));
    return Computed<v1::BackwardResponse>{std::move(tensors), [=](v1::BackwardResponse* m) {
                                            m->set_context_id(id);
                                            return std::vector<v1::Tensor*>{
                                                m->mutable_dx(),
                                                has_dweights ? m->mutable_dweights() : nullptr};
                                          }};
  }
};

// --- Weight export / import ---------------------------------------------------------------
class ExportReactor final : public grpc::ServerWriteReactor<v1::WeightChunk> {
 public:
  ExportReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx,
                const v1::ExportWeightsRequest* req)
      : service_(s), ctx_(ctx), req_(*req), caller_(s->Authenticate(ctx)) {
    s->metrics().BytesIn("ExportWeights", static_cast<int64_t>(req->ByteSizeLong()));
    if (!caller_.ok()) {
      Done(caller_.status());
      return;
    }
    s->executor().Submit([this](double queued) {
      service_->metrics().Stage("ExportWeights", "queue", queued);
      absl::Status st = CallAlive(ctx_);
      if (st.ok()) {
        const Clock::time_point t0 = Clock::now();
        st = Build();
        service_->metrics().Stage("ExportWeights", "compute", SecondsSince(t0));
      }
      if (!st.ok()) {
        Done(st);
        return;
      }
      send_start_ = Clock::now();
      if (chunks_.empty()) {
        Done(absl::OkStatus());
      } else {
        StartWrite(&chunks_[0]);
      }
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client went away during the export"));
      return;
    }
    service_->metrics().BytesOut("ExportWeights",
                                 static_cast<int64_t>(chunks_[next_].ByteSizeLong()));
    if (++next_ < chunks_.size()) {
      StartWrite(&chunks_[next_]);
      return;
    }
    service_->metrics().Stage("ExportWeights", "send", SecondsSince(send_start_));
    Done(absl::OkStatus());
  }
  void OnDone() override { delete this; }

 private:
  absl::Status Build() {
    auto entry = service_->FindLayer(req_.layer());
    if (!entry.ok()) return entry.status();
    if (absl::Status st = service_->AuthorizeLayer(*caller_, **entry, Access::kRead, "layer");
        !st.ok()) {
      return st;
    }
    auto state = (*entry)->layer->ExportState(req_.include_optimizer());
    if (!state.ok()) return state.status();
    const int64_t chunk =
        ExportChunkBytes(req_.max_chunk_bytes(), service_->options().max_message_bytes);
    for (const auto& [name, t] : *state) {
      size_t offset = 0;
      do {
        const size_t take = std::min<size_t>(static_cast<size_t>(chunk), t.bytes.size() - offset);
        v1::WeightChunk c;
        c.set_layer(req_.layer());
        c.set_name(name);
        wire::SetTensorHeader(t.dtype, t.shape, c.mutable_tensor());
        c.mutable_tensor()->set_offset(static_cast<int64_t>(offset));
        c.mutable_tensor()->set_data(reinterpret_cast<const char*>(t.bytes.data()) + offset, take);
        offset += take;
        c.set_last_chunk(offset == t.bytes.size());
        chunks_.push_back(std::move(c));
      } while (offset < t.bytes.size());
    }
    return absl::OkStatus();
  }
  void Done(const absl::Status& st) {
    service_->metrics().Request("ExportWeights", GrpcCodeName(ToGrpcStatus(st).error_code()));
    Finish(ToGrpcStatus(st));
  }

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  const v1::ExportWeightsRequest req_;
  const absl::StatusOr<Caller> caller_;
  std::vector<v1::WeightChunk> chunks_;
  size_t next_ = 0;
  Clock::time_point send_start_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::WeightChunk> {
 public:
  ImportReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx,
                v1::ImportWeightsResponse* resp)
      : service_(s),
        ctx_(ctx),
        resp_(resp),
        caller_(s->Authenticate(ctx)),
        charge_(s->ledger().NewRequestCharge()) {
    if (!caller_.ok()) {
      Done(caller_.status());
      return;
    }
    StartRead(&chunk_);
    receive_start_ = Clock::now();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (ctx_->IsCancelled()) {
        Done(absl::CancelledError("import cancelled"));
        return;
      }
      service_->metrics().Stage("ImportWeights", "receive", SecondsSince(receive_start_));
      service_->executor().Submit([this](double queued) {
        service_->metrics().Stage("ImportWeights", "queue", queued);
        absl::Status st = CallAlive(ctx_);
        if (st.ok()) {
          const Clock::time_point t0 = Clock::now();
          st = Apply();
          service_->metrics().Stage("ImportWeights", "compute", SecondsSince(t0));
        }
        Done(st);
      });
      return;
    }
    service_->metrics().BytesIn("ImportWeights", static_cast<int64_t>(chunk_.ByteSizeLong()));
    if (absl::Status st = ValidateWeightChunk(chunk_, layer_); !st.ok()) {
      Done(st);
      return;
    }
    if (layer_.empty()) {
      layer_ = chunk_.layer();
      // Refused before any tensor is buffered; Apply checks again on the executor.
      if (auto entry = service_->FindLayer(layer_); entry.ok()) {
        absl::Status allowed =
            service_->AuthorizeLayer(*caller_, **entry, Access::kManage, "layer");
        if (!allowed.ok()) {
          Done(allowed);
          return;
        }
      }
    }
    auto it = parts_.find(chunk_.name());
    if (it == parts_.end()) {
      it = parts_
               .emplace(chunk_.name(),
                        std::make_unique<wire::TensorAssembler>(
                            absl::StrCat("tensor ", chunk_.name()),
                            wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived))
               .first;
    }
    // Charged to the memory ledger before it is copied in, as a micro-batch's tensors are.
    const absl::string_view data = chunk_.tensor().data();
    held_total_ = SaturatingAdd(
        held_total_, held_[chunk_.name()].Add(chunk_.tensor(), absl::MakeConstSpan(&data, 1)));
    if (absl::Status st = charge_.Set(held_total_, absl::StrCat("tensor ", chunk_.name()));
        !st.ok()) {
      Done(st);
      return;
    }
    if (absl::Status st = it->second->Add(chunk_.tensor()); !st.ok()) {
      Done(st);
      return;
    }
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  absl::Status Apply() {
    if (absl::Status st = ValidateImportStream(layer_); !st.ok()) return st;
    auto entry = service_->FindLayer(layer_);
    if (!entry.ok()) return entry.status();
    if (absl::Status st = service_->AuthorizeLayer(*caller_, **entry, Access::kManage, "layer");
        !st.ok()) {
      return st;
    }
    std::map<std::string, Tensor> state;
    for (auto& [name, assembler] : parts_) {
      auto t = assembler->Finish();
      if (!t.ok()) return t.status();
      state[name] = std::move(*t);
    }
    absl::Status st = (*entry)->layer->ImportState(state);
    if (!st.ok()) return st;
    service_->RefreshLayer(**entry);
    resp_->set_tensors(static_cast<int64_t>(state.size()));
    return absl::OkStatus();
  }
  void Done(const absl::Status& st) {
    service_->metrics().Request("ImportWeights", GrpcCodeName(ToGrpcStatus(st).error_code()));
    if (st.ok())
      service_->metrics().BytesOut("ImportWeights", static_cast<int64_t>(resp_->ByteSizeLong()));
    Finish(ToGrpcStatus(st));
  }

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  v1::ImportWeightsResponse* resp_;
  const absl::StatusOr<Caller> caller_;
  v1::WeightChunk chunk_;
  std::string layer_;
  std::map<std::string, std::unique_ptr<wire::TensorAssembler>> parts_;
  std::map<std::string, HeldBytes> held_;  // what each part holds, for the ledger
  int64_t held_total_ = 0;
  MemoryLedger::RequestCharge charge_;
  Clock::time_point receive_start_;
};

// --- Sessions -----------------------------------------------------------------------------
class SessionReactor final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  SessionReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx) : service_(s) {
    service_->metrics().StreamOpened("OpenSession");
    absl::StatusOr<Caller> caller = s->Authenticate(ctx);
    if (!caller.ok()) {
      service_->metrics().Request("OpenSession",
                                  GrpcCodeName(ToGrpcStatus(caller.status()).error_code()));
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    std::random_device rd;
    std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd());
    id_ = absl::StrFormat("%016x%016x", gen(), gen());
    service_->contexts().OpenSession(id_, caller->principal);
    event_.set_session_id(id_);
    StartWrite(&event_);
  }
  void OnWriteDone(bool) override {}  // the stream then stays open until the client leaves
  void OnCancel() override {
    if (id_.empty()) return;  // refused: already finished
    // The client cancelled, exited or lost its connection: its contexts go now.
    service_->contexts().CloseSession(id_);
    service_->metrics().Request("OpenSession", "CANCELLED");
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "session closed"));
  }
  void OnDone() override {
    if (!id_.empty()) service_->contexts().CloseSession(id_);  // idempotent
    service_->metrics().StreamClosed("OpenSession");
    delete this;
  }

 private:
  ExpertServiceImpl* service_;
  std::string id_;
  v1::SessionEvent event_;
};

}  // namespace

// --- ExpertServiceImpl ----------------------------------------------------------------------
ExpertServiceImpl::ExpertServiceImpl(const ServerOptions& options, MemoryBudget budget,
                                     std::unique_ptr<Engine> engine, Metrics* metrics,
                                     std::shared_ptr<const Authenticator> auth)
    : options_(options),
      auth_(std::move(auth)),
      metrics_(metrics),
      engine_(std::move(engine)),
      started_(Clock::now()),
      ledger_({std::move(budget), options.principal_layer_bytes_quota,
               options.principal_context_bytes_quota},
              metrics),
      contexts_(options.context_budget_bytes,
                std::chrono::milliseconds(static_cast<int64_t>(options.context_ttl_seconds * 1000)),
                std::chrono::milliseconds(
                    static_cast<int64_t>(options.sessionless_context_ttl_seconds * 1000)),
                &ledger_, metrics) {
  metrics_->Layers(0);
  executor_.Submit([this](double) { SampleMemory(); });
  sweeper_ = std::thread([this] { SweepLoop(); });
}

ExpertServiceImpl::~ExpertServiceImpl() {
  {
    std::lock_guard<std::mutex> lock(sweep_mu_);
    sweep_stop_ = true;
  }
  sweep_cv_.notify_all();
  sweeper_.join();
}

void ExpertServiceImpl::SweepLoop() {
  // Sweep often enough that a context outlives its TTL by at most a quarter of it (or 1 s).
  const double ttl =
      std::min(options_.context_ttl_seconds, options_.sessionless_context_ttl_seconds);
  const auto period =
      std::chrono::milliseconds(std::clamp<int64_t>(static_cast<int64_t>(ttl * 250), 10, 1000));
  std::unique_lock<std::mutex> lock(sweep_mu_);
  while (!sweep_cv_.wait_for(lock, period, [this] { return sweep_stop_; })) {
    contexts_.Expire();
    executor_.Submit([this](double) { SampleMemory(); });
  }
}

void ExpertServiceImpl::SampleMemory() {
  memory_used_ = engine_->memory_in_use_bytes();
  memory_total_ = engine_->memory_total_bytes();
  metrics_->DeviceMemory(memory_used_, memory_total_);
  metrics_->PinnedHostMemory(engine_->pinned_host_bytes());
}

absl::StatusOr<std::shared_ptr<LayerEntry>> ExpertServiceImpl::FindLayer(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("layer: no layer named \"", name, "\""));
  }
  return it->second;
}

absl::StatusOr<Caller> ExpertServiceImpl::Authenticate(
    const grpc::CallbackServerContext* ctx) const {
  if (auth_ == nullptr) return Caller{kAnonymousPrincipal, false};
  absl::StatusOr<std::string> principal = auth_->Authenticate(*ctx);
  if (!principal.ok()) return principal.status();
  return Caller{*principal, auth_->IsAdmin(*principal)};
}

absl::Status ExpertServiceImpl::AuthorizeLayer(const Caller& caller, const LayerEntry& entry,
                                               Access access, const char* field) const {
  if (caller.admin || caller.principal == entry.owner) return absl::OkStatus();
  const bool shared = entry.shared_with.count(caller.principal) != 0;
  if (shared && access != Access::kManage) return absl::OkStatus();
  if (shared) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, ": principal \"", caller.principal, "\" may not delete layer \"", entry.name,
        "\", import weights into it or load a checkpoint over it; only its owner and admins may"));
  }
  return absl::PermissionDeniedError(
      absl::StrCat(field, ": principal \"", caller.principal, "\" may not use layer \"", entry.name,
                   "\": it belongs to another principal and is not shared with it"));
}

absl::StatusOr<std::string> ExpertServiceImpl::CheckpointRoot(const Caller& caller) const {
  const std::string& root = options_.checkpoint_dir;
  if (root.empty() || auth_ == nullptr || !auth_->enabled() || caller.admin) return root;
  const std::string dir = absl::StrCat(root, "/", PrincipalDirectoryName(caller.principal));
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("checkpoint directory ", dir, " of principal \"",
                                            caller.principal, "\": ", std::strerror(errno)));
  }
  // The principal's directory is the root its paths resolve under (checkpoint.h), so it must be
  // a directory itself, never a link planted to lead elsewhere.
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("path: the checkpoint directory of principal \"", caller.principal,
                     "\" is not a directory (a symbolic link or another file is in its place)"));
  }
  return dir;
}

std::vector<std::shared_ptr<LayerEntry>> ExpertServiceImpl::VisibleLayers(
    const Caller& caller) const {
  std::vector<std::shared_ptr<LayerEntry>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, e] : layers_) {
    if (AuthorizeLayer(caller, *e, Access::kRead, "").ok()) out.push_back(e);
  }
  return out;
}

absl::StatusOr<MemoryLedger::RequestCharge> ExpertServiceImpl::AdmitEngineCall(
    const LayerEntry& entry, int64_t tokens, EngineCall call) {
  MOE_ASSIGN_OR_RETURN(int64_t bytes, engine_->HostWorkingBytes(entry.config, tokens, call));
  MemoryLedger::RequestCharge charge = ledger_.NewWorkingCharge();
  if (call != EngineCall::kTrainingForward) {
    MOE_RETURN_IF_ERROR(charge.Set(
        bytes, absl::StrCat(call == EngineCall::kBackward ? "backward" : "forward", " of ",
                            tokens, " tokens")));
    return charge;
  }
  // A training Forward is admitted only if, once its context is kept (at most its own working
  // memory), its Backward (dout and working memory) still fits: a budget filled with contexts
  // can always run the Backward that frees one. The charge then falls to what the call holds.
  MOE_ASSIGN_OR_RETURN(int64_t backward,
                       engine_->HostWorkingBytes(entry.config, tokens, EngineCall::kBackward));
  const int64_t dout = tokens * entry.config.d_model *
                       static_cast<int64_t>(DTypeSize(entry.config.dtype));
  int64_t reserve = 0;
  if (__builtin_add_overflow(bytes, backward, &reserve) ||
      __builtin_add_overflow(reserve, dout, &reserve)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("forward of ", tokens, " tokens: needs more than 2^63 bytes"));
  }
  MOE_RETURN_IF_ERROR(charge.Set(
      reserve, absl::StrCat("training forward of ", tokens, " tokens (with room for its backward)")));
  MOE_RETURN_IF_ERROR(charge.Set(bytes, "training forward"));  // a fall always fits
  return charge;
}

void ExpertServiceImpl::RefreshLayer(LayerEntry& entry) {
  entry.step = entry.layer->step();
  entry.resident_bytes = entry.layer->resident_bytes();
  metrics_->LayerResident(entry.name, entry.resident_bytes);
  SampleMemory();
}

void ExpertServiceImpl::FillInfo(const LayerEntry& entry, v1::LayerInfo* info) const {
  info->set_name(entry.name);
  *info->mutable_config() = wire::LayerConfigToProto(entry.config);
  info->set_step(entry.step);
  info->set_resident_bytes(entry.resident_bytes);
  auto [n, b] = contexts_.LayerUsage(entry.name);
  info->set_saved_contexts(n);
  info->set_saved_context_bytes(b);
  info->set_device(engine_->name());
  info->set_owner(entry.owner);
  for (const std::string& p : entry.shared_with) info->add_shared_with(p);
}

void ExpertServiceImpl::FinishUnary(grpc::ServerUnaryReactor* reactor, const char* method,
                                    const absl::Status& status) {
  grpc::Status g = ToGrpcStatus(status);
  metrics_->Request(method, GrpcCodeName(g.error_code()));
  reactor->Finish(g);
}

template <typename Work>
grpc::ServerUnaryReactor* ExpertServiceImpl::RunUnary(grpc::CallbackServerContext* ctx,
                                                      const char* method,
                                                      const google::protobuf::Message* req,
                                                      const google::protobuf::Message* resp,
                                                      Work work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> authenticated = BeginUnary(ctx, method, *req, reactor);
  if (!authenticated.ok()) return reactor;
  Caller caller = *std::move(authenticated);
  executor_.Submit([this, ctx, reactor, method, resp, work, caller](double queued) {
    metrics_->Stage(method, "queue", queued);
    absl::Status st = CallAlive(ctx);
    if (st.ok()) {
      const Clock::time_point t0 = Clock::now();
      st = GuardAllocation(method, [&] { return work(caller); });
      metrics_->Stage(method, "compute", SecondsSince(t0));
    }
    if (st.ok()) metrics_->BytesOut(method, static_cast<int64_t>(resp->ByteSizeLong()));
    FinishUnary(reactor, method, st);
  });
  return reactor;
}

absl::StatusOr<Caller> ExpertServiceImpl::BeginUnary(grpc::CallbackServerContext* ctx,
                                                     const char* method,
                                                     const google::protobuf::Message& req,
                                                     grpc::ServerUnaryReactor* reactor) {
  metrics_->BytesIn(method, static_cast<int64_t>(req.ByteSizeLong()));
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (!caller.ok()) FinishUnary(reactor, method, caller.status());
  return caller;
}

absl::StatusOr<std::unique_ptr<Layer>> ExpertServiceImpl::CreateAdmittedLayer(
    const std::string& principal, const std::string& name, const LayerConfig& config) {
  absl::StatusOr<int64_t> need = engine_->LayerStateBytes(config);
  if (!need.ok()) return need.status();
  if (absl::Status st = ledger_.AdmitLayer(principal, name, *need); !st.ok()) return st;
  absl::StatusOr<std::unique_ptr<Layer>> layer = engine_->CreateLayer(config);
  if (!layer.ok()) {
    ledger_.ReleaseLayer(name);
    return layer.status();
  }
  // LayerStateBytes promises resident_bytes(); should they ever differ, what the layer holds
  // is what the ledger must count.
  if ((*layer)->resident_bytes() != *need) ledger_.SetLayerBytes(name, (*layer)->resident_bytes());
  return layer;
}

absl::Status ExpertServiceImpl::InsertLayer(const std::string& name, const LayerConfig& config,
                                            std::unique_ptr<Layer> layer, const std::string& owner,
                                            std::set<std::string> shared_with,
                                            std::shared_ptr<LayerEntry>* out) {
  auto entry = std::make_shared<LayerEntry>();
  entry->name = name;
  entry->config = config;
  entry->owner = owner;
  entry->shared_with = std::move(shared_with);
  entry->layer = std::move(layer);
  RefreshLayer(*entry);
  {
    std::lock_guard<std::mutex> lock(mu_);
    layers_[name] = entry;
    metrics_->Layers(static_cast<int64_t>(layers_.size()));
  }
  *out = entry;
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* ExpertServiceImpl::CreateLayer(grpc::CallbackServerContext* ctx,
                                                         const v1::CreateLayerRequest* req,
                                                         v1::LayerInfo* resp) {
  return RunUnary(ctx, "CreateLayer", req, resp, [this, req, resp](const Caller& caller) {
    if (auto st = ValidateLayerName(req->name(), "name"); !st.ok()) return st;
    auto config = wire::LayerConfigFromProto(req->config());
    if (!config.ok()) return config.status();
    auto shared_with = SharedWith(req->shared_with());
    if (!shared_with.ok()) return shared_with.status();
    auto existing = FindLayer(req->name());
    if (existing.ok()) {
      if (req->attach_if_exists()) {
        absl::Status allowed = AuthorizeLayer(caller, **existing, Access::kTrain, "name");
        if (!allowed.ok()) return allowed;
      }
      const std::string have = wire::LayerConfigToProto((*existing)->config).SerializeAsString();
      const std::string want = wire::LayerConfigToProto(*config).SerializeAsString();
      if (req->attach_if_exists() && have == want) {
        FillInfo(**existing, resp);
        return absl::OkStatus();
      }
      return absl::AlreadyExistsError(
          absl::StrCat("name: layer \"", req->name(), "\" already exists",
                       req->attach_if_exists() ? " with a different config" : ""));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (static_cast<int>(layers_.size()) >= options_.max_layers) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the server already holds --max_layers=", options_.max_layers, " layers"));
      }
    }
    auto layer = CreateAdmittedLayer(caller.principal, req->name(), *config);
    if (!layer.ok()) return layer.status();
    std::shared_ptr<LayerEntry> entry;
    if (auto st = InsertLayer(req->name(), *config, std::move(*layer), caller.principal,
                              *std::move(shared_with), &entry);
        !st.ok()) {
      return st;
    }
    FillInfo(*entry, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::GetLayer(grpc::CallbackServerContext* ctx,
                                                      const v1::GetLayerRequest* req,
                                                      v1::LayerInfo* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  absl::Status st = caller.status();
  if (st.ok()) {
    auto entry = FindLayer(req->name());
    st = entry.status();
    if (st.ok()) st = AuthorizeLayer(*caller, **entry, Access::kRead, "name");
    if (st.ok()) FillInfo(**entry, resp);
  }
  FinishUnary(reactor, "GetLayer", st);
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::ListLayers(grpc::CallbackServerContext* ctx,
                                                        const v1::ListLayersRequest*,
                                                        v1::ListLayersResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (caller.ok()) {
    for (const auto& e : VisibleLayers(*caller)) FillInfo(*e, resp->add_layers());
  }
  FinishUnary(reactor, "ListLayers", caller.status());
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::DeleteLayer(grpc::CallbackServerContext* ctx,
                                                         const v1::DeleteLayerRequest* req,
                                                         v1::DeleteLayerResponse* resp) {
  return RunUnary(ctx, "DeleteLayer", req, resp, [this, req](const Caller& caller) {
    std::shared_ptr<LayerEntry> entry;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = layers_.find(req->name());
      if (it == layers_.end()) {
        return absl::NotFoundError(absl::StrCat("name: no layer named \"", req->name(), "\""));
      }
      absl::Status allowed = AuthorizeLayer(caller, *it->second, Access::kManage, "name");
      if (!allowed.ok()) return allowed;
      entry = it->second;
      layers_.erase(it);
      metrics_->Layers(static_cast<int64_t>(layers_.size()));
    }
    contexts_.DropLayer(req->name());
    metrics_->RemoveLayer(req->name(), entry->config.num_experts);
    entry.reset();  // the layer is freed here, on the executor
    ledger_.ReleaseLayer(req->name());
    SampleMemory();
    return absl::OkStatus();
  });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertServiceImpl::Forward(
    grpc::CallbackServerContext* ctx) {
  return new ForwardReactor(this, ctx);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertServiceImpl::Backward(
    grpc::CallbackServerContext* ctx) {
  return new BackwardReactor(this, ctx);
}

grpc::ServerUnaryReactor* ExpertServiceImpl::Step(grpc::CallbackServerContext* ctx,
                                                  const v1::StepRequest* req,
                                                  v1::StepResponse* resp) {
  return RunUnary(ctx, "Step", req, resp, [this, req, resp](const Caller& caller) {
    auto entry = FindLayer(req->layer());
    if (!entry.ok()) return entry.status();
    if (auto st = AuthorizeLayer(caller, **entry, Access::kTrain, "layer"); !st.ok()) return st;
    auto result = (*entry)->layer->Step();
    if (!result.ok()) return result.status();
    RefreshLayer(**entry);
    metrics_->OptimizerStep(req->layer(), result->grad_norm);
    resp->set_step(result->step);
    resp->set_grad_norm(result->grad_norm);
    resp->set_expert_first((*entry)->config.expert_first);
    for (int64_t n : result->tokens_per_expert) resp->add_tokens_per_expert(n);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::ZeroGrad(grpc::CallbackServerContext* ctx,
                                                      const v1::ZeroGradRequest* req,
                                                      v1::ZeroGradResponse* resp) {
  return RunUnary(ctx, "ZeroGrad", req, resp, [this, req](const Caller& caller) {
    auto entry = FindLayer(req->layer());
    if (!entry.ok()) return entry.status();
    if (auto st = AuthorizeLayer(caller, **entry, Access::kTrain, "layer"); !st.ok()) return st;
    return (*entry)->layer->ZeroGrad();
  });
}

grpc::ServerWriteReactor<v1::WeightChunk>* ExpertServiceImpl::ExportWeights(
    grpc::CallbackServerContext* ctx, const v1::ExportWeightsRequest* req) {
  return new ExportReactor(this, ctx, req);
}

grpc::ServerReadReactor<v1::WeightChunk>* ExpertServiceImpl::ImportWeights(
    grpc::CallbackServerContext* ctx, v1::ImportWeightsResponse* resp) {
  return new ImportReactor(this, ctx, resp);
}

// Save: the state is exported on the device executor (a copy, so the layer trains on), then
// encoded and written on the file executor. Load: read (bounded by --max_checkpoint_bytes),
// decoded and checked whole on the file executor, then imported on the device executor. Either
// way a slow disk holds no Forward, and the call's deadline is asked between chunks of I/O and
// at each hand-over: a call past it gets DEADLINE_EXCEEDED with no file replaced (Save) and
// nothing imported (Load).
grpc::ServerUnaryReactor* ExpertServiceImpl::SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::SaveCheckpointRequest* req,
                                                            v1::SaveCheckpointResponse* resp) {
  static constexpr char kMethod[] = "SaveCheckpoint";
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> authenticated = BeginUnary(ctx, kMethod, *req, reactor);
  if (!authenticated.ok()) return reactor;
  executor_.Submit([this, ctx, req, resp, reactor,
                    caller = *std::move(authenticated)](double queued) {
    metrics_->Stage(kMethod, "queue", queued);
    const Clock::time_point t0 = Clock::now();
    auto state = std::make_shared<std::map<std::string, Tensor>>();
    LayerConfig config;
    int64_t step = 0;
    const absl::Status exported = [&]() -> absl::Status {
      if (auto st = CallAlive(ctx); !st.ok()) return st;
      auto entry = FindLayer(req->layer());
      if (!entry.ok()) return entry.status();
      if (auto st = AuthorizeLayer(caller, **entry, Access::kRead, "layer"); !st.ok()) return st;
      // What needs no export first: a bad path or a server without --checkpoint_dir.
      if (auto parts = SplitCheckpointPath(req->path()); !parts.ok()) return parts.status();
      if (options_.checkpoint_dir.empty()) {
        return absl::FailedPreconditionError("the server was started without --checkpoint_dir");
      }
      auto exported_state = (*entry)->layer->ExportState(/*include_optimizer=*/true);
      if (!exported_state.ok()) return exported_state.status();
      *state = std::move(*exported_state);
      config = (*entry)->config;
      step = (*entry)->layer->step();
      return absl::OkStatus();
    }();
    metrics_->Stage(kMethod, "compute", SecondsSince(t0));
    if (!exported.ok()) {
      FinishUnary(reactor, kMethod, exported);
      return;
    }
    file_executor_.Submit([this, ctx, req, resp, reactor, state, config, step, caller](double) {
      const Clock::time_point t1 = Clock::now();
      const KeepGoing alive = [ctx]() -> absl::Status {
        const absl::Status st = CallAlive(ctx);
        if (st.ok()) return st;
        return absl::Status(st.code(), absl::StrCat(st.code() == absl::StatusCode::kCancelled
                                                        ? "the client cancelled the call"
                                                        : "the call's deadline passed",
                                                    "; no checkpoint file was replaced"));
      };
      const absl::Status written = [&]() -> absl::Status {
        if (auto st = alive(); !st.ok()) return st;
        auto bytes = EncodeCheckpoint(req->layer(), config, *state);
        state->clear();
        if (!bytes.ok()) return bytes.status();
        auto root = CheckpointRoot(caller);
        if (!root.ok()) return root.status();
        auto path =
            WriteCheckpointFile(*root, req->path(), *bytes, options_.max_checkpoint_bytes, alive);
        if (!path.ok()) return path.status();
        resp->set_path(*path);
        resp->set_bytes(static_cast<int64_t>(bytes->size()));
        resp->set_step(step);
        return absl::OkStatus();
      }();
      metrics_->Stage(kMethod, "io", SecondsSince(t1));
      if (written.ok()) metrics_->BytesOut(kMethod, static_cast<int64_t>(resp->ByteSizeLong()));
      FinishUnary(reactor, kMethod, written);
    });
  });
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::LoadCheckpointRequest* req,
                                                            v1::LoadCheckpointResponse* resp) {
  static constexpr char kMethod[] = "LoadCheckpoint";
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> authenticated = BeginUnary(ctx, kMethod, *req, reactor);
  if (!authenticated.ok()) return reactor;
  file_executor_.Submit([this, ctx, req, resp, reactor,
                         caller = *std::move(authenticated)](double) {
    const Clock::time_point t1 = Clock::now();
    const KeepGoing alive = [ctx]() -> absl::Status {
      const absl::Status st = CallAlive(ctx);
      if (st.ok()) return st;
      return absl::Status(st.code(), absl::StrCat(st.code() == absl::StatusCode::kCancelled
                                                      ? "the client cancelled the call"
                                                      : "the call's deadline passed",
                                                  " while the checkpoint was read; nothing was "
                                                  "imported"));
    };
    auto decoded = std::make_shared<DecodedCheckpoint>();
    const absl::Status read = [&]() -> absl::Status {
      if (auto st = alive(); !st.ok()) return st;
      if (auto st = ValidateLayerName(req->layer(), "layer"); !st.ok()) return st;
      // Refused before the file is read: loading over another principal's layer.
      if (auto existing = FindLayer(req->layer()); existing.ok()) {
        absl::Status allowed = AuthorizeLayer(caller, **existing, Access::kManage, "layer");
        if (!allowed.ok()) return allowed;
      }
      if (auto listed = SharedWith(req->shared_with()); !listed.ok()) return listed.status();
      auto root = CheckpointRoot(caller);
      if (!root.ok()) return root.status();
      auto bytes = ReadCheckpointFile(*root, req->path(), options_.max_checkpoint_bytes, alive);
      if (!bytes.ok()) return bytes.status();
      auto file = DecodeCheckpoint(*bytes);
      if (!file.ok()) return file.status();
      *decoded = std::move(*file);
      // Whole or not at all: every tensor of the file's own layer config, nothing else.
      return CheckCheckpointState(decoded->config, decoded->state);
    }();
    metrics_->Stage(kMethod, "io", SecondsSince(t1));
    if (!read.ok()) {
      FinishUnary(reactor, kMethod, read);
      return;
    }
    executor_.Submit([this, ctx, req, resp, reactor, decoded, caller](double queued) {
      metrics_->Stage(kMethod, "queue", queued);
      const Clock::time_point t0 = Clock::now();
      const absl::Status imported = [&]() -> absl::Status {
        if (auto st = CallAlive(ctx); !st.ok()) return st;
        auto entry = FindLayer(req->layer());
        if (entry.ok()) {
          // Checked again here: the layer may have been created since the file was read.
          if (auto st = AuthorizeLayer(caller, **entry, Access::kManage, "layer"); !st.ok()) {
            return st;
          }
          // Into the existing layer: the checkpoint must fit it whole; ImportState then checks
          // the values and changes nothing unless all of them pass.
          if (auto st = CheckCheckpointFitsLayer(req->layer(), (*entry)->config, decoded->state);
              !st.ok()) {
            return st;
          }
          if (auto st = (*entry)->layer->ImportState(decoded->state); !st.ok()) return st;
          RefreshLayer(**entry);
          FillInfo(**entry, resp->mutable_layer());
          return absl::OkStatus();
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (static_cast<int>(layers_.size()) >= options_.max_layers) {
            return absl::ResourceExhaustedError(absl::StrCat(
                "the server already holds --max_layers=", options_.max_layers, " layers"));
          }
        }
        auto shared_with = SharedWith(req->shared_with());
        if (!shared_with.ok()) return shared_with.status();
        auto layer = CreateAdmittedLayer(caller.principal, req->layer(), decoded->config);
        if (!layer.ok()) return layer.status();
        if (auto st = (*layer)->ImportState(decoded->state); !st.ok()) {
          layer->reset();
          ledger_.ReleaseLayer(req->layer());
          return st;
        }
        std::shared_ptr<LayerEntry> created;
        if (auto st = InsertLayer(req->layer(), decoded->config, std::move(*layer),
                                  caller.principal, *std::move(shared_with), &created);
            !st.ok()) {
          return st;
        }
        FillInfo(*created, resp->mutable_layer());
        return absl::OkStatus();
      }();
      metrics_->Stage(kMethod, "compute", SecondsSince(t0));
      if (imported.ok()) metrics_->BytesOut(kMethod, static_cast<int64_t>(resp->ByteSizeLong()));
      FinishUnary(reactor, kMethod, imported);
    });
  });
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::GetStats(grpc::CallbackServerContext* ctx,
                                                      const v1::GetStatsRequest*,
                                                      v1::StatsResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (!caller.ok()) {
    FinishUnary(reactor, "GetStats", caller.status());
    return reactor;
  }
  resp->set_device(engine_->name());
  resp->set_device_memory_used_bytes(memory_used_);
  resp->set_device_memory_total_bytes(memory_total_);
  resp->set_saved_context_bytes(contexts_.bytes());
  resp->set_saved_context_budget_bytes(contexts_.budget());
  resp->set_saved_contexts(contexts_.count());
  resp->set_sessions(contexts_.sessions());
  resp->set_memory_budget_bytes(ledger_.limits().budget.engine_bytes);
  resp->set_memory_admitted_bytes(ledger_.usage().engine_bytes());
  resp->set_uptime_seconds(SecondsSince(started_));
  for (const auto& e : VisibleLayers(*caller)) FillInfo(*e, resp->add_layers());
  FinishUnary(reactor, "GetStats", absl::OkStatus());
  return reactor;
}

grpc::ServerWriteReactor<v1::SessionEvent>* ExpertServiceImpl::OpenSession(
    grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest*) {
  return new SessionReactor(this, ctx);
}

}  // namespace moe::server
