// Saved training contexts through a real moe-server on loopback: the context budget refuses the
// new Forward and loses nothing else, an expired context is NOT_FOUND, and a client that goes
// away (its session ends) frees its contexts while another client's stay.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

#include "client/client.h"
#include "engine/layer.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

using client::Connection;

// --- Saved contexts -----------------------------------------------------------------------
TEST(ServiceTest, ContextBudgetRefusesTheNewForwardAndLosesNothingElse) {
  Loopback probe = StartLoopback();
  ASSERT_TRUE(probe.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kClient);
  std::mt19937 rng(3);
  Tensor x = RandomFloat(rng, {16, config.d_model}), ids, w;
  RandomRouting(rng, 16, config, &ids, &w);
  // Measure one context's size, then allow exactly two.
  ASSERT_TRUE(probe.conn->CreateLayer("l", config).ok());
  ASSERT_TRUE(probe.conn->Forward("l", 1, true, x.view(), ids.view(), w.view()).get().ok());
  const int64_t one = probe.conn->GetStats()->saved_context_bytes();
  ASSERT_GT(one, 0);

  server::ServerOptions options = LoopbackOptions();
  options.context_budget_bytes = 2 * one;
  Loopback lb = StartLoopback(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  ASSERT_TRUE(c.CreateLayer("l", config).ok());
  ASSERT_TRUE(c.Forward("l", 1, true, x.view(), ids.view(), w.view()).get().ok());
  ASSERT_TRUE(c.Forward("l", 2, true, x.view(), ids.view(), w.view()).get().ok());
  absl::Status st = c.Forward("l", 3, true, x.view(), ids.view(), w.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(c.GetStats()->saved_contexts(), 2);
  // Inference needs no context and still runs; both saved contexts are still there.
  EXPECT_TRUE(c.Forward("l", 0, false, x.view(), ids.view(), w.view()).get().ok());
  Tensor dout = RandomFloat(rng, {16, config.d_model});
  EXPECT_TRUE(c.Backward("l", 1, dout.view()).get().ok());
  EXPECT_TRUE(c.Backward("l", 2, dout.view()).get().ok());
  EXPECT_TRUE(c.Forward("l", 3, true, x.view(), ids.view(), w.view()).get().ok());
  EXPECT_EQ(c.GetStats()->saved_context_bytes(), one);
}

TEST(ServiceTest, ExpiredContextIsNotFound) {
  server::ServerOptions options = LoopbackOptions();
  options.context_ttl_seconds = 0.2;
  Loopback lb = StartLoopback(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(c.CreateLayer("l", config).ok());
  std::mt19937 rng(4);
  Tensor x = RandomFloat(rng, {8, config.d_model});
  ASSERT_TRUE(c.Forward("l", 5, true, x.view(), {}, {}).get().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(c.GetStats()->saved_contexts(), 0);  // the sweeper freed it
  Tensor dout = RandomFloat(rng, {8, config.d_model});
  EXPECT_EQ(c.Backward("l", 5, dout.view()).get().status().code(), absl::StatusCode::kNotFound);
}

TEST(ServiceTest, ClientThatGoesAwayFreesItsContexts) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(lb.conn->CreateLayer("l", config).ok());
  std::mt19937 rng(6);
  Tensor x = RandomFloat(rng, {8, config.d_model});
  ASSERT_TRUE(lb.conn->Forward("l", 1, true, x.view(), {}, {}).get().ok());  // stays
  {
    auto other = lb.Connect();
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE((*other)->Forward("l", 2, true, x.view(), {}, {}).get().ok());
    ASSERT_TRUE((*other)->Forward("l", 3, true, x.view(), {}, {}).get().ok());
    EXPECT_EQ(lb.conn->GetStats()->saved_contexts(), 3);
    EXPECT_EQ(lb.conn->GetStats()->sessions(), 2);
  }  // the other client's connection ends here
  int64_t left = -1;
  for (int i = 0; i < 100 && left != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    left = lb.conn->GetStats()->saved_contexts();
  }
  EXPECT_EQ(left, 1);
  Tensor dout = RandomFloat(rng, {8, config.d_model});
  EXPECT_EQ(lb.conn->Backward("l", 2, dout.view()).get().status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(lb.conn->Backward("l", 1, dout.view()).get().ok());
}

}  // namespace
}  // namespace moe::server_test
