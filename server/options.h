// ServerOptions: everything moe-server can be told. main.cc fills it from flags (the only place
// flags exist); tests fill it directly. In-class defaults are the documented defaults.
#ifndef MOE_SERVER_OPTIONS_H_
#define MOE_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

#include "proto/tls.h"

namespace moe::server {

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 50051;             // 0: pick a free port (Server::port() tells which)
  int metrics_port = 9464;      // 0: pick a free port; -1: no metrics endpoint
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  std::string checkpoint_dir;   // empty: Save/LoadCheckpoint fail FAILED_PRECONDITION
  int64_t context_budget_bytes = int64_t{4} << 30;  // saved training contexts, all layers
  double context_ttl_seconds = 600;                 // a context older than this is freed
  int64_t max_message_bytes = int64_t{64} << 20;    // largest request message accepted
  int max_layers = 64;                              // bounds the `layer` metric label too
  // Largest checkpoint file LoadCheckpoint reads or SaveCheckpoint writes.
  int64_t max_checkpoint_bytes = int64_t{64} << 30;
  // All empty: plaintext gRPC. Certificate and key: TLS; a client CA as well: mutual TLS
  // (proto/tls.h). The metrics endpoint stays plain HTTP either way.
  wire::ServerTls tls;
};

}  // namespace moe::server

#endif  // MOE_SERVER_OPTIONS_H_
