// What the ExpertService's files share and nothing outside them needs: the clock helpers, the
// liveness check every piece of work makes before it starts, the caller's session and shared_with
// lists as read from a request, and RunUnary, the path of the unary calls that run on the device
// executor. Kept out of service.h so that the service's public header stays its contract.
#ifndef MOE_SERVER_SERVICE_INTERNAL_H_
#define MOE_SERVER_SERVICE_INTERNAL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "google/protobuf/message.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "server/service.h"

namespace moe::server {

using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Cancelled / DeadlineExceeded when the call is already over, OK otherwise.
absl::Status CallAlive(grpc::CallbackServerContext* ctx);

// The executor's side of a call: records the time it queued, then runs `work` (an absl::Status
// or absl::StatusOr), timed as the "compute" stage, unless the call is already over (CallAlive's
// status then).
template <typename Work>
auto TimedWork(Metrics& metrics, const std::string& method, double queued,
               grpc::CallbackServerContext* ctx, Work work) -> decltype(work()) {
  metrics.Stage(method, "queue", queued);
  MOE_RETURN_IF_ERROR(CallAlive(ctx));
  const Clock::time_point t0 = Clock::now();
  auto result = work();
  metrics.Stage(method, "compute", SecondsSince(t0));
  return result;
}

// The session the caller names in its metadata (kSessionMetadataKey), "" when none.
std::string SessionOf(grpc::CallbackServerContext* ctx);

// A request's shared_with list, checked: at most kMaxSharedWith valid principals;
// InvalidArgument naming the entry otherwise.
absl::StatusOr<std::set<std::string>> SharedWith(
    const google::protobuf::RepeatedPtrField<std::string>& list);

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
    const absl::Status st = TimedWork(*metrics_, method, queued, ctx, [&] {
      return GuardAllocation(method, [&] { return work(caller); });
    });
    if (st.ok()) metrics_->BytesOut(method, static_cast<int64_t>(resp->ByteSizeLong()));
    FinishUnary(reactor, method, st);
  });
  return reactor;
}

}  // namespace moe::server

#endif  // MOE_SERVER_SERVICE_INTERNAL_H_
