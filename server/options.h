// ServerOptions: everything moe-server can be told. main.cc fills it from flags (the only place
// flags exist); tests fill it directly. In-class defaults are the documented defaults.
#ifndef MOE_SERVER_OPTIONS_H_
#define MOE_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine_options.h"
#include "wire/tls.h"

namespace moe::server {

struct ServerOptions {
  // Loopback unless told otherwise: a server reachable from the network must be meant to be
  // (docs/OPERATIONS.md, "Security").
  std::string host = "127.0.0.1";          // gRPC
  std::string metrics_host = "127.0.0.1";  // the /metrics endpoint
  int port = 50051;             // 0: pick a free port (Server::port() tells which)
  int metrics_port = 9464;      // 0: pick a free port; -1: no metrics endpoint
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  std::string checkpoint_dir;   // empty: Save/LoadCheckpoint fail FAILED_PRECONDITION
  int64_t context_budget_bytes = int64_t{4} << 30;  // saved training contexts, all layers
  double context_ttl_seconds = 600;                 // a session's context older: freed
  int64_t max_message_bytes = int64_t{64} << 20;    // largest request message accepted
  int max_layers = 64;                              // bounds the `layer` metric label too
  // A context made outside a session is freed after this: nothing else frees it when its
  // client goes away.
  double sessionless_context_ttl_seconds = 30;
  // Memory admission (server/memory_ledger.h): the bytes layer state and saved contexts (and,
  // with the CPU engine, request tensors in flight) may hold in the engine's memory. 0 derives
  // it from the cgroup limit and MemTotal, or the GPU's free memory (server/memory_limits.h).
  int64_t memory_budget_bytes = 0;
  // Per principal (server/auth.h), 0 unlimited: layer-state bytes of the layers it created, and
  // bytes of its saved contexts.
  int64_t principal_layer_bytes_quota = 0;
  int64_t principal_context_bytes_quota = 0;
  // Per principal, 0 unlimited: bytes of the memory regions it registered (region_registry.h).
  // Mapping them costs the server page tables and address space, not the memory itself.
  int64_t principal_region_bytes_quota = int64_t{16} << 30;
  // Largest checkpoint file LoadCheckpoint reads or SaveCheckpoint writes.
  int64_t max_checkpoint_bytes = int64_t{64} << 30;
  // All empty: plaintext gRPC. Certificate and key: TLS; a client CA as well: mutual TLS
  // (wire/tls.h). The metrics endpoint stays plain HTTP either way.
  wire::ServerTls tls;
  // Authentication (server/auth.h): bearer tokens from this file ("PRINCIPAL TOKEN" lines);
  // with tls.client_ca_file the client certificate's identity is a principal as well. Neither:
  // every caller is "anonymous" and may use every layer.
  std::string tokens_file;
  // Principals that may do everything on every layer; needs authentication on.
  std::vector<std::string> admin_principals;
  // The engine's settings: CPU threads, fused CUDA kernels on or off, pinned host memory.
  EngineOptions engine;
};

}  // namespace moe::server

#endif  // MOE_SERVER_OPTIONS_H_
