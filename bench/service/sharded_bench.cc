// moe-service-bench over several running servers as one sharded layer (see sharded_bench.h).
#include "bench/service/sharded_bench.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/service/device_tensors.h"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;

// `warmup` untimed then `timed` timed repetitions of `once`; r gets the time and throughput.
template <typename Once>
absl::Status Timed(int warmup, int timed, int64_t tokens_per_rep, ModeResult* r, Once once) {
  for (int i = 0; i < warmup; ++i) {
    if (absl::Status st = once(nullptr); !st.ok()) return st;
  }
  for (int i = 0; i < timed; ++i) {
    const Clock::time_point t0 = Clock::now();
    if (absl::Status st = once(r); !st.ok()) return st;
    r->seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  r->tokens = tokens_per_rep * timed;
  r->tokens_per_second = r->seconds > 0 ? static_cast<double>(r->tokens) / r->seconds : 0;
  if (!(r->tokens_per_second > 0) || !std::isfinite(r->tokens_per_second)) {
    return absl::InternalError(
        absl::StrCat("zero throughput (", r->tokens, " tokens in ", r->seconds, " s)"));
  }
  return absl::OkStatus();
}

// The first inference Forward of micro-batch 0 through `service`, against the same layer's host
// path: bitwise equal, or an error.
absl::Status CheckFirstForward(client::ShardedLayer& layer, const ServiceTrainer& service,
                               const MicroBatch& mb, const DeviceTensors* dev) {
  absl::StatusOr<client::ForwardOutput> got = service.forward(0, false).get();
  if (!got.ok()) return got.status();
  if (absl::Status st = service.finish(); !st.ok()) return st;
  Tensor out = std::move(got->out);
  if (dev != nullptr) {
    absl::StatusOr<Tensor> o = dev->DownloadOut(0);
    if (!o.ok()) return o.status();
    out = *std::move(o);
  }
  absl::StatusOr<client::ForwardOutput> host =
      layer.Forward(mb.x.view(), mb.ids.view(), mb.weights.view(), /*training=*/false).get();
  if (!host.ok()) return host.status();
  if (out.shape != host->out.shape || out.bytes != host->out.bytes) {
    return absl::InternalError(
        "the sharded layer's output on the trainer's tensors differs from its host path's");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseServers(const std::string& text) {
  std::vector<std::string> servers;
  std::set<std::string> seen;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    const std::string item(absl::StripAsciiWhitespace(raw));
    // The port follows the last ':'; an IPv6 host is bracketed.
    const size_t colon = item.rfind(':');
    const std::string host = colon == std::string::npos ? "" : item.substr(0, colon);
    int port = 0;
    const bool v6 = !host.empty() && host.front() == '[';
    if (colon == std::string::npos || host.empty() ||
        (v6 ? host.back() != ']' || host.size() < 3 : host.find(':') != std::string::npos) ||
        !absl::SimpleAtoi(item.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("servers: \"", item, "\" is not HOST:PORT (a port of 1 to 65535)"));
    }
    if (!seen.insert(item).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "servers: \"", item, "\" is named twice (each server holds one shard of the layer)"));
    }
    servers.push_back(item);
  }
  if (servers.empty()) return absl::InvalidArgumentError("servers: no server given");
  return servers;
}

ServiceTrainer ShardedHostService(client::ShardedLayer& layer, const std::vector<MicroBatch>& mbs) {
  ServiceTrainer t;
  t.forward = [&layer, &mbs](size_t i, bool training) {
    return layer.Forward(mbs[i].x.view(), mbs[i].ids.view(), mbs[i].weights.view(), training);
  };
  t.backward = [&layer, &mbs](size_t i, uint64_t ctx) {
    return layer.Backward(ctx, mbs[i].dout.view());
  };
  t.step = [&layer] { return layer.Step().status(); };
  return t;
}

absl::StatusOr<std::vector<CaseResult>> RunShardedBench(const BenchOptions& options,
                                                        std::string* server_description) {
  absl::StatusOr<int> gpu = CheckOptions(options);
  if (!gpu.ok()) return gpu.status();
  const int client_gpu = *gpu;
  if (options.servers.size() < 2) {
    return absl::InvalidArgumentError("servers: a sharded run needs two or more");
  }
  if (!options.server.empty()) {
    return absl::InvalidArgumentError("server: give --servers or --server, not both");
  }
  if (options.layer.routing != RoutingMode::kClient) {
    return absl::InvalidArgumentError(
        "routing: --servers shards the layer, which needs client routing");
  }
  if (options.layer.dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(
        "dtype: --servers shards the layer, whose partial outputs are summed in float32");
  }
  if (options.hand_over) {
    return absl::InvalidArgumentError("hand_over: a sharded layer lends its tensors");
  }
  const client::ClientOptions co = BenchClientOptions(options);
  std::vector<std::shared_ptr<client::Connection>> conns;
  for (const std::string& target : options.servers) {
    absl::StatusOr<std::shared_ptr<client::Connection>> c =
        client::Connection::Connect(target, co);
    if (!c.ok()) return c.status();
    conns.push_back(*std::move(c));
  }
  *server_description = absl::StrCat(options.servers.size(), " moe-servers at ",
                                     absl::StrJoin(options.servers, ","), " (one sharded layer)");

  std::vector<CaseResult> results;
  std::mt19937_64 rng(options.layer.seed + 12345);  // the micro-batches of every other run
  for (size_t ci = 0; ci < options.cases.size(); ++ci) {
    const BenchCase& c = options.cases[ci];
    const std::string what = absl::StrCat("T=", c.tokens, " d=", c.d_model, " h=", c.d_hidden,
                                          " N=", c.in_flight);
    LayerConfig cfg = options.layer;
    cfg.d_model = c.d_model;
    cfg.d_hidden = c.d_hidden;
    if (absl::Status s = ValidateLayerConfig(cfg); !s.ok()) return s;
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < c.in_flight; ++i) mbs.push_back(MakeMicroBatch(cfg, c.tokens, rng));
    const int64_t tokens_per_rep = c.tokens * c.in_flight;

    const std::string name = absl::StrCat("service-bench-", ::getpid(), "-", ci);
    absl::StatusOr<std::unique_ptr<client::ShardedLayer>> layer =
        client::ShardedLayer::Create(conns, name, cfg);
    if (!layer.ok()) return layer.status();
    std::unique_ptr<DeviceTensors> dev;
    ServiceTrainer service;
    if (client_gpu >= 0) {
      absl::StatusOr<std::unique_ptr<DeviceTensors>> d = DeviceTensors::Upload(client_gpu, mbs);
      if (!d.ok()) return d.status();
      dev = *std::move(d);
      service = DeviceService(**layer, *dev);
    } else {
      service = ShardedHostService(**layer, mbs);
    }
    CaseResult cr;
    cr.c = c;
    absl::Status st = CheckFirstForward(**layer, service, mbs[0], dev.get());
    if (st.ok()) {
      st = Timed(options.warmup_steps, options.inference_rounds, tokens_per_rep,
                 &cr.service_infer,
                 [&](ModeResult* r) { return ServiceInferRound(service, mbs, r); });
    }
    if (st.ok()) {
      st = Timed(options.warmup_steps, options.steps, tokens_per_rep, &cr.service_train,
                 [&](ModeResult* r) {
                   return ServiceTrainStep(service, mbs, options.optimizer_step, r);
                 });
    }
    // The layer's device buffers go before the servers forget the layer.
    layer->reset();
    absl::Status del;
    for (const auto& conn : conns) {
      if (absl::Status d = conn->DeleteLayer(name); del.ok()) del = d;
    }
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
    if (!del.ok()) return del;
    // A connection that could not open its NCCL channel staged the tensors instead (and logged
    // why): its numbers are not NCCL's.
    for (size_t i = 0; i < conns.size(); ++i) {
      if (options.transport == BenchTransport::kNccl &&
          conns[i]->device_transport() != client::DeviceTransport::kNccl) {
        return absl::FailedPreconditionError(absl::StrCat(
            "transport nccl: the connection to ", options.servers[i], " moved device tensors ",
            client::DeviceTransportName(conns[i]->device_transport()), ", not over NCCL"));
      }
    }
    results.push_back(std::move(cr));
  }
  return results;
}

}  // namespace moe::bench
