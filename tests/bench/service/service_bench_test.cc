// Tests of moe-service-bench's measurement core (bench/service/service_bench.h): a tiny sweep
// against a real server started on loopback gives positive throughput, latencies, wire bytes and
// server stage times for both modes, also through a TLS server; a training step without the
// optimizer step; the server's stage metrics of NCCL calls count under their method; bad options
// and cases fail naming the field; percentiles are nearest-rank.
#include "bench/service/service_bench.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"
#include "server/server.h"

namespace moe::bench {
namespace {

BenchOptions Tiny() {
  BenchOptions o;
  o.layer.num_experts = 4;
  o.layer.top_k = 2;
  o.cases = {{48, 16, 8, 2}};
  o.steps = 2;
  o.inference_rounds = 2;
  o.chunk_bytes = 512;  // several chunks per micro-batch
  return o;
}

TEST(ServiceBenchTest, TinySweepMeasuresBothSidesThroughARealServer) {
  // Client and server routing lending views, and client routing handing its tensors over.
  for (auto [routing, hand_over] :
       {std::pair{RoutingMode::kClient, false}, std::pair{RoutingMode::kServer, false},
        std::pair{RoutingMode::kClient, true}}) {
    BenchOptions o = Tiny();
    o.layer.routing = routing;
    o.hand_over = hand_over;
    std::string where;
    auto results = RunServiceBench(o, &where);
    ASSERT_TRUE(results.ok()) << results.status() << " routing " << static_cast<int>(routing)
                              << " hand_over " << hand_over;
    EXPECT_NE(where.find("loopback"), std::string::npos) << where;
    ASSERT_EQ(results->size(), 1u);
    const CaseResult& r = (*results)[0];
    for (const ModeResult* m :
         {&r.service_train, &r.inproc_train, &r.service_infer, &r.inproc_infer}) {
      EXPECT_GT(m->tokens_per_second, 0);
      EXPECT_EQ(m->tokens, 48 * 2 * 2);
    }
    // 2 steps x 2 micro-batches: one latency per call.
    EXPECT_EQ(r.service_train.forward_latency.size(), 4u);
    EXPECT_EQ(r.service_train.backward_latency.size(), 4u);
    EXPECT_EQ(r.service_infer.forward_latency.size(), 4u);
    EXPECT_TRUE(r.service_infer.backward_latency.empty());
    // The payload the client counted: Forward x + out (+ ids/weights), Backward dout + dx, each
    // [48, 16] fp32 = 3072 bytes; the serialized bytes on the wire can only be more.
    EXPECT_GE(r.service_train.payload_bytes, 4 * (4 * 3072.0));
    EXPECT_GE(r.service_train.wire_bytes, r.service_train.payload_bytes);
    EXPECT_GE(r.service_infer.wire_bytes, r.service_infer.payload_bytes);
    for (const char* key : {"Forward/receive", "Forward/queue", "Forward/compute", "Forward/send",
                            "Backward/compute"}) {
      EXPECT_TRUE(r.service_train.stage_mean.count(key)) << key;
    }
    EXPECT_FALSE(r.service_infer.stage_mean.count("Backward/compute"));
    const std::string table = FormatResults(*results);
    EXPECT_NE(table.find("| 48 | 16 | 8 | 2 | train |"), std::string::npos) << table;
    EXPECT_NE(table.find("| 48 | 16 | 8 | 2 | infer |"), std::string::npos) << table;
  }
}

TEST(ServiceBenchTest, BadOptionsNameTheField) {
  std::string where;
  BenchOptions o = Tiny();
  o.steps = 0;
  auto r = RunServiceBench(o, &where);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("steps"), std::string::npos) << r.status();

  o = Tiny();
  o.layer.top_k = 9;  // more than E
  r = RunServiceBench(o, &where);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("top_k"), std::string::npos) << r.status();

  o = Tiny();
  o.device = "tpu";
  r = RunServiceBench(o, &where);
  EXPECT_FALSE(r.ok());
}

// --tls_ca_file: the same measurement against a separate server that speaks TLS; TLS without
// --server names the option.
TEST(ServiceBenchTest, MeasuresThroughATlsServer) {
  server::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.metrics_port = 0;
  so.device = "cpu";
  so.tls.cert_file = std::string(MOE_TLS_TESTDATA) + "/server.pem";
  so.tls.key_file = std::string(MOE_TLS_TESTDATA) + "/server-key.pem";
  auto s = server::Server::Start(so);
  ASSERT_TRUE(s.ok()) << s.status();
  BenchOptions o = Tiny();
  o.server = absl::StrCat("127.0.0.1:", (*s)->port());
  o.metrics = absl::StrCat("127.0.0.1:", (*s)->metrics_port());
  o.tls.ca_file = std::string(MOE_TLS_TESTDATA) + "/ca.pem";
  std::string where;
  auto results = RunServiceBench(o, &where);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_GT((*results)[0].service_train.tokens_per_second, 0);
  EXPECT_GT((*results)[0].service_train.wire_bytes, 0);

  o.server.clear();
  auto r = RunServiceBench(o, &where);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("tls"), std::string::npos) << r.status();
}

// BenchOptions::optimizer_step = false: a training step is its Forwards and Backwards alone, so
// the server sees no optimizer step; with it, each service training step steps once.
TEST(ServiceBenchTest, TheOptimizerStepCanBeLeftOut) {
  for (bool optimizer_step : {true, false}) {
    server::ServerOptions so;
    so.host = "127.0.0.1";
    so.port = 0;
    so.metrics_port = 0;
    so.device = "cpu";
    auto s = server::Server::Start(so);
    ASSERT_TRUE(s.ok()) << s.status();
    BenchOptions o = Tiny();
    o.server = absl::StrCat("127.0.0.1:", (*s)->port());
    o.metrics = absl::StrCat("127.0.0.1:", (*s)->metrics_port());
    o.optimizer_step = optimizer_step;
    std::string where;
    auto results = RunServiceBench(o, &where);
    ASSERT_TRUE(results.ok()) << results.status() << " optimizer_step " << optimizer_step;
    EXPECT_GT((*results)[0].service_train.tokens_per_second, 0);
    // Step calls the server finished (moe_requests_total{method="Step"}, every code).
    double steps = 0;
    for (const prometheus::MetricFamily& family : (*s)->metrics().registry()->Collect()) {
      if (family.name != "moe_requests_total") continue;
      for (const prometheus::ClientMetric& m : family.metric) {
        for (const prometheus::ClientMetric::Label& l : m.label) {
          if (l.name == "method" && l.value == "Step") steps += m.counter.value;
        }
      }
    }
    EXPECT_EQ(steps, optimizer_step ? o.warmup_steps + o.steps : 0)
        << "optimizer_step " << optimizer_step;
  }
}

TEST(ServiceBenchTest, ParseCases) {
  auto c = ParseCases("512x256x128x4, 8x8x8x1");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->size(), 2u);
  EXPECT_EQ((*c)[0].tokens, 512);
  EXPECT_EQ((*c)[0].d_model, 256);
  EXPECT_EQ((*c)[0].d_hidden, 128);
  EXPECT_EQ((*c)[0].in_flight, 4);
  EXPECT_EQ((*c)[1].in_flight, 1);
  for (const char* bad : {"", "512x256x128", "512x256x128x0", "ax1x1x1", "1x1x1x1x1", "-1x1x1x1"}) {
    auto r = ParseCases(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("cases"), std::string::npos) << bad;
  }
}

TEST(ServiceBenchTest, StageMeansCountNcclCallsUnderTheirMethod) {
  // The server's own metrics, serialized as /metrics serves them.
  server::Metrics metrics("cpu");
  auto scrape = [&] {
    return ParseScrape(prometheus::TextSerializer().Serialize(metrics.registry()->Collect()));
  };
  metrics.Stage("Forward", "compute", 1.0);  // before the phase: not counted
  const Scrape before = scrape();
  metrics.Stage("NcclForward", "compute", 0.004);
  metrics.Stage("NcclForward", "compute", 0.006);
  metrics.Stage("Forward", "compute", 0.008);
  metrics.Stage("NcclBackward", "receive", 0.002);
  metrics.BytesIn("NcclForward", 1000);  // control messages only: not tensor bytes
  metrics.BytesIn("Forward", 300);
  ModeResult r;
  FromMetrics(before, scrape(), &r);
  ASSERT_TRUE(r.stage_mean.count("Forward/compute"));
  EXPECT_NEAR(r.stage_mean["Forward/compute"], (0.004 + 0.006 + 0.008) / 3, 1e-12);
  EXPECT_NEAR(r.stage_mean["Backward/receive"], 0.002, 1e-12);
  EXPECT_FALSE(r.stage_mean.count("Backward/compute"));
  EXPECT_FALSE(r.stage_mean.count("Forward/send"));
  EXPECT_DOUBLE_EQ(r.wire_bytes, 300);
}

TEST(ServiceBenchTest, PercentileIsNearestRank) {
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({3, 1, 2}, 50), 2);
  EXPECT_EQ(Percentile({3, 1, 2}, 99), 3);
  EXPECT_EQ(Percentile({3, 1, 2}, 0), 1);
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  EXPECT_EQ(Percentile(v, 99), 99);
  EXPECT_EQ(Percentile(v, 50), 50);
}

}  // namespace
}  // namespace moe::bench
