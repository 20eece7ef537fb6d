// moe-service-bench's measurement core: the same MoE work run through a moe-server (gRPC, the
// moe::client library, chunking, the server's executor) and in process on an engine's layer
// directly, so the ratio of the two is the service's overhead and nothing else.
//
// Both sides get the same inputs, the same layer config and seed, and the same call sequence:
// a training step is N Forwards in flight, then their N Backwards in flight, then Step; an
// inference round is N inference Forwards in flight. In process the N calls run one after the
// other, which is also what the server's single per-device executor does with them. Before each
// case the first inference Forward of both fresh layers is compared bitwise, so a service that
// returned wrong (or no) numbers cannot post a good time.
//
// The trainer's tensors live in host memory, or on a GPU (client_device): then both sides take
// device tensors and write device destinations (trainers.h), and the service moves them by the
// client's transport: through host memory over TCP, or in place by CUDA IPC (cuda_ipc, with the
// server in another process: main.cc forks one).
#ifndef MOE_BENCH_SERVICE_SERVICE_BENCH_H_
#define MOE_BENCH_SERVICE_SERVICE_BENCH_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "engine/layer.h"
#include "server/options.h"
#include "wire/tls.h"

namespace moe::bench {

// How the client moves the tensors (client::ClientOptions::transport): TCP; POSIX shared memory
// regions (kSharedMemory, host tensors); CUDA IPC (kSharedMemory with the trainer's tensors on a
// GPU and the server in another process); NCCL (the trainer's GPU tensors over an NCCL channel,
// ClientOptions::device_transport kNccl, host tensors over TCP).
enum class BenchTransport { kTcp, kSharedMemory, kCudaIpc, kNccl };
// "tcp", "shm", "cuda_ipc", "nccl"
const char* BenchTransportName(BenchTransport transport);

// One point of the sweep; the rest of the layer config is shared (BenchOptions::layer).
struct BenchCase {
  int64_t tokens = 0;    // T per micro-batch
  int64_t d_model = 0;   // d
  int64_t d_hidden = 0;  // h
  int in_flight = 1;     // N micro-batches in flight
};

struct BenchOptions {
  std::string server;          // host:port of a running moe-server; empty: start one in process
  // host:port of two or more running moe-servers: one sharded layer over them, no in-process
  // baseline (sharded_bench.h). Empty: `server` says.
  std::vector<std::string> servers;
  std::string metrics;         // host:port of its /metrics (in-process server: found itself)
  std::string device = "cpu";  // engine of the in-process server and of the in-process baseline
  LayerConfig layer;           // E, K, dtype, routing, activation, seed; d and h come per case
  std::vector<BenchCase> cases;
  int warmup_steps = 1;      // training steps (and inference rounds) run before timing
  int steps = 3;             // timed training steps
  int inference_rounds = 3;  // timed inference rounds (N Forwards each)
  int64_t chunk_bytes = int64_t{1} << 20;  // client chunk size (ClientOptions::chunk_bytes)
  int connections = client::ClientOptions().connections;        // ClientOptions::connections
  int64_t stripe_bytes = client::ClientOptions().stripe_bytes;  // ClientOptions::stripe_bytes
  // The trainer hands its tensors over (the client's Tensor&& overloads: no copy) instead of
  // lending views; each rep's copies are made before its clock starts, as a trainer's freshly
  // computed activations and gradients would be.
  bool hand_over = false;
  // A training step ends with Step (the optimizer); false: N Forwards and N Backwards alone,
  // what a trainer whose optimizer step is timed elsewhere pays per step.
  bool optimizer_step = true;
  // The client's TLS settings (ClientOptions::tls), for a --server started with a certificate.
  wire::ClientTls tls;
  // The bearer token (ClientOptions::token), for a --server started with --tokens_file.
  std::string token;
  int timeout_seconds = 300;  // deadline of every call
  BenchTransport transport = BenchTransport::kTcp;
  // Where the trainer's tensors live: "cpu", or "cuda:N" (a GPU, with `device` a GPU engine: the
  // in-process baseline is that engine on the same device tensors).
  std::string client_device = "cpu";
  // Engine of the in-process baseline; empty: the trainer's GPU when client_device is one (what
  // the trainer would get without offloading), else `device`.
  std::string inprocess_device;
};

// The in-process baseline's engine device (BenchOptions::inprocess_device).
std::string InprocessDevice(const BenchOptions& options);

// Per-call latencies in seconds, and what went over the wire.
struct ModeResult {
  double seconds = 0;  // wall time of the timed steps/rounds
  int64_t tokens = 0;  // tokens processed in that time (T * N * steps)
  double tokens_per_second = 0;
  std::vector<double> forward_latency;   // one per Forward call
  std::vector<double> backward_latency;  // one per Backward call (training)
  double payload_bytes = 0;              // tensor bytes the client sent plus received
  double wire_bytes = 0;  // serialized message bytes (server metrics); 0 when unknown
  // Server stage means per micro-batch, seconds: "<method>/<stage>" -> mean (server metrics).
  std::map<std::string, double> stage_mean;
};

// The server's /metrics as scraped: "name{labels}" -> value.
using Scrape = std::map<std::string, double>;
// The Prometheus text exposition format's samples, comments left out.
Scrape ParseScrape(absl::string_view text);
// Adds to `r` what the server's metrics say of a timed phase between two scrapes: the wire
// bytes of message-carrying Forward/Backward calls, and the mean of each stage per micro-batch,
// their NCCL calls (NcclForward/NcclBackward) counted under the same method.
void FromMetrics(const Scrape& before, const Scrape& after, ModeResult* r);

struct CaseResult {
  BenchCase c;
  ModeResult service_train, inproc_train;
  ModeResult service_infer, inproc_infer;
};

// The options of the bench's own server (in this process, or forked: server_process.h): loopback,
// free ports, `device`, a saved-context budget the bench's own bounds keep within.
server::ServerOptions OwnServerOptions(const BenchOptions& options);

// What every run checks first (the sweep, counts and sizes, the trainer's place and transport);
// the trainer's GPU, or -1 for host memory.
absl::StatusOr<int> CheckOptions(const BenchOptions& options);
// The client options of a run's connections (transport, chunks, TLS, token, deadline).
client::ClientOptions BenchClientOptions(const BenchOptions& options);

// Runs every case; fails on the first error (an RPC error, an engine error, a service output
// that differs from the in-process one, or zero throughput).
absl::StatusOr<std::vector<CaseResult>> RunServiceBench(const BenchOptions& options,
                                                        std::string* server_description);

// What each hop of the service's data path costs on the host for one [rows, cols] fp32 tensor
// cut into `chunk_bytes` messages, timed on the real code (wire/raw_message.h, wire/wire.h);
// milliseconds, best of a few runs. Read the server's receive/send stages and the client's share
// against these (the transfer itself is not in them).
struct CopyPathCost {
  int64_t bytes = 0;
  double memcpy_warm_ms = 0;     // memcpy into a buffer already touched
  double memcpy_fresh_ms = 0;    // memcpy into a new allocation (page faults included)
  double client_copy_ms = 0;     // the client's copy of a caller's tensor (ParallelMemcpy, warm)
  double encode_ms = 0;          // every message of the tensor encoded, by reference
  double server_receive_ms = 0;  // every message decoded and added as the server's Forward does
  double client_receive_ms = 0;  // the same as the client takes out/dx, and Finish()
};
CopyPathCost MeasureCopyPath(int64_t rows, int64_t cols, int64_t chunk_bytes);

// Percentile (0..100) of `v`, nearest rank; 0 for an empty vector.
double Percentile(std::vector<double> v, double pct);

// The results as a Markdown table (one row per case and mode) and a stage table.
std::string FormatResults(const std::vector<CaseResult>& results);

// Appends one JSON object per case and mode to `path` (JSON Lines): transport, servers (1, or
// the number of --servers), tokens, d_model, d_hidden, experts, top_k, in_flight, mode, dtype,
// routing, server_device, client_device, service_tok_s, in_process_tok_s, ratio and the p50
// latencies; the in-process ones null where a run has none (a sharded run).
absl::Status AppendJson(const std::vector<CaseResult>& results, const BenchOptions& options,
                        const std::string& server_device, const std::string& path);

// Parses "TxDxHxN" items separated by commas (e.g. "2048x512x512x4").
absl::StatusOr<std::vector<BenchCase>> ParseCases(const std::string& text);

}  // namespace moe::bench

#endif  // MOE_BENCH_SERVICE_SERVICE_BENCH_H_
