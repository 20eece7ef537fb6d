// Striped micro-batches (ClientOptions::stripe_bytes) against a loopback server: training
// through calls cut by rows over several connections gives the bits of whole calls, and a
// striped call's error is the server's, not the cancellations of its sibling streams.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "server/metrics.h"
#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::RandomFloat;
using testing_util::StartServer;
using testing_util::Target;

LayerConfig Config() { return testing_util::ServerRoutedConfig(256, 64); }

// Value of counter `name` with label method=`method` on the server, 0 when absent.
double MethodCounter(server::Server& s, const std::string& name, const std::string& method) {
  for (const auto& family : s.metrics().registry()->Collect()) {
    if (family.name != name) continue;
    for (const auto& m : family.metric) {
      for (const auto& label : m.label) {
        if (label.name == "method" && label.value == method) return m.counter.value;
      }
    }
  }
  return 0;
}

// ClientOptions::stripe_bytes: a micro-batch that large travels as several streams on several
// connections and the server runs it once, so training through striped calls gives the bits of
// whole ones, lent as views or handed over, and errors are the server's, not the cancellations
// of the sibling streams.
TEST(ClientTest, StripedMicroBatchesGiveTheBitsOfWholeOnes) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  client::ClientOptions whole_options, striped_options;
  whole_options.stripe_bytes = 0;
  striped_options.connections = 3;
  striped_options.stripe_bytes = 4096;
  striped_options.chunk_bytes = 3000;  // several messages per stream
  auto whole_conn = client::Connection::Connect(Target(*s), whole_options);
  auto striped_conn = client::Connection::Connect(Target(*s), striped_options);
  ASSERT_TRUE(whole_conn.ok() && striped_conn.ok());
  std::mt19937 rng(17);
  // Client routing sends ids and weights in every stream; server routing returns them per stream.
  for (RoutingMode routing : {RoutingMode::kClient, RoutingMode::kServer}) {
    const bool client_routing = routing == RoutingMode::kClient;
    SCOPED_TRACE(client_routing ? "client routing" : "server routing");
    LayerConfig config = Config();
    config.routing = routing;
    config.seed = 21;
    const std::string tag = client_routing ? "-client" : "-server";
    auto whole = client::RemoteLayer::Create(*whole_conn, "whole" + tag, config);
    auto striped = client::RemoteLayer::Create(*striped_conn, "striped" + tag, config);
    ASSERT_TRUE(whole.ok() && striped.ok());
    for (int step = 0; step < 2; ++step) {
      // 53 rows of 1 KiB: 3 streams of 18, 18 and 17 rows.
      Tensor x = RandomFloat(rng, {53, config.d_model}), ids, w;
      testing_util::RandomRouting(rng, 53, config.top_k, 0,
                                  static_cast<int32_t>(config.num_experts), &ids, &w);
      const TensorView idv = client_routing ? ids.view() : TensorView{};
      const TensorView wv = client_routing ? w.view() : TensorView{};
      Tensor dout = RandomFloat(rng, {53, config.d_model});
      auto wf = (*whole)->Forward(x.view(), idv, wv).get();
      auto sf = (*striped)->Forward(x.view(), idv, wv).get();
      ASSERT_TRUE(wf.ok() && sf.ok()) << wf.status() << " " << sf.status();
      EXPECT_EQ(sf->out.shape, wf->out.shape);
      EXPECT_TRUE(sf->out.bytes == wf->out.bytes) << "step " << step;
      EXPECT_EQ(sf->expert_ids.shape, wf->expert_ids.shape);
      EXPECT_TRUE(sf->expert_ids.bytes == wf->expert_ids.bytes);
      EXPECT_TRUE(sf->weights.bytes == wf->weights.bytes);
      EXPECT_EQ(sf->aux_loss, wf->aux_loss);
      auto wi = (*whole)->Forward(x.view(), idv, wv, /*training=*/false).get();
      auto si = (*striped)->Forward(x.view(), idv, wv, /*training=*/false).get();
      ASSERT_TRUE(wi.ok() && si.ok()) << wi.status() << " " << si.status();
      EXPECT_TRUE(si->out.bytes == wi->out.bytes);
      EXPECT_EQ(si->context_id, 0u);
      // Handing the tensors over instead of lending views gives the same bits, whole and striped.
      Tensor ids_owned = client_routing ? ids : Tensor(), w_owned = client_routing ? w : Tensor();
      auto wo = (*whole)->Forward(Tensor(x), Tensor(ids_owned), Tensor(w_owned), false).get();
      auto so =
          (*striped)->Forward(Tensor(x), std::move(ids_owned), std::move(w_owned), false).get();
      ASSERT_TRUE(wo.ok() && so.ok()) << wo.status() << " " << so.status();
      EXPECT_TRUE(wo->out.bytes == wi->out.bytes);
      EXPECT_TRUE(so->out.bytes == wi->out.bytes);
      auto wb = (*whole)->Backward(wf->context_id, dout.view()).get();
      auto sb = (*striped)->Backward(sf->context_id, Tensor(dout)).get();
      ASSERT_TRUE(wb.ok() && sb.ok()) << wb.status() << " " << sb.status();
      EXPECT_EQ(sb->dx.shape, wb->dx.shape);
      EXPECT_TRUE(sb->dx.bytes == wb->dx.bytes) << "step " << step;
      EXPECT_TRUE(sb->dweights.bytes == wb->dweights.bytes) << "step " << step;
      auto ws = (*whole)->Step(), ss = (*striped)->Step();
      ASSERT_TRUE(ws.ok() && ss.ok());
      EXPECT_EQ(ss->grad_norm, ws->grad_norm);
      EXPECT_EQ(ss->tokens_per_expert, ws->tokens_per_expert);
    }
    auto ww = (*whole)->ExportWeights(true), sw = (*striped)->ExportWeights(true);
    ASSERT_TRUE(ww.ok() && sw.ok());
    for (const auto& [name, t] : *ww) EXPECT_TRUE(sw->at(name).bytes == t.bytes) << name;
  }
  EXPECT_EQ(MethodCounter(*s, "moe_striped_micro_batches_total", "Forward"), 12);
  EXPECT_EQ(MethodCounter(*s, "moe_striped_micro_batches_total", "Backward"), 4);
  // A striped Backward of an unknown context fails on every stream with the server's NotFound.
  Tensor dout = RandomFloat(rng, {53, Config().d_model});
  absl::Status st = (*striped_conn)->Backward("striped-client", 12345, dout.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(st.message().find("context_id"), std::string::npos) << st;
}

}  // namespace
}  // namespace moe
