// Server::Start: engine, service, health, reflection and the metrics endpoint, in that order, so
// that a failure (unknown device, port taken) is reported before anything listens.
#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <exception>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/layer.h"
#include "server/auth.h"
#include "server/memory_limits.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/service.h"
#include "wire/tls.h"

namespace moe::server {

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port: ", options.port, " is not a port"));
  }
  if (options.metrics_port < -1 || options.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port: ", options.metrics_port, " is not a port (or -1)"));
  }
  if (options.context_budget_bytes < 0) {
    return absl::InvalidArgumentError("context_budget_bytes: must be >= 0");
  }
  if (options.context_ttl_seconds <= 0) {
    return absl::InvalidArgumentError("context_ttl_seconds: must be > 0");
  }
  if (options.sessionless_context_ttl_seconds <= 0) {
    return absl::InvalidArgumentError("sessionless_context_ttl_seconds: must be > 0");
  }
  if (options.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError("memory_budget_bytes: must be >= 0 (0 derives it)");
  }
  if (options.principal_layer_bytes_quota < 0 || options.principal_context_bytes_quota < 0) {
    return absl::InvalidArgumentError(absl::StrCat(options.principal_layer_bytes_quota < 0
                                                       ? "principal_layer_bytes_quota"
                                                       : "principal_context_bytes_quota",
                                                   ": must be >= 0 (0 is unlimited)"));
  }
  if (options.max_message_bytes < 1024 || options.max_message_bytes > (int64_t{2} << 30) - 1) {
    return absl::InvalidArgumentError("max_message_bytes: must be in [1024, 2^31)");
  }
  if (options.max_layers < 1) return absl::InvalidArgumentError("max_layers: must be >= 1");
  if (options.max_checkpoint_bytes < 8) {
    return absl::InvalidArgumentError("max_checkpoint_bytes: must be >= 8");
  }
  // Temporary files of checkpoint writes a crash interrupted, before any new write can start.
  DebrisSweep debris;
  if (!options.checkpoint_dir.empty()) {
    auto swept = RemoveCheckpointDebris(options.checkpoint_dir);
    if (!swept.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint_dir: ", options.checkpoint_dir, ": ", swept.status().message()));
    }
    debris = *swept;
  }

  // Before the engine: a bad TLS file is the operator's to fix and should not wait on a GPU.
  MOE_ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ServerCredentials> credentials,
                       wire::MakeServerCredentials(options.tls, "tls_"));
  // So is a bad tokens file.
  MOE_ASSIGN_OR_RETURN(
      std::shared_ptr<Authenticator> auth,
      Authenticator::Create(
          {options.tokens_file, !options.tls.client_ca_file.empty(), options.admin_principals}));

  MOE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                       CreateEngine(options.device, options.engine));

  MOE_ASSIGN_OR_RETURN(const DeviceMemoryInfo device_memory, engine->DeviceMemory());
  const HostMemoryLimits host_limits = ReadHostMemoryLimits();
  MemoryBudget budget =
      DeriveMemoryBudget(options.memory_budget_bytes, engine->name(), device_memory, host_limits);
  if (budget.engine_bytes <= 0 || budget.host_bytes <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "memory_budget_bytes: no memory left to admit anything (", budget.engine_memory, ": ",
        budget.engine_bytes, " bytes, host: ", budget.host_bytes, " bytes after the margin)"));
  }

  std::unique_ptr<Server> server(new Server());
  server->device_ = engine->name();
  server->memory_budget_ = budget;
  server->checkpoint_debris_ = debris;
  server->metrics_ = std::make_unique<Metrics>(server->device_);
  server->auth_ = std::move(auth);
  server->service_ = std::make_unique<ExpertServiceImpl>(
      options, std::move(budget), std::move(engine), server->metrics_.get(), server->auth_);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.port), credentials,
                           &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(-1);
  // Keepalive pings find clients whose connection died without a FIN (a pulled cable, a killed
  // VM): the transport then fails, open OpenSession streams are cancelled and their contexts
  // freed, instead of waiting for the context TTL.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // gRPC binds with SO_REUSEPORT by default, so a second moe-server on a port already served
  // would start and take a share of the new connections: a client's connections would then
  // reach two servers with different layers and contexts. A busy port is an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(server->service_.get());
  // Every ExpertService call's context leads back to the Authenticator (CallerPrincipal).
  builder.SetContextAllocator(std::make_unique<AuthContextAllocator>(server->auth_));
  server->grpc_server_ = builder.BuildAndStart();
  if (!server->grpc_server_ || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("port: could not listen on ", options.host, ":", options.port));
  }
  if (auto* health = server->grpc_server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    health->SetServingStatus("moe.v1.ExpertService", true);
  }

  if (options.metrics_port >= 0) {
    auto http = MetricsHttpServer::Start(options.metrics_host, options.metrics_port,
                                         server->metrics_->registry());
    if (!http.ok()) {
      server->Shutdown();
      return http.status();
    }
    server->metrics_http_ = std::move(*http);
    server->metrics_port_ = server->metrics_http_->port();
  }
  return server;
}

Server::~Server() { Shutdown(); }

absl::Status Server::ReloadTokens() { return auth_->Reload(); }

absl::StatusOr<bool> Server::ReloadTokensIfChanged() { return auth_->ReloadIfChanged(); }

void Server::Wait() {
  if (grpc_server_) grpc_server_->Wait();
}

void Server::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (grpc_server_) {
    // Open sessions and streams are cancelled; bounded so a stuck client cannot hold shutdown.
    grpc_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  metrics_http_.reset();
}

}  // namespace moe::server
