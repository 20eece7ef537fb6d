// moe-server: serves MoE layers to remote trainers over gRPC (moe.v1.ExpertService), with
// Prometheus metrics on --metrics_port, both on loopback unless --host/--metrics_host say
// otherwise. Every flag lives here and fills ServerOptions; the rest of the server never reads
// flags. SIGINT/SIGTERM shut down cleanly (open sessions end, their contexts are freed); SIGHUP
// reads --tokens_file again, as does a change to it seen within --tokens_reload_seconds. A fatal
// signal prints a symbolized backtrace to stderr first.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/crash_trace.h"
#include "common/host_memory.h"
#include "server/options.h"
#include "server/server.h"

namespace {
const moe::server::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, host, kDefaults.host,
          "Address gRPC listens on; 0.0.0.0 (or [::]) for every interface");
ABSL_FLAG(std::string, metrics_host, kDefaults.metrics_host,
          "Address the /metrics endpoint listens on; 0.0.0.0 for every interface");
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
ABSL_FLAG(double, sessionless_context_ttl_seconds, kDefaults.sessionless_context_ttl_seconds,
          "Saved contexts made outside a session (no moe-session-id) are freed after this; "
          "contexts of an open session keep --context_ttl_seconds");
ABSL_FLAG(int64_t, memory_budget_bytes, kDefaults.memory_budget_bytes,
          "Bytes that layer state and saved contexts (and, on the CPU, request tensors in flight) "
          "may hold; CreateLayer, LoadCheckpoint, training Forwards and requests past it get "
          "RESOURCE_EXHAUSTED. 0 derives it from the cgroup memory limit and MemTotal (CPU) or "
          "the GPU's free memory, less a tenth (at least 256 MiB)");
ABSL_FLAG(int64_t, principal_layer_bytes_quota, kDefaults.principal_layer_bytes_quota,
          "Bytes of layer state (weights, gradients, optimizer state) the layers one principal "
          "created may hold; 0 is unlimited");
ABSL_FLAG(int64_t, principal_context_bytes_quota, kDefaults.principal_context_bytes_quota,
          "Bytes of saved training contexts one principal may hold; 0 is unlimited");
ABSL_FLAG(int64_t, principal_region_bytes_quota, kDefaults.principal_region_bytes_quota,
          "Bytes of shared memory and CUDA memory regions one principal may register "
          "(RegisterRegion); 0 is unlimited");
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
ABSL_FLAG(std::string, tokens_file, "",
          "Bearer tokens: one \"PRINCIPAL TOKEN\" pair per line, '#' comments; every "
          "ExpertService call must then send \"authorization: Bearer TOKEN\" (or, with "
          "--tls_client_ca_file, a client certificate). Read again on SIGHUP");
ABSL_FLAG(int, tokens_reload_seconds, 60,
          "Read --tokens_file again this often if it changed (a renewed Kubernetes Secret); 0: "
          "only on SIGHUP");
ABSL_FLAG(std::string, admin_principals, "",
          "Comma-separated principals that may do everything on every layer");
ABSL_FLAG(int, cpu_threads, kDefaults.engine.cpu_threads,
          "CPU engine: threads of its pool; 0 uses every core");
ABSL_FLAG(bool, fused_kernels, kDefaults.engine.fused_kernels,
          "CUDA engine: run the fused sm90 expert kernels where they apply; false runs the "
          "cuBLAS path everywhere");
ABSL_FLAG(uint64_t, pinned_tensor_bytes, kDefaults.engine.pinned_tensor_bytes,
          "CUDA engine: page-locked host memory held at most for large request and result "
          "tensors; 0 pins none");
ABSL_FLAG(bool, retain_freed_memory, true,
          "Reuse freed heap memory instead of handing it back to the OS (glibc malloc: large "
          "blocks from the heap, not from fresh mmaps; no trimming; one arena). Each micro-batch "
          "then reuses the pages of the last one instead of faulting new ones in; the process "
          "keeps its peak heap");

namespace {
volatile std::sig_atomic_t g_stop = 0;
volatile std::sig_atomic_t g_reload = 0;
void OnSignal(int) { g_stop = 1; }
void OnHangup(int) { g_reload = 1; }
}  // namespace

int main(int argc, char** argv) {
  moe::InstallCrashBacktrace(argv[0]);  // a crash prints where (common/crash_trace.h)
  // Every kernel loads when CUDA starts, never at its first launch: a lazy load can wait for the
  // device's running kernels, and the receive of a channel whose trainer died runs until the
  // channel is aborted, and the pump that notices the dead trainer can wait for the load (decision
  // 0018, "Kernels load eagerly"). An operator's own setting wins.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  // --help lists this file's flags: absl's default lists only those of a file named after the
  // binary (it compares with its name normalized, which drops the leading '/').
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(__FILE__, file);
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("Mixture-of-Experts layers as a gRPC service");
  absl::ParseCommandLine(argc, argv);
  // Before Server::Start starts any thread (common/host_memory.h says why and what it gains).
  if (absl::GetFlag(FLAGS_retain_freed_memory) && !moe::RetainFreedHeapMemory()) {
    std::fprintf(stderr,
                 "moe-server: warning: malloc settings refused; freed memory is returned\n");
  }
  moe::server::ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.device = absl::GetFlag(FLAGS_device);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.max_checkpoint_bytes = absl::GetFlag(FLAGS_max_checkpoint_bytes);
  options.context_budget_bytes = absl::GetFlag(FLAGS_context_budget_bytes);
  options.context_ttl_seconds = absl::GetFlag(FLAGS_context_ttl_seconds);
  options.sessionless_context_ttl_seconds = absl::GetFlag(FLAGS_sessionless_context_ttl_seconds);
  options.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  options.principal_layer_bytes_quota = absl::GetFlag(FLAGS_principal_layer_bytes_quota);
  options.principal_context_bytes_quota = absl::GetFlag(FLAGS_principal_context_bytes_quota);
  options.principal_region_bytes_quota = absl::GetFlag(FLAGS_principal_region_bytes_quota);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_layers = absl::GetFlag(FLAGS_max_layers);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls.reload_seconds = absl::GetFlag(FLAGS_tls_reload_seconds);
  options.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  options.admin_principals =
      absl::StrSplit(absl::GetFlag(FLAGS_admin_principals), ',', absl::SkipWhitespace());
  options.engine.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.engine.fused_kernels = absl::GetFlag(FLAGS_fused_kernels);
  options.engine.pinned_tensor_bytes = absl::GetFlag(FLAGS_pinned_tensor_bytes);

  if (absl::GetFlag(FLAGS_tokens_reload_seconds) < 0) {
    std::fprintf(stderr, "moe-server: INVALID_ARGUMENT: tokens_reload_seconds: must be >= 0\n");
    return 1;
  }
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
  std::signal(SIGHUP, OnHangup);
  const char* transport = options.tls.cert_file.empty()        ? "plaintext"
                          : options.tls.client_ca_file.empty() ? "TLS"
                                                               : "mutual TLS";
  const bool auth = !options.tokens_file.empty() || !options.tls.client_ca_file.empty();
  std::printf(
      "moe-server: device %s, gRPC on %s:%d, metrics on %s:%d, transport %s, authentication "
      "%s\n",
      (*server)->device().c_str(), options.host.c_str(), (*server)->port(),
      options.metrics_host.c_str(), (*server)->metrics_port(), transport,
      !auth                                ? "off (every caller is \"anonymous\")"
      : options.tokens_file.empty()        ? "client certificates"
      : options.tls.client_ca_file.empty() ? "bearer tokens"
                                           : "bearer tokens and client certificates");
  const moe::server::MemoryBudget& budget = (*server)->memory_budget();
  std::string requests;
  if (!budget.shared) {
    requests = budget.host_bytes == std::numeric_limits<int64_t>::max()
                   ? ", host memory for requests unlimited"
                   : absl::StrCat(", ", budget.host_bytes, " bytes of host memory for requests");
  }
  std::printf("moe-server: memory budget %lld bytes of %s%s\n",
              static_cast<long long>(budget.engine_bytes), budget.engine_memory.c_str(),
              requests.c_str());
  std::fflush(stdout);
  const int reload_seconds = absl::GetFlag(FLAGS_tokens_reload_seconds);
  auto next_check = std::chrono::steady_clock::now() + std::chrono::seconds(reload_seconds);
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    absl::StatusOr<bool> reloaded = false;
    const char* why = "SIGHUP";
    if (g_reload) {
      g_reload = 0;
      absl::Status st = (*server)->ReloadTokens();
      reloaded = st.ok() ? absl::StatusOr<bool>(true) : st;
    } else if (reload_seconds > 0 && std::chrono::steady_clock::now() >= next_check) {
      next_check = std::chrono::steady_clock::now() + std::chrono::seconds(reload_seconds);
      why = "tokens_file changed";
      reloaded = (*server)->ReloadTokensIfChanged();
    }
    if (!reloaded.ok()) {
      std::printf("moe-server: %s: %s; the tokens in use stay\n", why,
                  reloaded.status().ToString().c_str());
      std::fflush(stdout);
    } else if (*reloaded) {
      std::printf("moe-server: %s: tokens read again\n", why);
      std::fflush(stdout);
    }
  }
  std::printf("moe-server: shutting down\n");
  (*server)->Shutdown();
  return 0;
}
