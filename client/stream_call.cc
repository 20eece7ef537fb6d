// One Forward or Backward stream (see stream_call.h): the callback reactor that writes a
// stream's request messages one at a time, copies each response's tensor bytes once, as it
// arrives, into the assembled outputs, and reports the result just before it deletes itself.
#include "client/stream_call.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::client {
namespace {

// The full names of the raw methods (gRPC keeps a pointer to them for the call's lifetime).
constexpr char kForwardMethod[] = "/moe.v1.ExpertService/Forward";
constexpr char kBackwardMethod[] = "/moe.v1.ExpertService/Backward";

// One micro-batch (or one stream of a striped one) on its own bidi stream, on raw buffers
// (wire/raw_message.h): the requests are encoded by reference to the call's own copy of the
// caller's tensors, one message at a time as it is written; each response's tensor bytes are
// copied once, as it arrives, by `accept` into the assembled outputs, `finish` makes the result
// from the first response's small fields, and `done` receives it (or the call's error) just
// before the call deletes itself.
template <typename Req, typename Resp, typename Out>
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Accept = std::function<absl::Status(const Resp&, const wire::IncomingMessage&)>;
  using Finish = std::function<absl::StatusOr<Out>(const Resp& first)>;
  using Done = std::function<void(absl::StatusOr<Out>)>;
  StreamCall(wire::ChunkedMessages<Req> requests, std::vector<int> response_tensor_fields,
             Accept accept, Finish finish, Done done)
      : requests_(std::move(requests)),
        response_tensor_fields_(std::move(response_tensor_fields)),
        accept_(std::move(accept)),
        finish_(std::move(finish)),
        done_(std::move(done)) {}

  // Sets `conn`'s deadline and metadata, shows the context to `track`, and starts the call on
  // `method` of `stub`.
  void Start(const Connection& conn, grpc::GenericStub& stub, const char* method,
             const TrackContext& track) {
    conn.Prepare(&ctx_);
    if (track) track(&ctx_);
    stub.PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    message_ = requests_.Build(0);
    StartWrite(&message_);
    StartRead(&read_);
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call failed; OnDone reports why
    if (++next_ < requests_.size()) {
      message_ = requests_.Build(next_);
      StartWrite(&message_);
    } else {
      message_.Clear();
      StartWritesDone();
    }
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    Resp response;
    absl::Status st = incoming_.Decode(&read_, response_tensor_fields_, &response,
                                       Resp::descriptor()->full_name());
    if (st.ok()) st = accept_(response, incoming_);
    if (!st.ok()) {
      // A response this client cannot use: end the call (OnDone reports `st`).
      error_ = st;
      ctx_.TryCancel();
      return;
    }
    if (responses_ == 0) first_ = response;
    ++responses_;
    last_seen_ = response.last_chunk();
    StartRead(&read_);
  }
  void OnDone(const grpc::Status& status) override {
    if (!error_.ok()) {
      done_(error_);
    } else if (!status.ok()) {
      done_(FromGrpcStatus(status));
    } else if (responses_ == 0 || !last_seen_) {
      done_(absl::DataLossError("the server ended the stream without a complete response"));
    } else {
      done_(finish_(first_));
    }
    delete this;
  }

 private:
  grpc::ClientContext ctx_;
  wire::ChunkedMessages<Req> requests_;
  const std::vector<int> response_tensor_fields_;
  grpc::ByteBuffer message_;  // the request being written: requests_'s message next_
  size_t next_ = 0;
  grpc::ByteBuffer read_;
  wire::IncomingMessage incoming_;
  Resp first_;
  size_t responses_ = 0;
  bool last_seen_ = false;
  absl::Status error_;
  Accept accept_;
  Finish finish_;
  Done done_;
};

// Moves the tensor `assembler` collected into `*out`. A tensor no response carried is an error
// when `required`, and leaves `*out` empty otherwise (e.g. no dweights under server routing).
absl::Status FinishInto(wire::TensorAssembler& assembler, bool required, Tensor* out) {
  if (!required && !assembler.seen()) return absl::OkStatus();
  MOE_ASSIGN_OR_RETURN(*out, assembler.Finish());
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<ResponseTensors> ResponseTensors::Whole(
    absl::Span<const char* const> names, const std::vector<std::optional<v1::TensorRef>>& by_ref) {
  auto r = std::make_shared<ResponseTensors>();
  for (const char* n : names) {
    r->whole.emplace_back(n, wire::TensorAssembler::Sizing::kClaimedAtOnce);
  }
  r->names.assign(names.begin(), names.end());
  r->by_ref = by_ref;
  r->by_ref.resize(names.size());
  r->written.resize(names.size());
  return r;
}

std::shared_ptr<ResponseTensors> ResponseTensors::Stripe(
    std::shared_ptr<std::deque<wire::StripedAssembler>> outputs, uint32_t stream,
    int64_t row_begin) {
  auto r = std::make_shared<ResponseTensors>();
  r->striped = std::move(outputs);
  r->stream = stream;
  r->row_begin = row_begin;
  return r;
}

std::shared_ptr<std::deque<wire::StripedAssembler>> ResponseTensors::Shared(
    absl::Span<const char* const> names, int64_t total_rows) {
  auto d = std::make_shared<std::deque<wire::StripedAssembler>>();
  for (const char* n : names) {
    d->emplace_back(n, wire::TensorAssembler::Sizing::kClaimedAtOnce, total_rows);
  }
  return d;
}

absl::Status ResponseTensors::AddIfPresent(size_t i, bool present, const v1::Tensor& proto,
                                           int field, const wire::IncomingMessage& in) {
  if (!present) return absl::OkStatus();
  const std::string name = i < names.size() ? names[i] : absl::StrCat("response tensor ", i);
  if (i < by_ref.size() && by_ref[i]) {
    // Written where the call asked: the response must say so, and carry no bytes of it.
    const v1::TensorRef& want = *by_ref[i];
    size_t bytes = proto.data().size();
    for (absl::string_view p : in.payload(field)) bytes += p.size();
    if (!proto.has_ref() || proto.ref().region_id() != want.region_id() ||
        proto.ref().offset() != want.offset() || bytes != 0) {
      return absl::DataLossError(absl::StrCat(
          name, ": the server did not answer that it wrote it at region ", want.region_id(),
          " offset ", want.offset()));
    }
    MOE_ASSIGN_OR_RETURN(written[i].dtype, wire::DTypeFromProto(proto.dtype(), name));
    written[i].shape.assign(proto.shape().begin(), proto.shape().end());
    written[i].seen = true;
    return absl::OkStatus();
  }
  if (proto.has_ref()) {
    return absl::DataLossError(
        absl::StrCat(name, ": the server answered a reference this call did not ask for"));
  }
  return striped ? (*striped)[i].Add(stream, row_begin, proto, in.payload(field))
                 : whole[i].Add(proto, in.payload(field));
}

absl::Status ResponseTensors::FinishInto(size_t i, bool required, Tensor* out) {
  if (striped) return absl::OkStatus();
  if (i < by_ref.size() && by_ref[i]) {
    if (required && !written[i].seen) {
      return absl::DataLossError(
          absl::StrCat(names[i], ": the response does not say it was written"));
    }
    return absl::OkStatus();
  }
  return client::FinishInto(whole[i], required, out);
}

void StartForwardStream(const Connection& conn, grpc::GenericStub& stub, const ForwardCall& call,
                        std::shared_ptr<const std::vector<Tensor>> tensors, const StreamRows& rows,
                        std::shared_ptr<ResponseTensors> outputs,
                        std::function<void(absl::StatusOr<ForwardOutput>)> done,
                        TrackContext track) {
  auto* stream = new StreamCall<v1::ForwardRequest, v1::ForwardResponse, ForwardOutput>(
      ForwardRequests(call, std::move(tensors), rows, conn.options()),
      {v1::ForwardResponse::kOutFieldNumber, v1::ForwardResponse::kExpertIdsFieldNumber,
       v1::ForwardResponse::kWeightsFieldNumber},
      [outputs](const v1::ForwardResponse& r, const wire::IncomingMessage& in) -> absl::Status {
        MOE_RETURN_IF_ERROR(outputs->AddIfPresent(0, r.has_out(), r.out(),
                                                  v1::ForwardResponse::kOutFieldNumber, in));
        MOE_RETURN_IF_ERROR(outputs->AddIfPresent(1, r.has_expert_ids(), r.expert_ids(),
                                                  v1::ForwardResponse::kExpertIdsFieldNumber, in));
        return outputs->AddIfPresent(2, r.has_weights(), r.weights(),
                                     v1::ForwardResponse::kWeightsFieldNumber, in);
      },
      [outputs](const v1::ForwardResponse& first) -> absl::StatusOr<ForwardOutput> {
        ForwardOutput o;
        o.context_id = first.context_id();
        o.aux_loss = first.aux_loss();
        o.z_loss = first.z_loss();
        MOE_RETURN_IF_ERROR(outputs->FinishInto(0, /*required=*/true, &o.out));
        MOE_RETURN_IF_ERROR(outputs->FinishInto(1, /*required=*/false, &o.expert_ids));
        MOE_RETURN_IF_ERROR(outputs->FinishInto(2, /*required=*/false, &o.weights));
        return o;
      },
      std::move(done));
  stream->Start(conn, stub, kForwardMethod, track);
}

void StartBackwardStream(const Connection& conn, grpc::GenericStub& stub, const BackwardCall& call,
                         std::shared_ptr<const std::vector<Tensor>> tensors, const StreamRows& rows,
                         std::shared_ptr<ResponseTensors> outputs,
                         std::function<void(absl::StatusOr<BackwardOutput>)> done,
                         TrackContext track) {
  auto* stream = new StreamCall<v1::BackwardRequest, v1::BackwardResponse, BackwardOutput>(
      BackwardRequests(call, std::move(tensors), rows, conn.options()),
      {v1::BackwardResponse::kDxFieldNumber, v1::BackwardResponse::kDweightsFieldNumber},
      [outputs](const v1::BackwardResponse& r, const wire::IncomingMessage& in) -> absl::Status {
        MOE_RETURN_IF_ERROR(
            outputs->AddIfPresent(0, r.has_dx(), r.dx(), v1::BackwardResponse::kDxFieldNumber, in));
        return outputs->AddIfPresent(1, r.has_dweights(), r.dweights(),
                                     v1::BackwardResponse::kDweightsFieldNumber, in);
      },
      [outputs](const v1::BackwardResponse&) -> absl::StatusOr<BackwardOutput> {
        BackwardOutput o;
        MOE_RETURN_IF_ERROR(outputs->FinishInto(0, /*required=*/true, &o.dx));
        MOE_RETURN_IF_ERROR(outputs->FinishInto(1, /*required=*/false, &o.dweights));
        return o;
      },
      std::move(done));
  stream->Start(conn, stub, kBackwardMethod, track);
}

}  // namespace moe::client
