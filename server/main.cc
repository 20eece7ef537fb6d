// moe-server: serves MoE layers to remote trainers over gRPC (moe.v1.ExpertService), with
// Prometheus metrics on --metrics_port. Every flag lives here and fills ServerOptions; the rest
// of the server never reads flags. SIGINT/SIGTERM shut down cleanly (open sessions end, their
// contexts are freed).
#include <csignal>
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "engine/host_memory.h"
#include "server/options.h"
#include "server/server.h"

namespace {
const moe::server::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, host, kDefaults.host, "Address to listen on (gRPC and metrics)");
ABSL_FLAG(int, port, kDefaults.port, "gRPC port; 0 picks a free one");
ABSL_FLAG(int, metrics_port, kDefaults.metrics_port,
          "Prometheus /metrics port; 0 picks a free one, -1 disables");
ABSL_FLAG(std::string, device, kDefaults.device, "auto | cpu | cuda | cuda:N");
ABSL_FLAG(std::string, checkpoint_dir, kDefaults.checkpoint_dir,
          "Directory SaveCheckpoint/LoadCheckpoint paths are relative to (must exist)");
ABSL_FLAG(int64_t, max_checkpoint_bytes, kDefaults.max_checkpoint_bytes,
          "Largest checkpoint file LoadCheckpoint reads or SaveCheckpoint writes; larger ones get "
          "RESOURCE_EXHAUSTED before a byte is read or written");
ABSL_FLAG(int64_t, context_budget_bytes, kDefaults.context_budget_bytes,
          "Byte budget for saved training contexts; past it a training Forward gets "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(double, context_ttl_seconds, kDefaults.context_ttl_seconds,
          "Saved contexts older than this are freed (abandoned by their client)");
ABSL_FLAG(int64_t, max_message_bytes, kDefaults.max_message_bytes,
          "Largest request message accepted; larger ones get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_layers, kDefaults.max_layers, "Most layers the server holds at once");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate (chain) of this server; with --tls_key_file, gRPC is served over TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA certificate(s): with it, every client must present a certificate signed by "
          "one of them (mutual TLS)");
ABSL_FLAG(int, tls_reload_seconds, kDefaults.tls.reload_seconds,
          "Read the --tls_ files again this often, so renewed certificates are served without a "
          "restart; 0 reads them once");
ABSL_FLAG(bool, retain_freed_memory, true,
          "Reuse freed heap memory instead of handing it back to the OS (glibc malloc: large "
          "blocks from the heap, not from fresh mmaps; no trimming; one arena). Each micro-batch "
          "then reuses the pages of the last one instead of faulting new ones in; the process "
          "keeps its peak heap");

namespace {
volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("moe-server: Mixture-of-Experts layers as a gRPC service");
  absl::ParseCommandLine(argc, argv);
  // Before Server::Start starts any thread (engine/host_memory.h says why and what it gains).
  if (absl::GetFlag(FLAGS_retain_freed_memory) && !moe::RetainFreedHeapMemory()) {
    std::fprintf(stderr,
                 "moe-server: warning: malloc settings refused; freed memory is returned\n");
  }
  moe::server::ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.device = absl::GetFlag(FLAGS_device);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.max_checkpoint_bytes = absl::GetFlag(FLAGS_max_checkpoint_bytes);
  options.context_budget_bytes = absl::GetFlag(FLAGS_context_budget_bytes);
  options.context_ttl_seconds = absl::GetFlag(FLAGS_context_ttl_seconds);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_layers = absl::GetFlag(FLAGS_max_layers);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls.reload_seconds = absl::GetFlag(FLAGS_tls_reload_seconds);

  auto server = moe::server::Server::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "moe-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  if (const moe::server::DebrisSweep& d = (*server)->checkpoint_debris();
      d.removed + d.in_use + d.failed > 0) {
    std::printf(
        "moe-server: --checkpoint_dir: removed %lld temporary files (%lld bytes) of interrupted "
        "checkpoint writes; kept %lld of live processes; %lld could not be removed\n",
        static_cast<long long>(d.removed), static_cast<long long>(d.removed_bytes),
        static_cast<long long>(d.in_use), static_cast<long long>(d.failed));
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  const char* transport = options.tls.cert_file.empty()        ? "plaintext"
                          : options.tls.client_ca_file.empty() ? "TLS"
                                                               : "mutual TLS";
  std::printf("moe-server: device %s, gRPC on %s:%d, metrics on :%d, transport %s\n",
              (*server)->device().c_str(), options.host.c_str(), (*server)->port(),
              (*server)->metrics_port(), transport);
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::printf("moe-server: shutting down\n");
  (*server)->Shutdown();
  return 0;
}
