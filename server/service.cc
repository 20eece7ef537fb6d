// ExpertService handlers and reactors (see service.h for the threading rules).
//
// Forward and Backward share one reactor template: read chunks until `last_chunk`, hand the
// assembled micro-batch to the executor, write the response chunks, then read the next
// micro-batch. Exactly one operation is outstanding at a time, so the reactor needs no lock; a
// failure finishes the stream with that micro-batch's status.
#include "server/service.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/host_memory.h"
#include "proto/raw_message.h"
#include "proto/wire.h"
#include "server/checkpoint.h"
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

std::string SessionOf(grpc::CallbackServerContext* ctx) {
  auto it = ctx->client_metadata().find(kSessionMetadataKey);
  if (it == ctx->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
}

// A micro-batch's response (proto/raw_message.h): the result tensors, kept until the last message
// that refers to them is sent, cut into messages of at most the requested payload bytes. Message m
// is encoded only when it is about to be written (the first on the executor, the others in
// OnWriteDone), so the device executor hands the tensors over and takes the next micro-batch at
// once; and the encoding refers to the tensors' bytes instead of copying them into protobuf's
// strings and again into gRPC's buffers. Building messages as they are written made sonic-7b's
// shape 15% faster through the service with two micro-batches in flight and a trainer that
// retains freed memory (bench/results/2026-11-22-h100-lazy-response and -2); building the next
// message while the previous is written, under a lock since reactions may run concurrently,
// measured no better (-ed9e20e-response-pipeline).
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
        inputs_(std::move(inputs)),
        output_fields_(std::move(output_fields)) {
    for (const Input& in : inputs_) {
      input_fields_.push_back(in.field);
      assemblers_.emplace_back(in.name, in.sizing);
    }
    stream_carries_.assign(inputs_.size(), false);
    service_->metrics().StreamOpened(method_);
  }

  void Start() { this->StartRead(&buffer_); }

  void OnReadDone(bool ok) override {
    // The inputs assembled here are the engine's to copy to the device: page-locked where the
    // engine provides that memory (engine/host_memory.h).
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
  wire::TensorAssembler& assembler(size_t i) { return assemblers_[i]; }

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  const std::string method_;
  const std::string session_;
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
    absl::Status st = ReadHeader(request_);
    if (!st.ok() || !striped()) return st;
    if (context_id_ == 0) return ValidateStripe(stripe_, context_id_);
    const std::string key = StripeJoins::Key(method_, layer_, session_, context_id_);
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
        computed = Compute(views_, {ctx_});
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
    for (Self* s : streams) s->ResetInputs();
    auto shared = std::make_shared<const std::vector<Tensor>>(std::move(*inputs));
    ExpertServiceImpl* service = service_;
    const std::string method = method_;
    service_->executor().Submit([this, service, method, streams, shared](double queued) {
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
        computed = Compute(views, calls);  // `this` is one of `streams`, all still open
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
    if (training_ && !session_.empty() && !service_->contexts().SessionOpen(session_)) {
      return absl::FailedPreconditionError(
          absl::StrCat(kSessionMetadataKey, ": session ", session_, " is not open"));
    }
    ForwardRequest request;
    request.training = training_;
    request.x = inputs[0];
    request.expert_ids = inputs[1];
    request.weights = inputs[2];
    LayerEntry& e = **entry;
    auto result = e.layer->Forward(request);
    if (!result.ok()) return result.status();
    const int64_t tokens = request.x.shape.empty() ? 0 : request.x.shape[0];
    if (training_) {
      if (!result->context) return absl::InternalError("engine returned no training context");
      for (grpc::CallbackServerContext* call : calls) {
        if (call->IsCancelled()) return absl::CancelledError("the client cancelled the call");
      }
      absl::Status put =
          service_->contexts().Put(layer_, context_id_, session_, std::move(result->context));
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
    auto tokens = service_->contexts().NumTokens(layer_, context_id_);
    if (entry.ok() && tokens.ok()) {
      assembler(0).Reserve(static_cast<size_t>(*tokens) *
                           static_cast<size_t>((*entry)->config.d_model) *
                           DTypeSize((*entry)->config.dtype));
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
    LayerEntry& e = **entry;
    auto tokens = service_->contexts().NumTokens(layer_, context_id_);
    if (!tokens.ok()) return tokens.status();
    const TensorView& dout = inputs[0];
    // Checked here, before the context is consumed, so a bad dout does not lose it.
    absl::Status shape = CheckTensor(dout, "dout", e.config.dtype, {*tokens, e.config.d_model});
    if (!shape.ok()) return shape;
    auto context = service_->contexts().Take(layer_, context_id_);
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
      : service_(s), ctx_(ctx), req_(*req) {
    s->metrics().BytesIn("ExportWeights", static_cast<int64_t>(req->ByteSizeLong()));
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
  std::vector<v1::WeightChunk> chunks_;
  size_t next_ = 0;
  Clock::time_point send_start_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::WeightChunk> {
 public:
  ImportReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx,
                v1::ImportWeightsResponse* resp)
      : service_(s), ctx_(ctx), resp_(resp) {
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
    if (layer_.empty()) layer_ = chunk_.layer();
    auto it = parts_.find(chunk_.name());
    if (it == parts_.end()) {
      it = parts_
               .emplace(chunk_.name(),
                        std::make_unique<wire::TensorAssembler>(
                            absl::StrCat("tensor ", chunk_.name()),
                            wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived))
               .first;
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
  v1::WeightChunk chunk_;
  std::string layer_;
  std::map<std::string, std::unique_ptr<wire::TensorAssembler>> parts_;
  Clock::time_point receive_start_;
};

// --- Sessions -----------------------------------------------------------------------------
class SessionReactor final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  SessionReactor(ExpertServiceImpl* s) : service_(s) {
    std::random_device rd;
    std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd());
    id_ = absl::StrFormat("%016x%016x", gen(), gen());
    service_->contexts().OpenSession(id_);
    service_->metrics().StreamOpened("OpenSession");
    event_.set_session_id(id_);
    StartWrite(&event_);
  }
  void OnWriteDone(bool) override {}  // the stream then stays open until the client leaves
  void OnCancel() override {
    // The client cancelled, exited or lost its connection: its contexts go now.
    service_->contexts().CloseSession(id_);
    service_->metrics().Request("OpenSession", "CANCELLED");
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "session closed"));
  }
  void OnDone() override {
    service_->contexts().CloseSession(id_);  // idempotent
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
ExpertServiceImpl::ExpertServiceImpl(const ServerOptions& options, std::unique_ptr<Engine> engine,
                                     Metrics* metrics)
    : options_(options),
      metrics_(metrics),
      engine_(std::move(engine)),
      started_(Clock::now()),
      contexts_(options.context_budget_bytes,
                std::chrono::milliseconds(static_cast<int64_t>(options.context_ttl_seconds * 1000)),
                metrics) {
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
  const auto period = std::chrono::milliseconds(
      std::clamp<int64_t>(static_cast<int64_t>(options_.context_ttl_seconds * 250), 10, 1000));
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
  metrics_->BytesIn(method, static_cast<int64_t>(req->ByteSizeLong()));
  executor_.Submit([this, ctx, reactor, method, resp, work](double queued) {
    metrics_->Stage(method, "queue", queued);
    absl::Status st = CallAlive(ctx);
    if (st.ok()) {
      const Clock::time_point t0 = Clock::now();
      st = work();
      metrics_->Stage(method, "compute", SecondsSince(t0));
    }
    if (st.ok()) metrics_->BytesOut(method, static_cast<int64_t>(resp->ByteSizeLong()));
    FinishUnary(reactor, method, st);
  });
  return reactor;
}

absl::Status ExpertServiceImpl::InsertLayer(const std::string& name, const LayerConfig& config,
                                            std::unique_ptr<Layer> layer,
                                            std::shared_ptr<LayerEntry>* out) {
  auto entry = std::make_shared<LayerEntry>();
  entry->name = name;
  entry->config = config;
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
  return RunUnary(ctx, "CreateLayer", req, resp, [this, req, resp]() -> absl::Status {
    if (auto st = ValidateLayerName(req->name(), "name"); !st.ok()) return st;
    auto config = wire::LayerConfigFromProto(req->config());
    if (!config.ok()) return config.status();
    auto existing = FindLayer(req->name());
    if (existing.ok()) {
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
    auto layer = engine_->CreateLayer(*config);
    if (!layer.ok()) return layer.status();
    std::shared_ptr<LayerEntry> entry;
    if (auto st = InsertLayer(req->name(), *config, std::move(*layer), &entry); !st.ok()) return st;
    FillInfo(*entry, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::GetLayer(grpc::CallbackServerContext* ctx,
                                                      const v1::GetLayerRequest* req,
                                                      v1::LayerInfo* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto entry = FindLayer(req->name());
  if (entry.ok()) FillInfo(**entry, resp);
  FinishUnary(reactor, "GetLayer", entry.status());
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::ListLayers(grpc::CallbackServerContext* ctx,
                                                        const v1::ListLayersRequest*,
                                                        v1::ListLayersResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::vector<std::shared_ptr<LayerEntry>> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, e] : layers_) entries.push_back(e);
  }
  for (const auto& e : entries) FillInfo(*e, resp->add_layers());
  FinishUnary(reactor, "ListLayers", absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::DeleteLayer(grpc::CallbackServerContext* ctx,
                                                         const v1::DeleteLayerRequest* req,
                                                         v1::DeleteLayerResponse* resp) {
  return RunUnary(ctx, "DeleteLayer", req, resp, [this, req]() -> absl::Status {
    std::shared_ptr<LayerEntry> entry;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = layers_.find(req->name());
      if (it == layers_.end()) {
        return absl::NotFoundError(absl::StrCat("name: no layer named \"", req->name(), "\""));
      }
      entry = it->second;
      layers_.erase(it);
      metrics_->Layers(static_cast<int64_t>(layers_.size()));
    }
    contexts_.DropLayer(req->name());
    metrics_->RemoveLayer(req->name(), entry->config.num_experts);
    entry.reset();  // the layer is freed here, on the executor
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
  return RunUnary(ctx, "Step", req, resp, [this, req, resp]() -> absl::Status {
    auto entry = FindLayer(req->layer());
    if (!entry.ok()) return entry.status();
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
  return RunUnary(ctx, "ZeroGrad", req, resp, [this, req]() -> absl::Status {
    auto entry = FindLayer(req->layer());
    if (!entry.ok()) return entry.status();
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

grpc::ServerUnaryReactor* ExpertServiceImpl::SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::SaveCheckpointRequest* req,
                                                            v1::SaveCheckpointResponse* resp) {
  return RunUnary(ctx, "SaveCheckpoint", req, resp, [this, req, resp]() -> absl::Status {
    auto entry = FindLayer(req->layer());
    if (!entry.ok()) return entry.status();
    auto path = ResolveCheckpointPath(options_.checkpoint_dir, req->path());
    if (!path.ok()) return path.status();
    auto state = (*entry)->layer->ExportState(/*include_optimizer=*/true);
    if (!state.ok()) return state.status();
    auto bytes = EncodeCheckpoint(req->layer(), (*entry)->config, *state);
    if (!bytes.ok()) return bytes.status();
    if (auto st = WriteFileAtomically(*path, *bytes); !st.ok()) return st;
    resp->set_path(*path);
    resp->set_bytes(static_cast<int64_t>(bytes->size()));
    resp->set_step((*entry)->layer->step());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::LoadCheckpointRequest* req,
                                                            v1::LoadCheckpointResponse* resp) {
  return RunUnary(ctx, "LoadCheckpoint", req, resp, [this, req, resp]() -> absl::Status {
    if (auto st = ValidateLayerName(req->layer(), "layer"); !st.ok()) return st;
    auto path = ResolveCheckpointPath(options_.checkpoint_dir, req->path());
    if (!path.ok()) return path.status();
    auto bytes = ReadWholeFile(*path);
    if (!bytes.ok()) return bytes.status();
    auto decoded = DecodeCheckpoint(*bytes);
    if (!decoded.ok()) return decoded.status();
    auto entry = FindLayer(req->layer());
    if (entry.ok()) {
      // Into the existing layer: ImportState checks every name, shape and dtype first.
      if (auto st = (*entry)->layer->ImportState(decoded->state); !st.ok()) return st;
      RefreshLayer(**entry);
      FillInfo(**entry, resp->mutable_layer());
      return absl::OkStatus();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (static_cast<int>(layers_.size()) >= options_.max_layers) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the server already holds --max_layers=", options_.max_layers, " layers"));
      }
    }
    auto layer = engine_->CreateLayer(decoded->config);
    if (!layer.ok()) return layer.status();
    if (auto st = (*layer)->ImportState(decoded->state); !st.ok()) return st;
    std::shared_ptr<LayerEntry> created;
    if (auto st = InsertLayer(req->layer(), decoded->config, std::move(*layer), &created);
        !st.ok()) {
      return st;
    }
    FillInfo(*created, resp->mutable_layer());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::GetStats(grpc::CallbackServerContext* ctx,
                                                      const v1::GetStatsRequest*,
                                                      v1::StatsResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  resp->set_device(engine_->name());
  resp->set_device_memory_used_bytes(memory_used_);
  resp->set_device_memory_total_bytes(memory_total_);
  resp->set_saved_context_bytes(contexts_.bytes());
  resp->set_saved_context_budget_bytes(contexts_.budget());
  resp->set_saved_contexts(contexts_.count());
  resp->set_sessions(contexts_.sessions());
  resp->set_uptime_seconds(SecondsSince(started_));
  std::vector<std::shared_ptr<LayerEntry>> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, e] : layers_) entries.push_back(e);
  }
  for (const auto& e : entries) FillInfo(*e, resp->add_layers());
  FinishUnary(reactor, "GetStats", absl::OkStatus());
  return reactor;
}

grpc::ServerWriteReactor<v1::SessionEvent>* ExpertServiceImpl::OpenSession(
    grpc::CallbackServerContext*, const v1::OpenSessionRequest*) {
  return new SessionReactor(this);
}

}  // namespace moe::server
