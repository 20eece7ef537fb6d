// moe-service-bench --servers (bench/service/sharded_bench.h): the list is parsed strictly, each
// bad entry refused naming the flag and the entry; a tiny sweep over two real servers on loopback
// (CPU engines, host tensors) measures both modes through one sharded layer and reports no
// in-process side (null in the JSON, "-" in the table), and what a sharded run cannot do is
// refused naming the flag.
#include "bench/service/sharded_bench.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "server/server.h"

namespace moe::bench {
namespace {

TEST(ShardedBenchTest, ParseServersTakesHostPortLists) {
  auto s = ParseServers("10.0.0.1:50051, gpu-b:50052,[::1]:7");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, (std::vector<std::string>{"10.0.0.1:50051", "gpu-b:50052", "[::1]:7"}));
  s = ParseServers("localhost:1");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->size(), 1u);
}

TEST(ShardedBenchTest, ParseServersRefusesBadEntriesNamingThem) {
  for (const std::string bad : {"", "a", "a:", ":5", "a:0", "a:65536", "a:b", "a:1,", "a:1,,b:2",
                                "::1:5", "[::1:5", "a:1,a:1"}) {
    auto s = ParseServers(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << "\"" << bad << "\"";
    EXPECT_EQ(s.status().message().rfind("servers: ", 0), 0u) << s.status();
  }
  EXPECT_NE(ParseServers("a:1,b:x").status().message().find("\"b:x\""), std::string::npos);
  EXPECT_NE(ParseServers("a:1,a:1").status().message().find("twice"), std::string::npos);
}

class ShardedBenchRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      server::ServerOptions so;
      so.host = "127.0.0.1";
      so.port = 0;
      so.metrics_port = -1;
      so.device = "cpu";
      auto s = server::Server::Start(so);
      ASSERT_TRUE(s.ok()) << s.status();
      options_.servers.push_back(absl::StrCat("127.0.0.1:", (*s)->port()));
      servers_.push_back(std::move(*s));
    }
    options_.layer.num_experts = 5;  // shards of 3 and 2 experts
    options_.layer.top_k = 2;
    options_.layer.routing = RoutingMode::kClient;
    options_.cases = {{40, 16, 8, 2}};
    options_.steps = 2;
    options_.inference_rounds = 2;
  }
  BenchOptions options_;
  std::vector<std::unique_ptr<server::Server>> servers_;
};

TEST_F(ShardedBenchRunTest, TwoServersMeasureBothModesWithoutAnInProcessSide) {
  std::string where;
  auto results = RunShardedBench(options_, &where);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_NE(where.find("2 moe-servers"), std::string::npos) << where;
  ASSERT_EQ(results->size(), 1u);
  const CaseResult& r = (*results)[0];
  for (const ModeResult* m : {&r.service_train, &r.service_infer}) {
    EXPECT_GT(m->tokens_per_second, 0);
    EXPECT_EQ(m->tokens, 40 * 2 * 2);
  }
  EXPECT_EQ(r.service_train.forward_latency.size(), 4u);
  EXPECT_EQ(r.service_train.backward_latency.size(), 4u);
  EXPECT_EQ(r.inproc_train.tokens, 0);
  EXPECT_EQ(r.inproc_infer.tokens, 0);
  const std::string table = FormatResults(*results);
  EXPECT_NE(table.find("| 40 | 16 | 8 | 2 | train |"), std::string::npos) << table;
  EXPECT_NE(table.find("| - | - |"), std::string::npos) << table;

  const std::string path = absl::StrCat(::testing::TempDir(), "/sharded_", ::getpid(), ".jsonl");
  ASSERT_TRUE(AppendJson(*results, options_, "", path).ok());
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j["servers"], 2) << line;
    EXPECT_TRUE(j["in_process_tok_s"].is_null()) << line;
    EXPECT_TRUE(j["ratio"].is_null()) << line;
    EXPECT_GT(j["service_tok_s"].get<double>(), 0) << line;
    ++lines;
  }
  EXPECT_EQ(lines, 2);
  ::unlink(path.c_str());
  // The servers forgot the layer once the case was done.
  for (const std::string& target : options_.servers) {
    auto conn = client::Connection::Connect(target);
    ASSERT_TRUE(conn.ok());
    auto layers = (*conn)->ListLayers();
    ASSERT_TRUE(layers.ok());
    EXPECT_TRUE(layers->empty());
  }
}

TEST_F(ShardedBenchRunTest, RefusesWhatAShardedLayerCannotDoNamingTheFlag) {
  std::string where;
  auto expect = [&](BenchOptions o, const std::string& field) {
    auto r = RunShardedBench(o, &where);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_EQ(r.status().message().rfind(field + ": ", 0), 0u) << r.status();
  };
  BenchOptions o = options_;
  o.layer.routing = RoutingMode::kServer;
  expect(o, "routing");
  o = options_;
  o.layer.dtype = DType::kBFloat16;
  expect(o, "dtype");
  o = options_;
  o.servers.pop_back();
  expect(o, "servers");
  o = options_;
  o.server = "127.0.0.1:1";
  expect(o, "server");
  o = options_;
  o.hand_over = true;
  expect(o, "hand_over");
  o = options_;
  o.transport = BenchTransport::kNccl;  // device tensors over NCCL need the trainer's GPU
  expect(o, "client_device");
}

}  // namespace
}  // namespace moe::bench
