// moe-service-bench's measurement core (see service_bench.h; the trainers and their steps are in
// trainers.cc). Server stage times and wire bytes
// come from the server's own /metrics, scraped over plain HTTP before and after each timed phase
// and differenced, so they describe exactly the calls this bench made (a shared server's other
// traffic would leak in; the in-process server has none).
#include "bench/service/service_bench.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/service/device_tensors.h"
#include "bench/service/trainers.h"
#include "client/client.h"
#include "common/host_memory.h"
#include "wire/raw_message.h"
#include "wire/wire.h"
#include "server/options.h"
#include "server/server.h"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// --- /metrics scraping -------------------------------------------------------------------
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: \"", host_port, "\" is not host:port"));
  }
  const std::string host = host_port.substr(0, colon), port = host_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot resolve ", host_port));
  }
  int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
    return absl::UnavailableError(absl::StrCat("metrics: cannot connect to ", host_port));
  }
  freeaddrinfo(res);
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host, "\r\nConnection: close\r\n\r\n");
  if (send(fd, req.data(), req.size(), 0) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("metrics: send failed");
  }
  std::string body;
  char buf[65536];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0) {
      close(fd);
      return absl::UnavailableError("metrics: recv failed");
    }
    if (n == 0) break;
    body.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t header_end = body.find("\r\n\r\n");
  if (body.rfind("HTTP/1.", 0) != 0 || header_end == std::string::npos ||
      body.find(" 200 ") > body.find("\r\n")) {
    return absl::UnavailableError(
        absl::StrCat("metrics: ", host_port, path, " did not answer 200"));
  }
  return body.substr(header_end + 4);
}

absl::StatusOr<Scrape> ScrapeMetrics(const std::string& host_port) {
  auto text = HttpGet(host_port, "/metrics");
  if (!text.ok()) return text.status();
  return ParseScrape(*text);
}

double Delta(const Scrape& before, const Scrape& after, const std::string& key) {
  auto a = after.find(key);
  if (a == after.end()) return 0;
  auto b = before.find(key);
  return a->second - (b == before.end() ? 0 : b->second);
}

}  // namespace

Scrape ParseScrape(absl::string_view text) {
  Scrape out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double v;
    if (!absl::SimpleAtod(line.substr(space + 1), &v)) continue;
    out[std::string(line.substr(0, space))] = v;
  }
  return out;
}

void FromMetrics(const Scrape& before, const Scrape& after, ModeResult* r) {
  for (const char* m : {"Forward", "Backward"}) {
    // Tensors over NCCL do not travel in messages: only the message-carrying methods count.
    r->wire_bytes +=
        Delta(before, after, absl::StrCat("moe_received_bytes_total{method=\"", m, "\"}"));
    r->wire_bytes += Delta(before, after, absl::StrCat("moe_sent_bytes_total{method=\"", m, "\"}"));
    for (const char* s : {"receive", "queue", "compute", "send"}) {
      double sum = 0, count = 0;
      // A call is one of the two (the transport picks), so their means combine by count.
      for (const std::string& method : {std::string(m), absl::StrCat("Nccl", m)}) {
        // prometheus-cpp writes labels in the order they were declared; try both orders.
        for (const std::string& labels :
             {absl::StrCat("{method=\"", method, "\",stage=\"", s, "\"}"),
              absl::StrCat("{stage=\"", s, "\",method=\"", method, "\"}")}) {
          sum += Delta(before, after, "moe_stage_duration_seconds_sum" + labels);
          count += Delta(before, after, "moe_stage_duration_seconds_count" + labels);
        }
      }
      if (count > 0) r->stage_mean[absl::StrCat(m, "/", s)] = sum / count;
    }
  }
}

namespace {

void Finalize(ModeResult* r) {
  r->tokens_per_second = r->seconds > 0 ? static_cast<double>(r->tokens) / r->seconds : 0;
}

// Runs `warmup` untimed then `timed` timed repetitions of the service side and the in-process
// side, alternating rep by rep: on shared cores the load drifts, and alternating exposes both
// sides to the same drift instead of giving one side the quiet minute. Each side's time is the
// sum of its own reps. The server's metrics are scraped around the whole loop; the in-process
// reps do not touch the server, so the differences are the service reps' alone.
// `prepare` runs before every service rep, outside its clock.
template <typename PrepareFn, typename ServiceFn, typename InprocFn>
absl::Status TimedPair(int warmup, int timed, int64_t tokens_per_rep, const std::string& metrics,
                       ModeResult* service, ModeResult* inproc, PrepareFn prepare,
                       ServiceFn service_once, InprocFn inproc_once) {
  for (int i = 0; i < warmup; ++i) {
    prepare();
    if (auto s = service_once(nullptr); !s.ok()) return s;
    if (auto s = inproc_once(nullptr); !s.ok()) return s;
  }
  Scrape before;
  if (!metrics.empty()) {
    auto s = ScrapeMetrics(metrics);
    if (!s.ok()) return s.status();
    before = std::move(*s);
  }
  for (int i = 0; i < timed; ++i) {
    prepare();
    Clock::time_point t0 = Clock::now();
    if (auto s = service_once(service); !s.ok()) return s;
    service->seconds += Since(t0);
    t0 = Clock::now();
    if (auto s = inproc_once(inproc); !s.ok()) return s;
    inproc->seconds += Since(t0);
  }
  for (ModeResult* r : {service, inproc}) {
    r->tokens = tokens_per_rep * timed;
    Finalize(r);
  }
  if (!metrics.empty()) {
    auto after = ScrapeMetrics(metrics);
    if (!after.ok()) return after.status();
    FromMetrics(before, *after, service);
  }
  return absl::OkStatus();
}

absl::Status CheckSame(const Tensor& service, const Tensor& inproc, const std::string& what) {
  if (service.shape != inproc.shape || service.dtype != inproc.dtype ||
      service.bytes != inproc.bytes) {
    return absl::InternalError(absl::StrCat(
        what, ": the service's inference output differs from the same engine's in process"));
  }
  return absl::OkStatus();
}

absl::Status CheckThroughput(const ModeResult& r, const std::string& what) {
  if (!(r.tokens_per_second > 0) || !std::isfinite(r.tokens_per_second)) {
    return absl::InternalError(
        absl::StrCat(what, ": zero throughput (", r.tokens, " tokens in ", r.seconds, " s)"));
  }
  return absl::OkStatus();
}

std::string CaseName(const BenchCase& c) {
  return absl::StrFormat("T=%d d=%d h=%d N=%d", c.tokens, c.d_model, c.d_hidden, c.in_flight);
}

}  // namespace

CopyPathCost MeasureCopyPath(int64_t rows, int64_t cols, int64_t chunk_bytes) {
  CopyPathCost c;
  Tensor src = Tensor::Zeros(DType::kFloat32, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i) src.as<float>()[i] = static_cast<float>(i % 977);
  c.bytes = static_cast<int64_t>(src.bytes.size());
  constexpr int kRuns = 3;
  auto best = [&](double* slot, auto fn) {
    *slot = 1e30;
    for (int i = 0; i < kRuns; ++i) {
      const Clock::time_point t0 = Clock::now();
      fn();
      *slot = std::min(*slot, Since(t0) * 1e3);
    }
  };
  std::vector<std::byte> warm(src.bytes.size());
  best(&c.memcpy_warm_ms, [&] { std::memcpy(warm.data(), src.bytes.data(), warm.size()); });
  best(&c.memcpy_fresh_ms, [&] {
    std::vector<std::byte> fresh(src.bytes.size());  // value-initialised: touched once, as
    std::memcpy(fresh.data(), src.bytes.data(), fresh.size());  // Tensor::Zeros does
    if (fresh[1] != src.bytes[1]) std::abort();
  });
  // The client's copy of a caller's tensor (client/connection.cc ToTensor), into a warm buffer.
  best(&c.client_copy_ms, [&] { ParallelMemcpy(warm.data(), src.bytes.data(), warm.size()); });
  // The same messages the client and the server write (wire/raw_message.h ChunkedMessages):
  // header repeated, the payload by reference.
  std::vector<Tensor> tensors;
  tensors.push_back(src);
  const wire::ChunkedMessages<v1::ForwardRequest> messages(
      std::move(tensors), {v1::ForwardRequest::kXFieldNumber}, chunk_bytes,
      [](v1::ForwardRequest* r) {
        r->set_layer("bench");
        return std::vector<v1::Tensor*>{r->mutable_x()};
      });
  std::vector<grpc::ByteBuffer> encoded(messages.size());
  best(&c.encode_ms, [&] {
    for (size_t m = 0; m < messages.size(); ++m) encoded[m] = messages.Build(m);
  });
  // Decoding each message and adding its bytes, as a receiver does: the server's Forward
  // (claimed size reserved once an eighth has arrived; it stops there) and the client's
  // receivers (claimed size reserved at once, then Finish).
  const std::vector<int> fields = {v1::ForwardRequest::kXFieldNumber};
  auto receive = [&](wire::TensorAssembler& x) {
    wire::IncomingMessage in;
    v1::ForwardRequest header;
    for (const grpc::ByteBuffer& e : encoded) {
      grpc::ByteBuffer buffer = e;  // more references, no bytes: Decode takes the buffer
      if (!in.Decode(&buffer, fields, &header, "bench").ok()) std::abort();
      if (!x.Add(header.x(), in.payload(v1::ForwardRequest::kXFieldNumber)).ok()) std::abort();
    }
  };
  best(&c.server_receive_ms, [&] {
    wire::TensorAssembler x("x", wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived);
    receive(x);
  });
  absl::StatusOr<Tensor> out;
  best(&c.client_receive_ms, [&] {
    out = absl::StatusOr<Tensor>();  // freed outside the timed region, as the caller would
    wire::TensorAssembler x("x", wire::TensorAssembler::Sizing::kClaimedAtOnce);
    receive(x);
    out = x.Finish();
  });
  if (!out.ok() || out->bytes != src.bytes) std::abort();  // the round trip must be exact
  return c;
}

double Percentile(std::vector<double> v, double pct) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(pct / 100.0 * static_cast<double>(v.size())));
  rank = std::clamp<size_t>(rank, 1, v.size());
  return v[rank - 1];
}

absl::StatusOr<std::vector<BenchCase>> ParseCases(const std::string& text) {
  std::vector<BenchCase> cases;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> f = absl::StrSplit(item, 'x');
    BenchCase c;
    int64_t n = 0;
    if (f.size() != 4 || !absl::SimpleAtoi(f[0], &c.tokens) ||
        !absl::SimpleAtoi(f[1], &c.d_model) || !absl::SimpleAtoi(f[2], &c.d_hidden) ||
        !absl::SimpleAtoi(f[3], &n) || c.tokens <= 0 || c.d_model <= 0 || c.d_hidden <= 0 ||
        n <= 0 || n > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cases: \"", item, "\" is not TxDxHxN with positive T, d, h and 1 <= N <= 1024"));
    }
    c.in_flight = static_cast<int>(n);
    cases.push_back(c);
  }
  if (cases.empty()) return absl::InvalidArgumentError("cases: no case given");
  return cases;
}

std::string InprocessDevice(const BenchOptions& options) {
  if (!options.inprocess_device.empty()) return options.inprocess_device;
  return options.client_device != "cpu" ? options.client_device : options.device;
}

server::ServerOptions OwnServerOptions(const BenchOptions& options) {
  server::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.metrics_port = 0;
  so.device = options.device;
  so.context_budget_bytes = int64_t{16} << 30;  // the bench bounds what it keeps itself
  so.max_message_bytes = std::max<int64_t>(so.max_message_bytes, 2 * options.chunk_bytes);
  return so;
}

absl::StatusOr<int> CheckOptions(const BenchOptions& options) {
  if (options.cases.empty()) return absl::InvalidArgumentError("cases: no case given");
  if (options.steps <= 0) return absl::InvalidArgumentError("steps: must be positive");
  if (options.inference_rounds <= 0) {
    return absl::InvalidArgumentError("inference_rounds: must be positive");
  }
  if (options.warmup_steps < 0) return absl::InvalidArgumentError("warmup_steps: must be >= 0");
  if (options.chunk_bytes <= 0) return absl::InvalidArgumentError("chunk_bytes: must be positive");
  if (options.connections < 1) return absl::InvalidArgumentError("connections: must be >= 1");
  if (options.stripe_bytes < 0) return absl::InvalidArgumentError("stripe_bytes: must be >= 0");
  if (wire::UsesTls(options.tls) && options.server.empty() && options.servers.empty()) {
    return absl::InvalidArgumentError("tls: only for a --server (the bench's own is plaintext)");
  }
  // Where the trainer's tensors live: -1 host memory, else a GPU.
  int client_gpu = -1;
  if (options.client_device != "cpu") {
    if (!absl::StartsWith(options.client_device, "cuda:") ||
        !absl::SimpleAtoi(absl::string_view(options.client_device).substr(5), &client_gpu) ||
        client_gpu < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "client_device: \"", options.client_device, "\" is not cpu or cuda:N"));
    }
    if (!CudaBuilt()) {
      return absl::InvalidArgumentError(
          "client_device: this moe-service-bench was built without CUDA");
    }
  }
  if (options.transport == BenchTransport::kCudaIpc && client_gpu < 0) {
    return absl::InvalidArgumentError(
        "client_device: transport cuda_ipc moves the trainer's device tensors; name its GPU "
        "(cuda:N)");
  }
  if (options.transport == BenchTransport::kNccl && client_gpu < 0) {
    return absl::InvalidArgumentError(
        "client_device: transport nccl moves the trainer's device tensors; name its GPU (cuda:N)");
  }
  return client_gpu;
}

client::ClientOptions BenchClientOptions(const BenchOptions& options) {
  client::ClientOptions co;
  co.timeout = std::chrono::seconds(options.timeout_seconds);
  co.chunk_bytes = options.chunk_bytes;
  co.connections = options.connections;
  co.stripe_bytes = options.stripe_bytes;
  co.tls = options.tls;
  co.token = options.token;
  co.transport = options.transport == BenchTransport::kTcp ||
                         options.transport == BenchTransport::kNccl
                     ? client::Transport::kTcp
                     : client::Transport::kSharedMemory;
  co.device_transport = options.transport == BenchTransport::kNccl
                            ? client::DeviceTransportRequest::kNccl
                            : client::DeviceTransportRequest::kNever;
  return co;
}

absl::StatusOr<std::vector<CaseResult>> RunServiceBench(const BenchOptions& options,
                                                        std::string* server_description) {
  absl::StatusOr<int> gpu = CheckOptions(options);
  if (!gpu.ok()) return gpu.status();
  const int client_gpu = *gpu;
  if (client_gpu >= 0 && !absl::StartsWith(InprocessDevice(options), "cuda")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "client_device: device tensors need a GPU engine for the in-process baseline (it is ",
        InprocessDevice(options), ")"));
  }
  if (options.transport == BenchTransport::kCudaIpc && options.server.empty()) {
    return absl::InvalidArgumentError(
        "server: transport cuda_ipc needs the server in another process (CUDA IPC cannot open "
        "a handle in the process that made it)");
  }

  // The server: a running one, or one started here on loopback with free ports.
  std::unique_ptr<server::Server> own_server;
  std::string target = options.server, metrics = options.metrics;
  if (target.empty()) {
    auto s = server::Server::Start(OwnServerOptions(options));
    if (!s.ok()) return s.status();
    own_server = std::move(*s);
    target = absl::StrCat("127.0.0.1:", own_server->port());
    metrics = absl::StrCat("127.0.0.1:", own_server->metrics_port());
    *server_description =
        absl::StrCat("in-process moe-server (", own_server->device(), ") on loopback ", target);
  } else {
    *server_description = absl::StrCat("moe-server at ", target);
  }

  const client::ClientOptions co = BenchClientOptions(options);
  auto conn = client::Connection::Connect(target, co);
  if (!conn.ok()) return conn.status();
  auto engine = CreateEngine(InprocessDevice(options));
  if (!engine.ok()) return engine.status();

  std::vector<CaseResult> results;
  std::mt19937_64 rng(options.layer.seed + 12345);
  for (size_t ci = 0; ci < options.cases.size(); ++ci) {
    const BenchCase& c = options.cases[ci];
    const std::string what = CaseName(c);
    LayerConfig cfg = options.layer;
    cfg.d_model = c.d_model;
    cfg.d_hidden = c.d_hidden;
    if (auto s = ValidateLayerConfig(cfg); !s.ok()) return s;
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < c.in_flight; ++i) mbs.push_back(MakeMicroBatch(cfg, c.tokens, rng));
    const int64_t tokens_per_rep = c.tokens * c.in_flight;

    const std::string name = absl::StrCat("service-bench-", ::getpid(), "-", ci);
    auto remote = client::RemoteLayer::Create(*conn, name, cfg);
    if (!remote.ok()) return remote.status();
    auto local = (*engine)->CreateLayer(cfg);
    if (!local.ok()) return local.status();
    CaseResult cr;
    cr.c = c;

    // The trainer: host tensors (lent, or handed over: each service rep gets fresh copies, made
    // before its clock starts), or device tensors on client_gpu.
    std::vector<MicroBatch> owned;
    std::vector<MicroBatch>* hand_over = options.hand_over ? &owned : nullptr;
    auto prepare = [&] {
      if (hand_over) owned = mbs;
    };
    std::unique_ptr<DeviceTensors> dev;
    // Runs before `dev` is freed, on every way out of the case: the server maps each device
    // block while its region is registered, and CUDA leaves freeing memory that another process
    // still has open undefined, so the case's regions are unregistered first (no call is in
    // flight then: a failed step waits for the rest, trainers.cc).
    absl::Cleanup unregister_regions = [&] {
      if (dev) (*conn)->ReleaseIdleDeviceRegions().IgnoreError();
    };
    ServiceTrainer service;
    InprocTrainer inproc;
    if (client_gpu >= 0) {
      auto d = DeviceTensors::Upload(client_gpu, mbs);
      if (!d.ok()) return d.status();
      dev = std::move(*d);
      service = DeviceService(**remote, *dev);
      inproc = DeviceInproc(*dev);
    } else {
      service = HostService(**remote, mbs, hand_over);
      inproc = HostInproc(mbs);
    }

    // Both fresh layers from the same config and seed: the outputs must be identical.
    {
      prepare();
      auto svc = service.forward(0, false).get();
      if (!svc.ok()) return svc.status();
      if (auto s = service.finish(); !s.ok()) return s;
      Tensor service_out = std::move(svc->out);
      if (dev) {
        auto out = dev->DownloadOut(0);
        if (!out.ok()) return out.status();
        service_out = std::move(*out);
      }
      auto loc = (*local)->Forward(inproc.forward(0, false));
      if (!loc.ok()) return loc.status();
      Tensor inproc_out = std::move(loc->out);
      if (dev) {
        auto out = dev->DownloadOut(0);
        if (!out.ok()) return out.status();
        inproc_out = std::move(*out);
      }
      if (auto s = CheckSame(service_out, inproc_out, what); !s.ok()) return s;
    }

    absl::Status st = TimedPair(
        options.warmup_steps, options.inference_rounds, tokens_per_rep, metrics, &cr.service_infer,
        &cr.inproc_infer, prepare,
        [&](ModeResult* r) { return ServiceInferRound(service, mbs, r); },
        [&](ModeResult* r) { return InprocInferRound(**local, inproc, mbs.size(), r); });
    if (st.ok()) {
      st = TimedPair(
          options.warmup_steps, options.steps, tokens_per_rep, metrics, &cr.service_train,
          &cr.inproc_train, prepare,
          [&](ModeResult* r) {
            return ServiceTrainStep(**remote, service, mbs, options.optimizer_step, r);
          },
          [&](ModeResult* r) {
            return InprocTrainStep(**local, inproc, mbs.size(), options.optimizer_step, r);
          });
    }
    absl::Status del = (*conn)->DeleteLayer(name);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
    if (!del.ok()) return del;
    for (auto [r, mode] : {std::pair{&cr.service_infer, "service inference"},
                           std::pair{&cr.inproc_infer, "in-process inference"},
                           std::pair{&cr.service_train, "service training"},
                           std::pair{&cr.inproc_train, "in-process training"}}) {
      if (auto s = CheckThroughput(*r, absl::StrCat(what, " ", mode)); !s.ok()) return s;
    }
    // A connection that could not open its NCCL channel staged the tensors instead (and logged
    // why): its numbers are not NCCL's.
    if (options.transport == BenchTransport::kNccl &&
        (*conn)->device_transport() != client::DeviceTransport::kNccl) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport nccl: the connection moved device tensors ",
          client::DeviceTransportName((*conn)->device_transport()), ", not over NCCL"));
    }
    results.push_back(std::move(cr));
  }
  return results;
}

const char* BenchTransportName(BenchTransport transport) {
  switch (transport) {
    case BenchTransport::kTcp:
      return "tcp";
    case BenchTransport::kSharedMemory:
      return "shm";
    case BenchTransport::kCudaIpc:
      return "cuda_ipc";
    case BenchTransport::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::Status AppendJson(const std::vector<CaseResult>& results, const BenchOptions& options,
                        const std::string& server_device, const std::string& path) {
  std::ofstream f(path, std::ios::app);
  if (!f) {
    return absl::InvalidArgumentError(
        absl::StrCat("json: cannot open ", path, ": ", std::strerror(errno)));
  }
  for (const CaseResult& r : results) {
    for (auto [svc, loc, mode] : {std::tuple{&r.service_train, &r.inproc_train, "train"},
                                  std::tuple{&r.service_infer, &r.inproc_infer, "infer"}}) {
      nlohmann::json j;
      j["transport"] = BenchTransportName(options.transport);
      j["servers"] = std::max<size_t>(1, options.servers.size());
      j["optimizer_step"] = options.optimizer_step;
      j["tokens"] = r.c.tokens;
      j["d_model"] = r.c.d_model;
      j["d_hidden"] = r.c.d_hidden;
      j["experts"] = options.layer.num_experts;
      j["top_k"] = options.layer.top_k;
      j["in_flight"] = r.c.in_flight;
      j["mode"] = mode;
      j["dtype"] = DTypeName(options.layer.dtype);
      j["routing"] = options.layer.routing == RoutingMode::kClient ? "client" : "server";
      j["server_device"] = server_device;
      j["client_device"] = options.client_device;
      j["in_process_device"] = InprocessDevice(options);
      // A run without an in-process side (sharded) leaves its mode empty: null, not zero.
      const bool inproc = loc->tokens > 0;
      auto or_null = [inproc](double v) { return inproc ? nlohmann::json(v) : nlohmann::json(); };
      j["service_tok_s"] = svc->tokens_per_second;
      j["in_process_tok_s"] = or_null(loc->tokens_per_second);
      j["ratio"] = or_null(svc->tokens_per_second / loc->tokens_per_second);
      j["service_fwd_p50_ms"] = Percentile(svc->forward_latency, 50) * 1e3;
      j["in_process_fwd_p50_ms"] = or_null(Percentile(loc->forward_latency, 50) * 1e3);
      if (std::string(mode) == "train") {
        j["service_bwd_p50_ms"] = Percentile(svc->backward_latency, 50) * 1e3;
        j["in_process_bwd_p50_ms"] = or_null(Percentile(loc->backward_latency, 50) * 1e3);
      }
      f << j.dump() << "\n";
    }
  }
  f.flush();
  if (!f) return absl::InternalError(absl::StrCat("json: writing ", path, " failed"));
  return absl::OkStatus();
}

std::string FormatResults(const std::vector<CaseResult>& results) {
  auto ms = [](double s) { return absl::StrFormat("%.2f", s * 1e3); };
  std::string out =
      "| T | d | h | N | mode | service tok/s | in-process tok/s | service/in-process | "
      "wire MB/s | payload MB/s | fwd p50 ms | fwd p99 ms | bwd p50 ms | bwd p99 ms | "
      "in-proc fwd p50 ms | in-proc bwd p50 ms |\n"
      "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const CaseResult& r : results) {
    for (auto [svc, loc, mode] : {std::tuple{&r.service_train, &r.inproc_train, "train"},
                                  std::tuple{&r.service_infer, &r.inproc_infer, "infer"}}) {
      const bool train = std::string(mode) == "train";
      // No in-process side (a sharded run): "-".
      const bool inproc = loc->tokens > 0;
      auto num = [inproc](const char* format, double v) {
        return inproc ? absl::StrFormat(format, v) : std::string("-");
      };
      absl::StrAppendFormat(
          &out,
          "| %d | %d | %d | %d | %s | %.0f | %s | %s | %s | %.1f | %s | %s | %s | %s | %s | "
          "%s |\n",
          r.c.tokens, r.c.d_model, r.c.d_hidden, r.c.in_flight, mode, svc->tokens_per_second,
          num("%.0f", loc->tokens_per_second),
          num("%.2f", svc->tokens_per_second / loc->tokens_per_second),
          // No metrics endpoint (--server without --metrics): the wire bytes are unknown.
          svc->wire_bytes > 0 ? absl::StrFormat("%.1f", svc->wire_bytes / svc->seconds / 1e6)
                              : std::string("-"),
          svc->payload_bytes / svc->seconds / 1e6, ms(Percentile(svc->forward_latency, 50)),
          ms(Percentile(svc->forward_latency, 99)),
          train ? ms(Percentile(svc->backward_latency, 50)) : "-",
          train ? ms(Percentile(svc->backward_latency, 99)) : "-",
          inproc ? ms(Percentile(loc->forward_latency, 50)) : "-",
          inproc && train ? ms(Percentile(loc->backward_latency, 50)) : "-");
    }
  }
  out +=
      "\nServer stages, mean ms per micro-batch (from /metrics), next to the engine's own time in "
      "process:\n\n"
      "| T | d | h | N | mode | method | receive | queue | compute | send | in-process compute |\n"
      "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|\n";
  for (const CaseResult& r : results) {
    for (auto [svc, loc, mode] : {std::tuple{&r.service_train, &r.inproc_train, "train"},
                                  std::tuple{&r.service_infer, &r.inproc_infer, "infer"}}) {
      for (const char* m : {"Forward", "Backward"}) {
        if (!svc->stage_mean.count(absl::StrCat(m, "/compute"))) continue;
        auto stage = [&](const char* s) {
          auto it = svc->stage_mean.find(absl::StrCat(m, "/", s));
          return it == svc->stage_mean.end() ? std::string("-") : ms(it->second);
        };
        const std::vector<double>& lat =
            std::string(m) == "Forward" ? loc->forward_latency : loc->backward_latency;
        double mean = 0;
        for (double v : lat) mean += v / static_cast<double>(lat.size());
        absl::StrAppendFormat(&out, "| %d | %d | %d | %d | %s | %s | %s | %s | %s | %s | %s |\n",
                              r.c.tokens, r.c.d_model, r.c.d_hidden, r.c.in_flight, mode, m,
                              stage("receive"), stage("queue"), stage("compute"), stage("send"),
                              ms(mean));
      }
    }
  }
  return out;
}

}  // namespace moe::bench
