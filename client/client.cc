// moe::client implementation (see client.h). Forward and Backward run on gRPC's callback client
// API: each call is a heap-allocated ClientBidiReactor that writes its request chunks, reads the
// response chunks and fulfils a promise from OnDone, so the caller's thread never waits unless it
// asks the future.
#include "client/client.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "wire/raw_message.h"
#include "wire/tls.h"
#include "wire/wire.h"

namespace moe::client {
namespace {

constexpr char kSessionMetadataKey[] = "moe-session-id";
constexpr char kAuthorizationMetadataKey[] = "authorization";

// A token gRPC can send as a metadata value and the server's tokens file can hold: printable
// ASCII without spaces.
absl::Status CheckToken(const std::string& token) {
  for (char c : token) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) {
      return absl::InvalidArgumentError(
          "token: may hold only printable ASCII without spaces (a stray newline from a token "
          "file?)");
    }
  }
  return absl::OkStatus();
}

// One unary ExpertService call with the connection's deadline and session metadata; the
// server's status comes back as absl::Status carrying its message.
template <typename Req, typename Resp>
absl::StatusOr<Resp> CallUnary(const Connection& conn, v1::ExpertService::Stub* stub,
                               grpc::Status (v1::ExpertService::Stub::*method)(grpc::ClientContext*,
                                                                               const Req&, Resp*),
                               const Req& req) {
  grpc::ClientContext ctx;
  conn.Prepare(&ctx);
  Resp resp;
  absl::Status st = FromGrpcStatus((stub->*method)(&ctx, req, &resp));
  if (!st.ok()) return st;
  return resp;
}

// Moves the tensor `assembler` collected into `*out`. A tensor no response carried is an error
// when `required`, and leaves `*out` empty otherwise (e.g. no dweights under server routing).
absl::Status FinishInto(wire::TensorAssembler& assembler, bool required, Tensor* out) {
  if (!required && !assembler.seen()) return absl::OkStatus();
  absl::StatusOr<Tensor> t = assembler.Finish();
  if (!t.ok()) return t.status();
  *out = std::move(*t);
  return absl::OkStatus();
}

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

  grpc::ClientContext* context() { return &ctx_; }

  void Start() {
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

// The streams of one striped micro-batch (moe.proto `Stripe`) on the client: each stream's
// result arrives in Done; the first error cancels the streams still running (the server fails
// them all anyway; this ends them without waiting for it), and the last stream to finish
// merges the results in row order, or reports the error, through the promise.
template <typename Out>
class StripedCall {
 public:
  using Merge = std::function<absl::StatusOr<Out>(std::vector<Out>&)>;
  StripedCall(size_t streams, Merge merge)
      : contexts_(streams, nullptr),
        results_(streams),
        remaining_(streams),
        merge_(std::move(merge)) {}

  std::future<absl::StatusOr<Out>> future() { return promise_.get_future(); }
  // Before stream i starts (a stream that starts after another failed is cancelled at once).
  void Track(size_t i, grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_[i] = ctx;
    if (!error_.ok()) ctx->TryCancel();
  }
  void Done(size_t i, absl::StatusOr<Out> result) {
    bool last;
    {
      // Under the lock: a stream's context lives until its Done returns, which needs the lock.
      std::lock_guard<std::mutex> lock(mu_);
      contexts_[i] = nullptr;
      if (result.ok()) {
        results_[i] = std::move(*result);
      } else {
        // Keep the first error that says why; the streams this cancels report CANCELLED.
        if (error_.ok() || (absl::IsCancelled(error_) && !absl::IsCancelled(result.status()))) {
          error_ = result.status();
        }
        for (grpc::ClientContext* c : contexts_) {
          if (c != nullptr) c->TryCancel();
        }
      }
      last = --remaining_ == 0;
    }
    if (!last) return;
    promise_.set_value(error_.ok() ? merge_(results_) : absl::StatusOr<Out>(error_));
  }

 private:
  std::mutex mu_;
  std::vector<grpc::ClientContext*> contexts_;  // of the streams still running
  std::vector<Out> results_;
  size_t remaining_;
  absl::Status error_;
  Merge merge_;
  std::promise<absl::StatusOr<Out>> promise_;
};

v1::Stripe StripeFields(int index, int count, int64_t row_begin, int64_t total_rows) {
  v1::Stripe s;
  s.set_index(static_cast<uint32_t>(index));
  s.set_count(static_cast<uint32_t>(count));
  s.set_row_begin(row_begin);
  s.set_total_rows(total_rows);
  return s;
}

}  // namespace

// Where one stream's response tensors go: the call's own assemblers (a whole micro-batch), or
// its rows of a striped micro-batch's outputs, which its streams share and assemble in place
// (wire::StripedAssembler), so no stream's rows are copied again to join them.
struct ResponseTensors {
  std::vector<wire::TensorAssembler> whole;
  std::shared_ptr<std::deque<wire::StripedAssembler>> striped;
  uint32_t stream = 0;
  int64_t row_begin = 0;

  // For a whole micro-batch: the server answers for shapes this call set, so each tensor is
  // reserved on its first chunk.
  static std::shared_ptr<ResponseTensors> Whole(const std::vector<const char*>& names) {
    auto r = std::make_shared<ResponseTensors>();
    for (const char* n : names) {
      r->whole.emplace_back(n, wire::TensorAssembler::Sizing::kClaimedAtOnce);
    }
    return r;
  }
  // For stream `stream` of a striped micro-batch, whose rows start at `row_begin`.
  static std::shared_ptr<ResponseTensors> Stripe(
      std::shared_ptr<std::deque<wire::StripedAssembler>> outputs, uint32_t stream,
      int64_t row_begin) {
    auto r = std::make_shared<ResponseTensors>();
    r->striped = std::move(outputs);
    r->stream = stream;
    r->row_begin = row_begin;
    return r;
  }
  // The outputs a striped micro-batch's streams share.
  static std::shared_ptr<std::deque<wire::StripedAssembler>> Shared(
      const std::vector<const char*>& names, int64_t total_rows) {
    auto d = std::make_shared<std::deque<wire::StripedAssembler>>();
    for (const char* n : names) {
      d->emplace_back(n, wire::TensorAssembler::Sizing::kClaimedAtOnce, total_rows);
    }
    return d;
  }

  // Response tensor `i`, top-level field `field`, if the message carries it.
  absl::Status AddIfPresent(size_t i, bool present, const v1::Tensor& proto, int field,
                            const wire::IncomingMessage& in) {
    if (!present) return absl::OkStatus();
    return striped ? (*striped)[i].Add(stream, row_begin, proto, in.payload(field))
                   : whole[i].Add(proto, in.payload(field));
  }
  // Moves whole tensor `i` into `*out` (a striped stream's rows are finished by the merge). A
  // tensor no response carried is an error when `required`, and leaves `*out` empty otherwise.
  absl::Status FinishInto(size_t i, bool required, Tensor* out) {
    if (striped) return absl::OkStatus();
    return moe::client::FinishInto(whole[i], required, out);
  }
};

namespace {

// Finishes a striped micro-batch's shared output `i` into `*out`, as FinishInto does.
absl::Status FinishStriped(std::deque<wire::StripedAssembler>& outputs, size_t i, uint32_t streams,
                           bool required, Tensor* out) {
  if (!required && !outputs[i].seen()) return absl::OkStatus();
  absl::StatusOr<Tensor> t = outputs[i].Finish(streams);
  if (!t.ok()) return t.status();
  *out = std::move(*t);
  return absl::OkStatus();
}

// How many streams carry a micro-batch of `rows` rows and `bytes` request bytes (1: unstriped).
int StripesFor(const ClientOptions& options, int64_t rows, int64_t bytes) {
  if (options.stripe_bytes <= 0 || options.connections < 2) return 1;
  const int64_t n = std::min<int64_t>(
      {options.connections, rows, bytes / options.stripe_bytes, int64_t{wire::kMaxStripes}});
  return static_cast<int>(std::max<int64_t>(n, 1));
}

template <typename T>
std::future<absl::StatusOr<T>> Ready(absl::Status status) {
  std::promise<absl::StatusOr<T>> p;
  p.set_value(std::move(status));
  return p.get_future();
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

Tensor ToTensor(const TensorView& view) {
  Tensor t;
  t.dtype = view.dtype;
  t.shape = view.shape;
  t.bytes.resize(view.size_bytes);
  ParallelMemcpy(t.bytes.data(), view.data, view.size_bytes);
  return t;
}

// --- Session ---------------------------------------------------------------------------------
// Holds the OpenSession stream open for the Connection's lifetime. The first event names the
// session; cancelling the call (destructor) tells the server to free the session's contexts.
class Connection::SessionCall final : public grpc::ClientReadReactor<v1::SessionEvent> {
 public:
  void Start(v1::ExpertService::Stub* stub, const std::string& token) {
    if (!token.empty()) ctx_.AddMetadata(kAuthorizationMetadataKey, absl::StrCat("Bearer ", token));
    stub->async()->OpenSession(&ctx_, &request_, this);
    StartRead(&event_);
    StartCall();
  }
  std::future<std::string> first_event() { return id_.get_future(); }
  void OnReadDone(bool ok) override {
    if (ok && !got_) {
      got_ = true;
      id_.set_value(event_.session_id());
    }
    if (ok) StartRead(&event_);
  }
  void OnDone(const grpc::Status& status) override {
    if (!got_) {
      got_ = true;
      status_ = status;
      id_.set_value("");
    }
    done_.set_value();
  }
  // Why the session ended before it began (read once first_event() gave "").
  const grpc::Status& status() const { return status_; }
  void Cancel() { ctx_.TryCancel(); }
  std::future<void> done() { return done_.get_future(); }
  grpc::ClientContext ctx_;

 private:
  v1::OpenSessionRequest request_;
  v1::SessionEvent event_;
  bool got_ = false;
  grpc::Status status_;
  std::promise<std::string> id_;
  std::promise<void> done_;
};

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " is empty"));
  }
  return token;
}

absl::StatusOr<std::shared_ptr<Connection>> Connection::Connect(const std::string& target,
                                                                ClientOptions options) {
  if (options.chunk_bytes <= 0) return absl::InvalidArgumentError("chunk_bytes: must be > 0");
  if (options.connections < 1) return absl::InvalidArgumentError("connections: must be >= 1");
  if (absl::Status st = CheckToken(options.token); !st.ok()) return st;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      wire::MakeChannelCredentials(options.tls, "tls.");
  if (!credentials.ok()) return credentials.status();
  std::shared_ptr<Connection> c(new Connection());
  c->target_ = target;
  c->options_ = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(options.max_receive_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(-1);
  if (!options.tls.server_name.empty()) args.SetSslTargetNameOverride(options.tls.server_name);
  c->channel_ = grpc::CreateCustomChannel(target, *credentials, args);
  if (!c->channel_->WaitForConnected(std::chrono::system_clock::now() + options.timeout)) {
    // A handshake that fails looks like a server that is not there; say which side to check.
    return absl::UnavailableError(absl::StrCat(
        "could not connect to ", target, " within ", options.timeout.count(), " ms",
        wire::UsesTls(options.tls)
            ? " (over TLS: is the server's certificate signed by tls.ca_file and issued for "
              "the target's host or tls.server_name, and does the server require a client "
              "certificate?)"
            : " (plaintext: does the server require TLS?)"));
  }
  c->stub_ = v1::ExpertService::NewStub(c->channel_);
  c->raw_stubs_.push_back(std::make_unique<RawStub>(c->channel_));
  // Channels with equal arguments share one connection (gRPC's global subchannel pool): each
  // further channel gets a pool of its own, hence its own connection.
  grpc::ChannelArguments own_pool = args;
  own_pool.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (int i = 1; i < options.connections; ++i) {
    auto channel = grpc::CreateCustomChannel(target, *credentials, own_pool);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + options.timeout)) {
      return absl::UnavailableError(absl::StrCat("could not open connection ", i + 1, " of ",
                                                 options.connections, " to ", target, " within ",
                                                 options.timeout.count(), " ms"));
    }
    c->raw_stubs_.push_back(std::make_unique<RawStub>(channel));
    c->extra_channels_.push_back(std::move(channel));
  }
  std::random_device rd;
  c->context_prefix_ = (static_cast<uint64_t>(rd()) << 32) & 0xFFFFFFFF00000000ull;
  if (options.open_session) {
    auto* s = new SessionCall();
    c->session_ = s;
    s->ctx_.set_wait_for_ready(true);
    auto id = s->first_event();
    s->Start(c->stub_.get(), options.token);
    if (id.wait_for(options.timeout) != std::future_status::ready) {
      return absl::UnavailableError(absl::StrCat(
          "OpenSession on ", target, " did not answer within ", options.timeout.count(), " ms"));
    }
    if ((c->session_id_ = id.get()).empty()) {
      // The server's refusal (UNAUTHENTICATED without a valid token, say) as it gave it.
      const grpc::Status& why = s->status();
      if (!why.ok()) {
        return absl::Status(FromGrpcStatus(why).code(),
                            absl::StrCat("OpenSession on ", target, ": ", why.error_message()));
      }
      return absl::UnavailableError(absl::StrCat("OpenSession on ", target, " failed"));
    }
  }
  return c;
}

Connection::~Connection() {
  if (session_) {
    auto done = session_->done();
    session_->Cancel();
    done.wait();
    delete session_;
  }
}

uint64_t Connection::NextContextId() {
  return context_prefix_ | (++context_counter_ & 0xFFFFFFFFull);
}

void Connection::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  if (!session_id_.empty()) ctx->AddMetadata(kSessionMetadataKey, session_id_);
  if (!options_.token.empty()) {
    ctx->AddMetadata(kAuthorizationMetadataKey, absl::StrCat("Bearer ", options_.token));
  }
}

absl::Status Connection::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  absl::Status st = FromGrpcStatus(health->Check(&ctx, req, &resp));
  if (!st.ok()) return st;
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(
        target_, " is not serving (",
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::LayerInfo> Connection::CreateLayer(const std::string& name,
                                                      const LayerConfig& config,
                                                      bool attach_if_exists,
                                                      const std::vector<std::string>& shared_with) {
  v1::CreateLayerRequest req;
  req.set_name(name);
  *req.mutable_config() = wire::LayerConfigToProto(config);
  req.set_attach_if_exists(attach_if_exists);
  for (const std::string& p : shared_with) req.add_shared_with(p);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::CreateLayer, req);
}

absl::StatusOr<v1::LayerInfo> Connection::GetLayer(const std::string& name) {
  v1::GetLayerRequest req;
  req.set_name(name);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::GetLayer, req);
}

absl::StatusOr<std::vector<v1::LayerInfo>> Connection::ListLayers() {
  auto resp =
      CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::ListLayers, v1::ListLayersRequest());
  if (!resp.ok()) return resp.status();
  return std::vector<v1::LayerInfo>(resp->layers().begin(), resp->layers().end());
}

absl::Status Connection::DeleteLayer(const std::string& name) {
  v1::DeleteLayerRequest req;
  req.set_name(name);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::DeleteLayer, req).status();
}

absl::StatusOr<v1::StatsResponse> Connection::GetStats() {
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::GetStats, v1::GetStatsRequest());
}

// Starts the `stripes` streams of a striped micro-batch of `rows` rows, stream i with rows
// [begin, end) (the rows split as evenly as they go): start(begin, end, stripe, its response
// tensors, its done callback, its track callback) starts one stream.
template <typename Out, typename Start>
void StartStripes(int stripes, int64_t rows, const std::shared_ptr<StripedCall<Out>>& striped,
                  const std::shared_ptr<std::deque<wire::StripedAssembler>>& outputs, Start start) {
  int64_t begin = 0;
  for (int i = 0; i < stripes; ++i) {
    const int64_t end = begin + rows / stripes + (i < rows % stripes);
    const v1::Stripe stripe = StripeFields(i, stripes, begin, rows);
    start(begin, end, &stripe, ResponseTensors::Stripe(outputs, i, begin),
          std::function<void(absl::StatusOr<Out>)>(
              [striped, i](absl::StatusOr<Out> r) { striped->Done(i, std::move(r)); }),
          std::function<void(grpc::ClientContext*)>(
              [striped, i](grpc::ClientContext* ctx) { striped->Track(i, ctx); }));
    begin = end;
  }
}

// The caller's tensors are copied once, into the call's own buffers, so the caller may reuse
// them as soon as this returns; the messages refer to those copies (or, for the overloads that
// take tensors, to the caller's own). A micro-batch above `stripe_bytes` goes as several streams
// (StripedCall), each sending its rows of those same buffers.
std::future<absl::StatusOr<ForwardOutput>> Connection::Forward(const std::string& layer,
                                                               uint64_t context_id, bool training,
                                                               const TensorView& x,
                                                               const TensorView& ids,
                                                               const TensorView& weights) {
  return Forward(layer, context_id, training, ToTensor(x), ToTensor(ids), ToTensor(weights));
}

std::future<absl::StatusOr<ForwardOutput>> Connection::Forward(const std::string& layer,
                                                               uint64_t context_id, bool training,
                                                               Tensor&& x, Tensor&& ids,
                                                               Tensor&& weights) {
  const std::vector<const char*> names = {"out", "expert_ids", "weights"};
  const int64_t rows = x.shape.empty() ? 0 : x.shape[0];
  const int stripes =
      StripesFor(options_, rows,
                 static_cast<int64_t>(x.bytes.size() + ids.bytes.size() + weights.bytes.size()));
  auto tensors = std::make_shared<std::vector<Tensor>>();
  tensors->push_back(std::move(x));
  tensors->push_back(std::move(ids));
  tensors->push_back(std::move(weights));
  if (stripes == 1) {
    auto promise = std::make_shared<std::promise<absl::StatusOr<ForwardOutput>>>();
    StartForward(layer, context_id, training, tensors, 0, -1, nullptr,
                 ResponseTensors::Whole(names),
                 [promise](absl::StatusOr<ForwardOutput> r) { promise->set_value(std::move(r)); });
    return promise->get_future();
  }
  // The server joins the streams by context id: an inference micro-batch gets one for that.
  const uint64_t join_id = context_id != 0 ? context_id : NextContextId();
  auto outputs = ResponseTensors::Shared(names, rows);
  auto striped = std::make_shared<StripedCall<ForwardOutput>>(
      stripes,
      [outputs, stripes,
       context_id](std::vector<ForwardOutput>& parts) -> absl::StatusOr<ForwardOutput> {
        ForwardOutput o;
        o.context_id = context_id;
        o.aux_loss = parts[0].aux_loss;
        o.z_loss = parts[0].z_loss;
        const uint32_t n = static_cast<uint32_t>(stripes);
        if (auto s = FinishStriped(*outputs, 0, n, /*required=*/true, &o.out); !s.ok()) return s;
        if (auto s = FinishStriped(*outputs, 1, n, false, &o.expert_ids); !s.ok()) return s;
        if (auto s = FinishStriped(*outputs, 2, n, false, &o.weights); !s.ok()) return s;
        return o;
      });
  auto fut = striped->future();
  StartStripes(stripes, rows, striped, outputs,
               [&](int64_t begin, int64_t end, const v1::Stripe* stripe,
                   std::shared_ptr<ResponseTensors> mine, auto done, auto track) {
                 StartForward(layer, join_id, training, tensors, begin, end, stripe,
                              std::move(mine), std::move(done), std::move(track));
               });
  return fut;
}

void Connection::StartForward(const std::string& layer, uint64_t context_id, bool training,
                              std::shared_ptr<const std::vector<Tensor>> tensors, int64_t row_begin,
                              int64_t row_end, const v1::Stripe* stripe,
                              std::shared_ptr<ResponseTensors> outputs,
                              std::function<void(absl::StatusOr<ForwardOutput>)> done,
                              std::function<void(grpc::ClientContext*)> track) {
  const int64_t chunk = options_.chunk_bytes;
  const int64_t response_chunk = std::min(chunk, options_.max_receive_bytes / 2);
  const bool has_ids = !(*tensors)[1].empty(), has_weights = !(*tensors)[2].empty();
  const v1::Stripe stripe_fields = stripe ? *stripe : v1::Stripe();
  wire::ChunkedMessages<v1::ForwardRequest> requests(
      std::move(tensors), row_begin, row_end,
      {v1::ForwardRequest::kXFieldNumber, v1::ForwardRequest::kExpertIdsFieldNumber,
       v1::ForwardRequest::kWeightsFieldNumber},
      chunk, [=](v1::ForwardRequest* r) {
        r->set_layer(layer);
        r->set_context_id(context_id);
        r->set_training(training);
        r->set_max_response_chunk_bytes(response_chunk);
        if (stripe_fields.count() != 0) *r->mutable_stripe() = stripe_fields;
        // Absent tensors stay unset (server routing sends no ids or weights).
        return std::vector<v1::Tensor*>{r->mutable_x(), has_ids ? r->mutable_expert_ids() : nullptr,
                                        has_weights ? r->mutable_weights() : nullptr};
      });
  auto* call = new StreamCall<v1::ForwardRequest, v1::ForwardResponse, ForwardOutput>(
      std::move(requests),
      {v1::ForwardResponse::kOutFieldNumber, v1::ForwardResponse::kExpertIdsFieldNumber,
       v1::ForwardResponse::kWeightsFieldNumber},
      [outputs](const v1::ForwardResponse& r, const wire::IncomingMessage& in) -> absl::Status {
        if (auto s = outputs->AddIfPresent(0, r.has_out(), r.out(),
                                           v1::ForwardResponse::kOutFieldNumber, in);
            !s.ok()) {
          return s;
        }
        if (auto s = outputs->AddIfPresent(1, r.has_expert_ids(), r.expert_ids(),
                                           v1::ForwardResponse::kExpertIdsFieldNumber, in);
            !s.ok()) {
          return s;
        }
        return outputs->AddIfPresent(2, r.has_weights(), r.weights(),
                                     v1::ForwardResponse::kWeightsFieldNumber, in);
      },
      [outputs](const v1::ForwardResponse& first) -> absl::StatusOr<ForwardOutput> {
        ForwardOutput o;
        o.context_id = first.context_id();
        o.aux_loss = first.aux_loss();
        o.z_loss = first.z_loss();
        if (auto s = outputs->FinishInto(0, /*required=*/true, &o.out); !s.ok()) return s;
        if (auto s = outputs->FinishInto(1, /*required=*/false, &o.expert_ids); !s.ok()) return s;
        if (auto s = outputs->FinishInto(2, /*required=*/false, &o.weights); !s.ok()) return s;
        return o;
      },
      std::move(done));
  Prepare(call->context());
  if (track) track(call->context());
  NextRawStub().PrepareBidiStreamingCall(call->context(), kForwardMethod, grpc::StubOptions(),
                                         call);
  call->Start();
}

// As Forward: `dout` is copied once into the call's own buffer (or taken over), striped above
// `stripe_bytes`.
std::future<absl::StatusOr<BackwardOutput>> Connection::Backward(const std::string& layer,
                                                                 uint64_t context_id,
                                                                 const TensorView& dout) {
  return Backward(layer, context_id, ToTensor(dout));
}

std::future<absl::StatusOr<BackwardOutput>> Connection::Backward(const std::string& layer,
                                                                 uint64_t context_id,
                                                                 Tensor&& dout) {
  const std::vector<const char*> names = {"dx", "dweights"};
  const int64_t rows = dout.shape.empty() ? 0 : dout.shape[0];
  const int stripes = StripesFor(options_, rows, static_cast<int64_t>(dout.bytes.size()));
  auto tensors = std::make_shared<std::vector<Tensor>>();
  tensors->push_back(std::move(dout));
  if (stripes == 1) {
    auto promise = std::make_shared<std::promise<absl::StatusOr<BackwardOutput>>>();
    StartBackward(
        layer, context_id, tensors, 0, -1, nullptr, ResponseTensors::Whole(names),
        [promise](absl::StatusOr<BackwardOutput> r) { promise->set_value(std::move(r)); });
    return promise->get_future();
  }
  auto outputs = ResponseTensors::Shared(names, rows);
  auto striped = std::make_shared<StripedCall<BackwardOutput>>(
      stripes, [outputs, stripes](std::vector<BackwardOutput>&) -> absl::StatusOr<BackwardOutput> {
        BackwardOutput o;
        const uint32_t n = static_cast<uint32_t>(stripes);
        if (auto s = FinishStriped(*outputs, 0, n, /*required=*/true, &o.dx); !s.ok()) return s;
        if (auto s = FinishStriped(*outputs, 1, n, false, &o.dweights); !s.ok()) return s;
        return o;
      });
  auto fut = striped->future();
  StartStripes(stripes, rows, striped, outputs,
               [&](int64_t begin, int64_t end, const v1::Stripe* stripe,
                   std::shared_ptr<ResponseTensors> mine, auto done, auto track) {
                 StartBackward(layer, context_id, tensors, begin, end, stripe, std::move(mine),
                               std::move(done), std::move(track));
               });
  return fut;
}

void Connection::StartBackward(const std::string& layer, uint64_t context_id,
                               std::shared_ptr<const std::vector<Tensor>> tensors,
                               int64_t row_begin, int64_t row_end, const v1::Stripe* stripe,
                               std::shared_ptr<ResponseTensors> outputs,
                               std::function<void(absl::StatusOr<BackwardOutput>)> done,
                               std::function<void(grpc::ClientContext*)> track) {
  const int64_t chunk = options_.chunk_bytes;
  const int64_t response_chunk = std::min(chunk, options_.max_receive_bytes / 2);
  const v1::Stripe stripe_fields = stripe ? *stripe : v1::Stripe();
  wire::ChunkedMessages<v1::BackwardRequest> requests(
      std::move(tensors), row_begin, row_end, {v1::BackwardRequest::kDoutFieldNumber}, chunk,
      [=](v1::BackwardRequest* r) {
        r->set_layer(layer);
        r->set_context_id(context_id);
        r->set_max_response_chunk_bytes(response_chunk);
        if (stripe_fields.count() != 0) *r->mutable_stripe() = stripe_fields;
        return std::vector<v1::Tensor*>{r->mutable_dout()};
      });
  auto* call = new StreamCall<v1::BackwardRequest, v1::BackwardResponse, BackwardOutput>(
      std::move(requests),
      {v1::BackwardResponse::kDxFieldNumber, v1::BackwardResponse::kDweightsFieldNumber},
      [outputs](const v1::BackwardResponse& r, const wire::IncomingMessage& in) -> absl::Status {
        if (auto s = outputs->AddIfPresent(0, r.has_dx(), r.dx(),
                                           v1::BackwardResponse::kDxFieldNumber, in);
            !s.ok()) {
          return s;
        }
        return outputs->AddIfPresent(1, r.has_dweights(), r.dweights(),
                                     v1::BackwardResponse::kDweightsFieldNumber, in);
      },
      [outputs](const v1::BackwardResponse&) -> absl::StatusOr<BackwardOutput> {
        BackwardOutput o;
        if (auto s = outputs->FinishInto(0, /*required=*/true, &o.dx); !s.ok()) return s;
        if (auto s = outputs->FinishInto(1, /*required=*/false, &o.dweights); !s.ok()) return s;
        return o;
      },
      std::move(done));
  Prepare(call->context());
  if (track) track(call->context());
  NextRawStub().PrepareBidiStreamingCall(call->context(), kBackwardMethod, grpc::StubOptions(),
                                         call);
  call->Start();
}

absl::StatusOr<StepOutput> Connection::Step(const std::string& layer) {
  v1::StepRequest req;
  req.set_layer(layer);
  auto resp = CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::Step, req);
  if (!resp.ok()) return resp.status();
  StepOutput o;
  o.step = resp->step();
  o.grad_norm = resp->grad_norm();
  o.expert_first = resp->expert_first();
  o.tokens_per_expert.assign(resp->tokens_per_expert().begin(), resp->tokens_per_expert().end());
  return o;
}

absl::Status Connection::ZeroGrad(const std::string& layer) {
  v1::ZeroGradRequest req;
  req.set_layer(layer);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::ZeroGrad, req).status();
}

absl::StatusOr<std::map<std::string, Tensor>> Connection::ExportWeights(const std::string& layer,
                                                                        bool include_optimizer) {
  v1::ExportWeightsRequest req;
  req.set_layer(layer);
  req.set_include_optimizer(include_optimizer);
  req.set_max_chunk_bytes(std::min(options_.chunk_bytes, options_.max_receive_bytes / 2));
  grpc::ClientContext ctx;
  Prepare(&ctx);
  auto reader = stub_->ExportWeights(&ctx, req);
  std::map<std::string, std::unique_ptr<wire::TensorAssembler>> parts;
  v1::WeightChunk chunk;
  while (reader->Read(&chunk)) {
    auto& a = parts[chunk.name()];
    if (!a)
      a = std::make_unique<wire::TensorAssembler>(chunk.name(),
                                                  wire::TensorAssembler::Sizing::kClaimedAtOnce);
    if (auto s = a->Add(chunk.tensor()); !s.ok()) {
      ctx.TryCancel();
      reader->Finish();
      return s;
    }
  }
  absl::Status st = FromGrpcStatus(reader->Finish());
  if (!st.ok()) return st;
  std::map<std::string, Tensor> out;
  for (auto& [name, a] : parts) {
    auto t = a->Finish();
    if (!t.ok()) return t.status();
    out[name] = std::move(*t);
  }
  return out;
}

absl::Status Connection::ImportWeights(const std::string& layer,
                                       const std::map<std::string, Tensor>& state) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ImportWeightsResponse resp;
  auto writer = stub_->ImportWeights(&ctx, &resp);
  const size_t chunk = static_cast<size_t>(options_.chunk_bytes);
  bool first = true;
  for (const auto& [name, t] : state) {
    size_t offset = 0;
    do {
      const size_t take = std::min(chunk, t.bytes.size() - offset);
      v1::WeightChunk c;
      if (first) c.set_layer(layer);
      first = false;
      c.set_name(name);
      wire::SetTensorHeader(t.dtype, t.shape, c.mutable_tensor());
      c.mutable_tensor()->set_offset(static_cast<int64_t>(offset));
      c.mutable_tensor()->set_data(reinterpret_cast<const char*>(t.bytes.data()) + offset, take);
      offset += take;
      c.set_last_chunk(offset == t.bytes.size());
      if (!writer->Write(c)) return FromGrpcStatus(writer->Finish());
    } while (offset < t.bytes.size());
  }
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish());
}

absl::StatusOr<v1::SaveCheckpointResponse> Connection::SaveCheckpoint(const std::string& layer,
                                                                      const std::string& path) {
  v1::SaveCheckpointRequest req;
  req.set_layer(layer);
  req.set_path(path);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::SaveCheckpoint, req);
}

absl::StatusOr<v1::LayerInfo> Connection::LoadCheckpoint(
    const std::string& layer, const std::string& path,
    const std::vector<std::string>& shared_with) {
  v1::LoadCheckpointRequest req;
  req.set_layer(layer);
  req.set_path(path);
  for (const std::string& p : shared_with) req.add_shared_with(p);
  auto resp = CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::LoadCheckpoint, req);
  if (!resp.ok()) return resp.status();
  return resp->layer();
}

// --- RemoteLayer -----------------------------------------------------------------------------
absl::StatusOr<std::unique_ptr<RemoteLayer>> RemoteLayer::Create(
    std::shared_ptr<Connection> conn, const std::string& name, const LayerConfig& config,
    const std::vector<std::string>& shared_with) {
  auto info = conn->CreateLayer(name, config, /*attach_if_exists=*/true, shared_with);
  if (!info.ok()) return info.status();
  auto c = wire::LayerConfigFromProto(info->config());
  if (!c.ok()) return c.status();
  return std::unique_ptr<RemoteLayer>(new RemoteLayer(std::move(conn), name, *c));
}

absl::StatusOr<std::unique_ptr<RemoteLayer>> RemoteLayer::Attach(std::shared_ptr<Connection> conn,
                                                                 const std::string& name) {
  auto info = conn->GetLayer(name);
  if (!info.ok()) return info.status();
  auto c = wire::LayerConfigFromProto(info->config());
  if (!c.ok()) return c.status();
  return std::unique_ptr<RemoteLayer>(new RemoteLayer(std::move(conn), name, *c));
}

std::future<absl::StatusOr<ForwardOutput>> RemoteLayer::Forward(const TensorView& x,
                                                                const TensorView& ids,
                                                                const TensorView& weights,
                                                                bool training) {
  return conn_->Forward(name_, training ? conn_->NextContextId() : 0, training, x, ids, weights);
}

std::future<absl::StatusOr<BackwardOutput>> RemoteLayer::Backward(uint64_t context_id,
                                                                  const TensorView& dout) {
  return conn_->Backward(name_, context_id, dout);
}

std::future<absl::StatusOr<ForwardOutput>> RemoteLayer::Forward(Tensor&& x, Tensor&& ids,
                                                                Tensor&& weights, bool training) {
  return conn_->Forward(name_, training ? conn_->NextContextId() : 0, training, std::move(x),
                        std::move(ids), std::move(weights));
}

std::future<absl::StatusOr<BackwardOutput>> RemoteLayer::Backward(uint64_t context_id,
                                                                  Tensor&& dout) {
  return conn_->Backward(name_, context_id, std::move(dout));
}

// --- ShardedLayer ----------------------------------------------------------------------------
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
    auto layer = RemoteLayer::Create(conns[i], name, c);
    if (!layer.ok()) return layer.status();
    s->shards_.push_back(std::move(*layer));
  }
  return s;
}

std::future<absl::StatusOr<ForwardOutput>> ShardedLayer::Forward(const TensorView& x,
                                                                 const TensorView& ids,
                                                                 const TensorView& weights,
                                                                 bool training) {
  return std::async(std::launch::async, &ShardedLayer::RunForward, this, ToTensor(x), ToTensor(ids),
                    ToTensor(weights), training);
}

std::future<absl::StatusOr<BackwardOutput>> ShardedLayer::Backward(uint64_t context_id,
                                                                   const TensorView& dout) {
  return std::async(std::launch::async, &ShardedLayer::RunBackward, this, context_id,
                    ToTensor(dout));
}

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
}  // namespace

absl::StatusOr<ForwardOutput> ShardedLayer::RunForward(Tensor x, Tensor ids, Tensor weights,
                                                       bool training) {
  const int64_t d = config_.d_model, k = config_.top_k;
  if (auto st = CheckTensor(x.view(), "x", DType::kFloat32, {-1, d}); !st.ok()) return st;
  const int64_t tokens = x.shape[0];
  if (auto st = CheckTensor(ids.view(), "expert_ids", DType::kInt32, {tokens, k}); !st.ok()) {
    return st;
  }
  if (auto st = CheckTensor(weights.view(), "weights", DType::kFloat32, {tokens, k}); !st.ok()) {
    return st;
  }
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
  out.expert_ids = ids;
  out.weights = weights;
  absl::Status first_error;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (!futures[s].valid()) continue;
    auto r = futures[s].get();
    if (!r.ok()) {
      if (first_error.ok()) first_error = r.status();
      continue;
    }
    ScatterAdd(r->out, pending.rows[s], &out.out);
    pending.shard_context[s] = r->context_id;
  }
  if (!first_error.ok()) return first_error;  // shard contexts die with TTL or the session
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
  if (auto st = CheckTensor(dout.view(), "dout", DType::kFloat32, {pending.tokens, d}); !st.ok()) {
    return st;
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
  absl::Status first_error;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (!futures[s].valid()) continue;
    auto r = futures[s].get();
    if (!r.ok()) {
      if (first_error.ok()) first_error = r.status();
      continue;
    }
    ScatterAdd(r->dx, pending.rows[s], &out.dx);
    ScatterAdd(r->dweights, pending.rows[s], &out.dweights);
  }
  if (!first_error.ok()) return first_error;
  return out;
}

absl::StatusOr<StepOutput> ShardedLayer::Step() {
  StepOutput out;
  out.tokens_per_expert.assign(config_.num_experts, 0);
  double sq = 0;
  for (auto& shard : shards_) {
    auto r = shard->Step();
    if (!r.ok()) return r.status();
    out.step = r->step;
    sq += r->grad_norm * r->grad_norm;
    for (size_t i = 0; i < r->tokens_per_expert.size(); ++i) {
      out.tokens_per_expert[r->expert_first + i] = r->tokens_per_expert[i];
    }
  }
  out.grad_norm = std::sqrt(sq);
  return out;
}

}  // namespace moe::client
