// moe-service-bench: throughput through a moe-server against the same engine in process.
//
// Starts a moe-server on loopback (or uses --server), creates one layer per case and measures
// training steps (N Forwards in flight, N Backwards, Step unless --optimizer_step=false) and
// inference rounds (N Forwards in flight): tokens/s, bytes/s on the wire, per-call latency
// p50/p99, and the server's stage times from its /metrics. Prints Markdown tables (and with --json
// appends one JSON object per case and mode); exits 1 on any error or zero throughput, so the smoke
// test (tests/bench) can run it as is. Every flag lives here and fills BenchOptions.
//
// --transport=cuda_ipc moves the trainer's GPU tensors (--client_device) by CUDA IPC, which
// cannot open a handle in the process that made it: without --server the bench forks a child
// running the server (server_process.h) before anything touches a GPU; --server_process does
// the same for any transport, so that all compare with the server in a process of its own.
//
// --servers=HOST:PORT,... runs one sharded layer over servers already running, one per GPU
// (sharded_bench.h): the scaling runs. One server in the list is a --server run.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "bench/service/server_process.h"
#include "bench/service/service_bench.h"
#include "bench/service/sharded_bench.h"
#include "common/crash_trace.h"

// The default sweep: d = 256..1024, T = 512..8192 tokens per micro-batch, 1..8 in flight,
// sized so the CPU engine on two cores finishes it in about a minute. The last two cases have
// h = 8: little compute per byte moved, so they show the transport's cost, as a GPU would.
ABSL_FLAG(std::string, cases,
          "512x256x256x1,512x256x256x4,2048x256x256x1,2048x256x256x2,2048x256x256x8,"
          "8192x256x256x1,2048x512x256x4,2048x1024x256x1,2048x1024x256x4,8192x1024x8x1,"
          "2048x1024x8x4",
          "Comma-separated TxDxHxN: tokens per micro-batch, d_model, d_hidden, micro-batches in "
          "flight");
ABSL_FLAG(std::string, server, "", "host:port of a running moe-server; empty starts one here");
ABSL_FLAG(std::string, servers, "",
          "HOST:PORT,... of two or more running moe-servers (one per GPU, each started with "
          "--device=cuda:N): one client-routed float32 layer sharded over them, trained on the "
          "trainer's tensors (--client_device) by --transport; no in-process column (null in "
          "--json). One HOST:PORT is the same run as --server");
ABSL_FLAG(std::string, metrics, "",
          "host:port of that server's /metrics (for stage times and wire bytes); empty: none "
          "with --server, found automatically without");
ABSL_FLAG(std::string, device, "cpu", "Engine for the in-process server and baseline");
ABSL_FLAG(std::string, server_device, "",
          "Engine of the bench's own server (default: --device)");
ABSL_FLAG(std::string, inprocess_device, "",
          "Engine of the in-process baseline; empty: the trainer's GPU when --client_device is "
          "one, else --device");
ABSL_FLAG(std::string, client_device, "cpu",
          "Where the trainer's tensors live: cpu, or cuda:N (results into device destinations "
          "on one stream; the baseline is the engine on the same device tensors)");
ABSL_FLAG(std::string, transport, "tcp",
          "tcp | shm (host tensors through POSIX shared memory regions) | cuda_ipc (device "
          "tensors in place; the server runs in a child process) | nccl (device tensors over "
          "an NCCL channel to the server's GPU)");
ABSL_FLAG(std::string, json, "", "Also append one JSON object per case and mode to this file");
ABSL_FLAG(bool, server_process, false,
          "Run the bench's own server in a child process instead of this one (always so for "
          "--transport=cuda_ipc)");
ABSL_FLAG(int64_t, experts, 8, "E, number of experts");
ABSL_FLAG(int64_t, top_k, 2, "K, experts per token");
ABSL_FLAG(std::string, dtype, "float32", "float32 | bfloat16");
ABSL_FLAG(std::string, routing, "client", "client (ids and weights sent) | server (router)");
ABSL_FLAG(std::string, activation, "swiglu", "swiglu | silu | gelu | relu");
ABSL_FLAG(int, steps, 3, "Timed training steps per case");
ABSL_FLAG(int, inference_rounds, 3, "Timed inference rounds (N Forwards each) per case");
ABSL_FLAG(int, warmup, 1, "Untimed steps and rounds before timing");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{1} << 20, "Client chunk size (tensor bytes per message)");
ABSL_FLAG(int, connections, moe::client::ClientOptions().connections,
          "TCP connections the client spreads Forward and Backward calls over");
ABSL_FLAG(std::string, tls_ca_file, "",
          "Connect to --server over TLS, trusting this PEM CA (ClientOptions::tls.ca_file)");
ABSL_FLAG(std::string, token_file, "",
          "File holding the bearer token, for a --server started with --tokens_file");
ABSL_FLAG(bool, optimizer_step, true,
          "End each training step with Step (the layer's optimizer); false: the step is N "
          "Forwards and N Backwards alone");
ABSL_FLAG(bool, hand_over, false,
          "the trainer hands its tensors over (the client's Tensor&& overloads, no copy) instead "
          "of lending views; each rep's copies are made before its clock starts");
ABSL_FLAG(int64_t, stripe_bytes, moe::client::ClientOptions().stripe_bytes,
          "micro-batches of at least twice this many request bytes travel striped over several "
          "connections (ClientOptions::stripe_bytes; 0: never)");
ABSL_FLAG(int, timeout_seconds, 300, "Deadline of every call");
ABSL_FLAG(uint64_t, seed, 1, "Layer initialisation and input seed");

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "moe-service-bench: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // A crash prints where (common/crash_trace.h); the forked server child inherits it.
  moe::InstallCrashBacktrace(argv[0]);
  // As moe-server does, for the server this bench forks and for its own NCCL receives: kernels
  // load when CUDA starts, not at a first launch that could wait on a dead peer's receive.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  // --help lists this file's flags: absl's default lists only those of a file named after the
  // binary (it compares with its name normalized, which drops the leading '/').
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(__FILE__, file);
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "moe-service-bench: MoE tokens/s through moe-server vs the same engine in process");
  absl::ParseCommandLine(argc, argv);
  moe::bench::BenchOptions options;
  auto cases = moe::bench::ParseCases(absl::GetFlag(FLAGS_cases));
  if (!cases.ok()) return Fail(cases.status().ToString());
  options.cases = *cases;
  options.server = absl::GetFlag(FLAGS_server);
  if (const std::string list = absl::GetFlag(FLAGS_servers); !list.empty()) {
    auto servers = moe::bench::ParseServers(list);
    if (!servers.ok()) return Fail(std::string(servers.status().message()));
    if (!options.server.empty()) return Fail("servers: give --servers or --server, not both");
    if (servers->size() == 1) {
      options.server = servers->front();  // the single-server run, as --server makes it
    } else {
      options.servers = *std::move(servers);
      if (!absl::GetFlag(FLAGS_metrics).empty()) {
        return Fail("metrics: one /metrics endpoint does not describe several servers; leave "
                    "--metrics out with --servers");
      }
    }
  }
  options.metrics = absl::GetFlag(FLAGS_metrics);
  options.device = absl::GetFlag(FLAGS_device);
  if (const std::string d = absl::GetFlag(FLAGS_server_device); !d.empty()) options.device = d;
  options.client_device = absl::GetFlag(FLAGS_client_device);
  options.inprocess_device = absl::GetFlag(FLAGS_inprocess_device);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport == "tcp") {
    options.transport = moe::bench::BenchTransport::kTcp;
  } else if (transport == "shm") {
    options.transport = moe::bench::BenchTransport::kSharedMemory;
  } else if (transport == "cuda_ipc") {
    options.transport = moe::bench::BenchTransport::kCudaIpc;
  } else if (transport == "nccl") {
    options.transport = moe::bench::BenchTransport::kNccl;
  } else {
    return Fail(absl::StrCat("transport: \"", transport, "\" is not tcp, shm, cuda_ipc or nccl"));
  }
  options.steps = absl::GetFlag(FLAGS_steps);
  options.inference_rounds = absl::GetFlag(FLAGS_inference_rounds);
  options.warmup_steps = absl::GetFlag(FLAGS_warmup);
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.connections = absl::GetFlag(FLAGS_connections);
  options.stripe_bytes = absl::GetFlag(FLAGS_stripe_bytes);
  options.hand_over = absl::GetFlag(FLAGS_hand_over);
  options.optimizer_step = absl::GetFlag(FLAGS_optimizer_step);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = moe::client::ReadTokenFile(file, "token_file");
    if (!token.ok()) return Fail(std::string(token.status().message()));
    options.token = *token;
  }
  options.timeout_seconds = absl::GetFlag(FLAGS_timeout_seconds);
  if (options.timeout_seconds <= 0) return Fail("timeout_seconds: must be positive");

  moe::LayerConfig& layer = options.layer;
  layer.num_experts = absl::GetFlag(FLAGS_experts);
  layer.top_k = absl::GetFlag(FLAGS_top_k);
  layer.seed = absl::GetFlag(FLAGS_seed);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "float32") {
    layer.dtype = moe::DType::kFloat32;
  } else if (dtype == "bfloat16") {
    layer.dtype = moe::DType::kBFloat16;
  } else {
    return Fail(absl::StrCat("dtype: \"", dtype, "\" is not float32 or bfloat16"));
  }
  const std::string routing = absl::GetFlag(FLAGS_routing);
  if (routing == "client") {
    layer.routing = moe::RoutingMode::kClient;
  } else if (routing == "server") {
    layer.routing = moe::RoutingMode::kServer;
  } else {
    return Fail(absl::StrCat("routing: \"", routing, "\" is not client or server"));
  }
  const std::string act = absl::GetFlag(FLAGS_activation);
  if (act == "swiglu") {
    layer.activation = moe::Activation::kSwiGLU;
  } else if (act == "silu") {
    layer.activation = moe::Activation::kSiLU;
  } else if (act == "gelu") {
    layer.activation = moe::Activation::kGeLUTanh;
  } else if (act == "relu") {
    layer.activation = moe::Activation::kReLU;
  } else {
    return Fail(absl::StrCat("activation: \"", act, "\" is not swiglu, silu, gelu or relu"));
  }

  // cuda_ipc or --server_process: the server in a child process, forked before this one starts
  // a thread or touches a GPU.
  std::unique_ptr<moe::bench::ServerProcess> child;
  std::string server_device =
      options.server.empty() && options.servers.empty() ? options.device : "";
  if (options.transport == moe::bench::BenchTransport::kCudaIpc &&
      options.client_device == "cpu") {
    return Fail("client_device: transport cuda_ipc moves the trainer's device tensors; name its "
                "GPU (cuda:N)");
  }
  const bool own_process = absl::GetFlag(FLAGS_server_process) ||
                           options.transport == moe::bench::BenchTransport::kCudaIpc;
  if (own_process && options.server.empty() && options.servers.empty()) {
    auto forked = moe::bench::ServerProcess::Fork(moe::bench::OwnServerOptions(options));
    if (!forked.ok()) return Fail(forked.status().ToString());
    child = std::move(*forked);
    options.server = child->target();
    options.metrics = child->metrics();
    server_device = child->device();
  }

  std::string where;
  auto results = options.servers.empty() ? moe::bench::RunServiceBench(options, &where)
                                         : moe::bench::RunShardedBench(options, &where);
  if (!results.ok()) return Fail(results.status().ToString());
  if (child) {
    where = absl::StrCat("moe-server (", child->device(), ") in child process ", child->pid(),
                         " on loopback ", child->target());
  }
  absl::StrAppend(&where, ", transport ", transport, ", trainer tensors on ",
                  options.client_device);
  if (const std::string json = absl::GetFlag(FLAGS_json); !json.empty()) {
    if (auto st = moe::bench::AppendJson(*results, options, server_device, json); !st.ok()) {
      return Fail(st.ToString());
    }
  }
  std::printf(
      "moe-service-bench: %s; E=%lld K=%lld %s, %s routing, %s; %d steps (%s), %d inference "
      "rounds, %d warmup, chunk %lld bytes, %d connections, stripes of >= %lld bytes\n\n",
      where.c_str(), static_cast<long long>(layer.num_experts), static_cast<long long>(layer.top_k),
      dtype.c_str(), routing.c_str(), act.c_str(), options.steps,
      options.optimizer_step ? "with Step" : "no Step", options.inference_rounds,
      options.warmup_steps, static_cast<long long>(options.chunk_bytes), options.connections,
      static_cast<long long>(options.stripe_bytes));
  std::printf("%s", moe::bench::FormatResults(*results).c_str());
  // The data path's hops for the largest x of the sweep, on the real wire code.
  int64_t rows = 0, cols = 0;
  for (const moe::bench::BenchCase& c : options.cases) {
    if (c.tokens * c.d_model > rows * cols) rows = c.tokens, cols = c.d_model;
  }
  const moe::bench::CopyPathCost p = moe::bench::MeasureCopyPath(rows, cols, options.chunk_bytes);
  std::printf(
      "\nData path of one [%lld, %lld] fp32 tensor (%.1f MiB, %lld-byte chunks), ms, best of 3:\n"
      "memcpy warm %.2f | memcpy into new buffer %.2f | the client's copy (8 threads) %.2f | "
      "encode the messages (by reference) %.2f | the server's decode + Add %.2f | the client's "
      "decode + Add + Finish %.2f\n",
      static_cast<long long>(rows), static_cast<long long>(cols), p.bytes / 1048576.0,
      static_cast<long long>(options.chunk_bytes), p.memcpy_warm_ms, p.memcpy_fresh_ms,
      p.client_copy_ms, p.encode_ms, p.server_receive_ms, p.client_receive_ms);
  return 0;
}
