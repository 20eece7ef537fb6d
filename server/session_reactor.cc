// ExpertService.OpenSession: a server stream that names a new session and then stays open for
// as long as the client does. The session ties the client's saved contexts and registered
// regions and event pairs to its life: when the client cancels, exits or loses its connection the
// stream ends and its contexts go at once, instead of waiting out their TTL (context_store.h),
// and so do its regions (region_registry.h; a call still using one keeps it mapped until done).
#include <cstdint>
#include <random>
#include <string>

#include "absl/strings/str_format.h"
#include "server/service.h"
#include "server/status_map.h"

namespace moe::server {
namespace {

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
    service_->regions().OpenSession(id_, caller->principal);
    service_->nccl().OpenSession(id_, caller->principal);
    event_.set_session_id(id_);
    StartWrite(&event_);
  }
  void OnWriteDone(bool) override {}  // the stream then stays open until the client leaves
  void OnCancel() override {
    if (id_.empty()) return;  // refused: already finished
    // The client cancelled, exited or lost its connection: its contexts and regions go now.
    service_->contexts().CloseSession(id_);
    service_->regions().DropSession(id_);
    service_->nccl().DropSession(id_);
    service_->metrics().Request("OpenSession", "CANCELLED");
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "session closed"));
  }
  void OnDone() override {
    if (!id_.empty()) {  // both idempotent
      service_->contexts().CloseSession(id_);
      service_->regions().DropSession(id_);
      service_->nccl().DropSession(id_);
    }
    service_->metrics().StreamClosed("OpenSession");
    delete this;
  }

 private:
  ExpertServiceImpl* service_;
  std::string id_;
  v1::SessionEvent event_;
};

}  // namespace

grpc::ServerWriteReactor<v1::SessionEvent>* ExpertServiceImpl::OpenSession(
    grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest*) {
  return new SessionReactor(this, ctx);
}

}  // namespace moe::server
