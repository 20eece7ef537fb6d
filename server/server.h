// moe-server assembled: the ExpertService on a gRPC server with health checking and reflection,
// plus the Prometheus /metrics endpoint. main.cc and the loopback tests both start it through
// Server::Start.
#ifndef MOE_SERVER_SERVER_H_
#define MOE_SERVER_SERVER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/memory_limits.h"
#include "server/checkpoint.h"
#include "server/options.h"

namespace grpc {
class Server;
}

namespace moe::server {

class Authenticator;
class Metrics;
class ExpertServiceImpl;
class MetricsHttpServer;

class Server {
 public:
  // Creates the engine for options.device, binds both ports and starts serving.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  // Shutdown()

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  const std::string& device() const { return device_; }
  // What the server admits into (memory_ledger.h).
  const MemoryBudget& memory_budget() const { return memory_budget_; }
  Metrics& metrics() { return *metrics_; }
  // What the start-up sweep of --checkpoint_dir removed (checkpoint.h, RemoveCheckpointDebris).
  const DebrisSweep& checkpoint_debris() const { return checkpoint_debris_; }

  // Reads --tokens_file again (SIGHUP); on an error the tokens in use stay.
  absl::Status ReloadTokens();
  // The same if the file changed since it was last read; whether it was read.
  absl::StatusOr<bool> ReloadTokensIfChanged();

  void Wait();
  // Cancels open calls (sessions end, their contexts are freed) and stops serving.
  void Shutdown();

 private:
  Server() = default;
  int port_ = 0;
  int metrics_port_ = -1;
  std::string device_;
  MemoryBudget memory_budget_;
  std::shared_ptr<Authenticator> auth_;
  DebrisSweep checkpoint_debris_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<ExpertServiceImpl> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  bool shut_down_ = false;
};

}  // namespace moe::server

#endif  // MOE_SERVER_SERVER_H_
