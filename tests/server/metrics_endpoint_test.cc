// moe-server's Prometheus endpoint, scraped over HTTP from a real server on loopback: request,
// token, expert, stage, byte and memory series move with the calls made, and a deleted layer's
// series go.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "engine/layer.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

using client::Connection;

std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  ::send(fd, req.data(), req.size(), 0);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

TEST(ServiceTest, MetricsEndpointShowsCountersMoving) {
  server::ServerOptions options = LoopbackOptions();
  options.metrics_port = 0;
  Loopback lb = StartLoopback(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(c.CreateLayer("m", config).ok());
  std::mt19937 rng(2);
  Tensor x = RandomFloat(rng, {10, config.d_model});
  ASSERT_TRUE(c.Forward("m", 1, true, x.view(), {}, {}).get().ok());
  const std::string before = HttpGet(lb.server->metrics_port(), "/metrics");
  ASSERT_NE(before.find("200 OK"), std::string::npos) << before.substr(0, 200);
  const std::string fwd_ok = "moe_requests_total{code=\"OK\",method=\"Forward\"}";
  const std::string tokens = "moe_tokens_total{direction=\"forward\",layer=\"m\"}";
  EXPECT_EQ(MetricValue(before, fwd_ok), 1) << before;
  EXPECT_EQ(MetricValue(before, tokens), 10);
  EXPECT_GT(MetricValue(before, "moe_saved_context_bytes"), 0);

  ASSERT_TRUE(c.Backward("m", 1, x.view()).get().ok());
  ASSERT_TRUE(c.Forward("m", 2, false, x.view(), {}, {}).get().ok());
  ASSERT_TRUE(c.Step("m").ok());
  EXPECT_EQ(c.Step("zzz").status().code(), absl::StatusCode::kNotFound);
  const std::string after = HttpGet(lb.server->metrics_port(), "/metrics");
  EXPECT_EQ(MetricValue(after, fwd_ok), 2);
  EXPECT_EQ(MetricValue(after, tokens), 20);
  EXPECT_EQ(MetricValue(after, "moe_tokens_total{direction=\"backward\",layer=\"m\"}"), 10);
  EXPECT_EQ(MetricValue(after, "moe_requests_total{code=\"NOT_FOUND\",method=\"Step\"}"), 1);
  EXPECT_EQ(MetricValue(after, "moe_optimizer_steps_total{layer=\"m\"}"), 1);
  EXPECT_EQ(MetricValue(after, "moe_saved_context_bytes"), 0);
  double expert_sum = 0;
  for (int e = 0; e < config.num_experts; ++e) {
    expert_sum += std::max(0.0, MetricValue(after, absl::StrCat("moe_expert_tokens_total{expert=\"", e,
                                                           "\",layer=\"m\"}")));
  }
  EXPECT_EQ(expert_sum, 20 * config.top_k);
  EXPECT_GT(MetricValue(after, "moe_stage_duration_seconds_count{method=\"Forward\",stage=\"compute\"}"),
            1);
  EXPECT_GT(MetricValue(after, "moe_received_bytes_total{method=\"Forward\"}"),
            MetricValue(before, "moe_received_bytes_total{method=\"Forward\"}"));
  EXPECT_GT(MetricValue(after, "moe_device_memory_used_bytes{device=\"cpu\"}"), 0);
  EXPECT_EQ(MetricValue(after, "moe_pinned_host_bytes"), 0);  // the CPU engine pins nothing
  EXPECT_EQ(MetricValue(after, "moe_layers"), 1);
  EXPECT_NE(HttpGet(lb.server->metrics_port(), "/other").find("404"), std::string::npos);
  // Deleting the layer removes its series.
  ASSERT_TRUE(c.DeleteLayer("m").ok());
  const std::string gone = HttpGet(lb.server->metrics_port(), "/metrics");
  EXPECT_EQ(MetricValue(gone, tokens), -1);
  EXPECT_EQ(MetricValue(gone, "moe_layers"), 0);
}

}  // namespace
}  // namespace moe::server_test
