// RemoteLayer, a layer on one server, and the connection's session, which holds the contexts
// its training Forwards leave on the server for their Backwards.
//
// The session is one OpenSession stream held open for the Connection's lifetime: the server
// names it in its first event, every call carries that name, and when the stream ends (the
// Connection is destroyed, or the process dies and the connection breaks) the server frees the
// session's saved contexts.
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "wire/wire.h"

namespace moe::client {

// --- Session ---------------------------------------------------------------------------------
// Holds the OpenSession stream open. The first event names the session; cancelling the call
// tells the server to free the session's contexts.
class Connection::SessionCall final : public grpc::ClientReadReactor<v1::SessionEvent> {
 public:
  void Start(v1::ExpertService::Stub* stub) {
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

absl::Status Connection::OpenSession() {
  auto* s = new SessionCall();
  session_ = s;  // ended by CloseSession, from the destructor, whether or not it opens
  s->ctx_.set_wait_for_ready(true);
  AddToken(&s->ctx_);
  auto id = s->first_event();
  s->Start(stub_.get());
  if (id.wait_for(options_.timeout) != std::future_status::ready) {
    return absl::UnavailableError(absl::StrCat(
        "OpenSession on ", target_, " did not answer within ", options_.timeout.count(), " ms"));
  }
  if ((session_id_ = id.get()).empty()) {
    // The server's refusal (UNAUTHENTICATED without a valid token, say) as it gave it.
    const grpc::Status& why = s->status();
    if (!why.ok()) {
      return absl::Status(FromGrpcStatus(why).code(),
                          absl::StrCat("OpenSession on ", target_, ": ", why.error_message()));
    }
    return absl::UnavailableError(absl::StrCat("OpenSession on ", target_, " failed"));
  }
  return absl::OkStatus();
}

void Connection::CloseSession() {
  if (session_ == nullptr) return;
  auto done = session_->done();
  session_->Cancel();
  done.wait();
  delete session_;
  session_ = nullptr;
}

// --- RemoteLayer -----------------------------------------------------------------------------
absl::StatusOr<std::unique_ptr<RemoteLayer>> RemoteLayer::Create(
    std::shared_ptr<Connection> conn, const std::string& name, const LayerConfig& config,
    const std::vector<std::string>& shared_with) {
  MOE_ASSIGN_OR_RETURN(const v1::LayerInfo info,
                       conn->CreateLayer(name, config, /*attach_if_exists=*/true, shared_with));
  MOE_ASSIGN_OR_RETURN(const LayerConfig c, wire::LayerConfigFromProto(info.config()));
  return std::unique_ptr<RemoteLayer>(new RemoteLayer(std::move(conn), name, c));
}

absl::StatusOr<std::unique_ptr<RemoteLayer>> RemoteLayer::Attach(std::shared_ptr<Connection> conn,
                                                                 const std::string& name) {
  MOE_ASSIGN_OR_RETURN(const v1::LayerInfo info, conn->GetLayer(name));
  MOE_ASSIGN_OR_RETURN(const LayerConfig c, wire::LayerConfigFromProto(info.config()));
  return std::unique_ptr<RemoteLayer>(new RemoteLayer(std::move(conn), name, c));
}

std::future<absl::StatusOr<ForwardOutput>> RemoteLayer::Forward(const TensorView& x,
                                                                const TensorView& ids,
                                                                const TensorView& weights,
                                                                bool training) {
  return conn_->Forward(name_, training ? conn_->NextContextId() : 0, training, x, ids, weights);
}

std::future<absl::StatusOr<BackwardOutput>> RemoteLayer::Backward(uint64_t context_id,
                                                                  const TensorView& dout,
                                                                  const BackwardOptions& options) {
  return conn_->Backward(name_, context_id, dout, options);
}

std::future<absl::StatusOr<ForwardOutput>> RemoteLayer::Forward(Tensor&& x, Tensor&& ids,
                                                                Tensor&& weights, bool training) {
  return conn_->Forward(name_, training ? conn_->NextContextId() : 0, training, std::move(x),
                        std::move(ids), std::move(weights));
}

std::future<absl::StatusOr<BackwardOutput>> RemoteLayer::Backward(uint64_t context_id,
                                                                  Tensor&& dout,
                                                                  const BackwardOptions& options) {
  return conn_->Backward(name_, context_id, std::move(dout), options);
}

std::future<absl::StatusOr<ForwardOutput>> RemoteLayer::ForwardInto(
    const TensorView& x, const TensorView& ids, const TensorView& weights,
    const MutableTensorView& out, void* stream, bool training) {
  return conn_->ForwardInto(name_, training ? conn_->NextContextId() : 0, training, x, ids,
                            weights, out, stream);
}

std::future<absl::StatusOr<BackwardOutput>> RemoteLayer::BackwardInto(
    uint64_t context_id, const TensorView& dout, const MutableTensorView& dx,
    const MutableTensorView& dweights, void* stream, const BackwardOptions& options) {
  // dweights' K is the layer's, which the connection alone does not know: checked here, before
  // the server accumulates this micro-batch's gradients.
  if (!dweights.empty()) {
    absl::Status st =
        config_.routing != RoutingMode::kClient
            ? absl::InvalidArgumentError(
                  "dweights: the layer routes on the server, so a Backward has no dweights")
            : CheckTensor(dweights, "dweights", DType::kFloat32,
                          {dout.shape.empty() ? -1 : dout.shape[0], config_.top_k});
    if (!st.ok()) {
      std::promise<absl::StatusOr<BackwardOutput>> p;
      p.set_value(st);
      return p.get_future();
    }
  }
  return conn_->BackwardInto(name_, context_id, dout, dx, dweights, stream, options);
}

}  // namespace moe::client
