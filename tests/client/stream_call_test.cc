// Long-lived Forward and Backward streams (client/stream_call.h, StreamLink): whole micro-batches
// of a connection share its streams, whichever TCP connection each was given, one micro-batch
// per stream at a time; a failure ends only
// the stream it happened on; a stream past its timeout is replaced; the connection's end closes
// them; and a whole micro-batch still has a deadline.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "server/metrics.h"
#include "server/server.h"
#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::RandomFloat;
using testing_util::StartServer;
using testing_util::Target;

LayerConfig Config() { return testing_util::ServerRoutedConfig(64, 32); }

// Open streams of `method` on the server (moe_active_streams).
double OpenStreams(server::Server& s, const std::string& method) {
  for (const auto& family : s.metrics().registry()->Collect()) {
    if (family.name != "moe_active_streams") continue;
    for (const auto& m : family.metric) {
      for (const auto& label : m.label) {
        if (label.name == "method" && label.value == method) return m.gauge.value;
      }
    }
  }
  return 0;
}

// Waits up to two seconds for the server's open `method` streams to reach `want` (a stream's end
// reaches the server after the client has moved on).
double SettledStreams(server::Server& s, const std::string& method, double want) {
  double n = OpenStreams(s, method);
  for (int i = 0; i < 200 && n != want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    n = OpenStreams(s, method);
  }
  return n;
}

client::ClientOptions OneConnection() {
  client::ClientOptions o;
  o.connections = 1;
  return o;
}

TEST(StreamLinkTest, WholeMicroBatchesShareLongLivedStreams) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  {
    // The default eight connections: calls one after another still share one stream.
    auto c = client::Connection::Connect(Target(*s));
    ASSERT_TRUE(c.ok()) << c.status();
    auto layer = client::RemoteLayer::Create(*c, "l", Config());
    ASSERT_TRUE(layer.ok()) << layer.status();
    std::mt19937 rng(3);
    Tensor x = RandomFloat(rng, {16, Config().d_model});
    auto first = (*layer)->Forward(x.view(), {}, {}, /*training=*/false).get();
    ASSERT_TRUE(first.ok()) << first.status();
    // One after another: all on the one stream, each with the same bits.
    for (int i = 0; i < 20; ++i) {
      auto r = (*layer)->Forward(x.view(), {}, {}, /*training=*/true).get();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->out.bytes == first->out.bytes);
      auto b = (*layer)->Backward(r->context_id, r->out.view()).get();
      ASSERT_TRUE(b.ok()) << b.status();
    }
    EXPECT_EQ(OpenStreams(*s, "Forward"), 1);
    EXPECT_EQ(OpenStreams(*s, "Backward"), 1);
    // Four in flight: a stream each at most, then all idle for the next ones.
    std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> calls;
    for (int i = 0; i < 4; ++i) calls.push_back((*layer)->Forward(x.view(), {}, {}, false));
    for (auto& f : calls) {
      auto r = f.get();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->out.bytes == first->out.bytes);
    }
    const double open = OpenStreams(*s, "Forward");
    EXPECT_GE(open, 1);
    EXPECT_LE(open, 4);
    for (int i = 0; i < 8; ++i) ASSERT_TRUE((*layer)->Forward(x.view(), {}, {}, false).get().ok());
    EXPECT_EQ(OpenStreams(*s, "Forward"), open);
  }
  // The connection's end closes its streams.
  EXPECT_EQ(SettledStreams(*s, "Forward", 0), 0);
  EXPECT_EQ(SettledStreams(*s, "Backward", 0), 0);
}

TEST(StreamLinkTest, AFailureEndsOnlyItsStreamAndLosesNothing) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto c = client::Connection::Connect(Target(*s), OneConnection());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->CreateLayer("l", Config()).ok());
  std::mt19937 rng(5);
  Tensor x = RandomFloat(rng, {8, Config().d_model});
  auto before = (*c)->Forward("l", 0, false, x.view(), {}, {}).get();
  ASSERT_TRUE(before.ok()) << before.status();
  Tensor wrong = RandomFloat(rng, {8, Config().d_model + 1});
  for (int i = 0; i < 3; ++i) {
    auto bad = (*c)->Forward("l", 0, false, wrong.view(), {}, {}).get();
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
    EXPECT_NE(bad.status().message().find("x"), std::string::npos) << bad.status();
    auto unknown = (*c)->Backward("l", 12345, x.view()).get();
    EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
    auto after = (*c)->Forward("l", 0, false, x.view(), {}, {}).get();
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_TRUE(after->out.bytes == before->out.bytes);
  }
  EXPECT_EQ(SettledStreams(*s, "Forward", 1), 1);
}

TEST(StreamLinkTest, AStreamPastItsTimeoutIsReplaced) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  client::ClientOptions o = OneConnection();
  o.timeout = std::chrono::milliseconds(300);
  auto c = client::Connection::Connect(Target(*s), o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->CreateLayer("l", Config()).ok());
  std::mt19937 rng(9);
  Tensor x = RandomFloat(rng, {8, Config().d_model});
  auto first = (*c)->Forward("l", 0, false, x.view(), {}, {}).get();
  ASSERT_TRUE(first.ok()) << first.status();
  // Past the timeout the idle stream takes no micro-batch; past twice the timeout its deadline
  // ends it while idle. Either way the next call runs, on a new stream.
  for (int wait_ms : {400, 800}) {
    std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
    auto r = (*c)->Forward("l", 0, false, x.view(), {}, {}).get();
    ASSERT_TRUE(r.ok()) << "after " << wait_ms << " ms: " << r.status();
    EXPECT_TRUE(r->out.bytes == first->out.bytes);
    EXPECT_EQ(SettledStreams(*s, "Forward", 1), 1) << "after " << wait_ms << " ms";
  }
}

TEST(StreamLinkTest, AWholeMicroBatchStillHasADeadline) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto setup = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(setup.ok());
  ASSERT_TRUE((*setup)->CreateLayer("l", Config()).ok());
  client::ClientOptions o = OneConnection();
  o.timeout = std::chrono::milliseconds(100);
  o.stripe_bytes = int64_t{1} << 40;  // never striped: the long-lived stream's deadline applies
  auto c = client::Connection::Connect(Target(*s), o);
  ASSERT_TRUE(c.ok()) << c.status();
  // 200k tokens x 64 floats (51 MB) cannot travel and compute in twice 100 ms on this machine.
  std::mt19937 rng(1);
  Tensor x = RandomFloat(rng, {200000, Config().d_model});
  auto r = (*c)->Forward("l", 1, false, x.view(), {}, {}).get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  Tensor small = RandomFloat(rng, {4, Config().d_model});
  EXPECT_TRUE((*setup)->Forward("l", 0, false, small.view(), {}, {}).get().ok());
  EXPECT_TRUE((*c)->Forward("l", 0, false, small.view(), {}, {}).get().ok());
}

}  // namespace
}  // namespace moe
