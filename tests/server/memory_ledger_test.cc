// MemoryLedger: layer state, saved contexts and request tensors against the budgets (one shared
// budget for the CPU engine, a device and a host budget for a GPU engine), per-principal quotas,
// refusals that change nothing and name the bytes, and the metrics it publishes.
#include "server/memory_ledger.h"

#include <gtest/gtest.h>

#include <sstream>
#include <utility>

#include "prometheus/text_serializer.h"
#include "server/metrics.h"

namespace moe::server {
namespace {

constexpr char kAlice[] = "alice";
constexpr char kBob[] = "bob";

MemoryLedger::Limits Shared(int64_t budget, int64_t layer_quota = 0, int64_t context_quota = 0) {
  MemoryLedger::Limits l;
  l.budget.engine_bytes = budget;
  l.budget.host_bytes = budget;
  l.budget.shared = true;
  l.budget.engine_memory = "host memory";
  l.principal_layer_bytes_quota = layer_quota;
  l.principal_context_bytes_quota = context_quota;
  return l;
}

bool Contains(const absl::Status& st, const std::string& text) {
  return std::string(st.message()).find(text) != std::string::npos;
}

TEST(MemoryLedgerTest, ALayerPastTheBudgetIsRefusedNamingTheBytes) {
  MemoryLedger ledger(Shared(3000), nullptr);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "small", 1000).ok());
  absl::Status st = ledger.AdmitLayer(kAlice, "big", 2001);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(Contains(st, "\"big\" needs 2001 bytes")) << st;
  EXPECT_TRUE(Contains(st, "2000 of the 3000-byte budget of host memory are free")) << st;
  EXPECT_EQ(ledger.usage().layer_bytes, 1000);                // the refusal changed nothing
  EXPECT_TRUE(ledger.AdmitLayer(kAlice, "fits", 2000).ok());  // exactly the rest
  EXPECT_EQ(ledger.usage().engine_bytes(), 3000);
  ledger.ReleaseLayer("small");
  ledger.ReleaseLayer("unknown");  // nothing
  EXPECT_EQ(ledger.usage().layer_bytes, 2000);
  EXPECT_EQ(ledger.principal_layer_bytes(kAlice), 2000);
}

TEST(MemoryLedgerTest, TheLayerQuotaIsKeptPerPrincipal) {
  MemoryLedger ledger(Shared(1 << 20, /*layer_quota=*/500), nullptr);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "a1", 300).ok());
  absl::Status st = ledger.AdmitLayer(kAlice, "a2", 201);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(Contains(st, "--principal_layer_bytes_quota")) << st;
  EXPECT_TRUE(Contains(st, "\"alice\" holds 300 bytes")) << st;
  EXPECT_TRUE(Contains(st, "quota of 500 bytes")) << st;
  ASSERT_TRUE(ledger.AdmitLayer(kBob, "b1", 500).ok());  // Bob's quota is his own
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "a2", 200).ok());
  ledger.ReleaseLayer("a1");  // freed whoever deletes it: charged back to its creator
  EXPECT_EQ(ledger.principal_layer_bytes(kAlice), 200);
  EXPECT_EQ(ledger.principal_layer_bytes(kBob), 500);
  // A name is charged once.
  EXPECT_EQ(ledger.AdmitLayer(kBob, "a2", 1).code(), absl::StatusCode::kAlreadyExists);
}

TEST(MemoryLedgerTest, SetLayerBytesFollowsWhatTheLayerHolds) {
  MemoryLedger ledger(Shared(1000), nullptr);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "l", 400).ok());
  ledger.SetLayerBytes("l", 450);
  EXPECT_EQ(ledger.usage().layer_bytes, 450);
  EXPECT_EQ(ledger.principal_layer_bytes(kAlice), 450);
  ledger.ReleaseLayer("l");
  EXPECT_EQ(ledger.usage().layer_bytes, 0);
  EXPECT_EQ(ledger.principal_layer_bytes(kAlice), 0);
}

TEST(MemoryLedgerTest, ContextsShareTheBudgetWithLayersAndHaveTheirOwnQuota) {
  MemoryLedger ledger(Shared(1000, 0, /*context_quota=*/300), nullptr);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "l", 600).ok());
  absl::Status st = ledger.AdmitContext(kAlice, 301);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(Contains(st, "--principal_context_bytes_quota")) << st;
  ASSERT_TRUE(ledger.AdmitContext(kAlice, 300).ok());
  st = ledger.AdmitContext(kBob, 101);  // within Bob's quota, past the budget
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(Contains(st, "memory budget")) << st;
  EXPECT_TRUE(Contains(st, "100 of the 1000-byte budget")) << st;
  ASSERT_TRUE(ledger.AdmitContext(kBob, 100).ok());
  ledger.ReleaseContext(kAlice, 300);
  EXPECT_EQ(ledger.principal_context_bytes(kAlice), 0);
  EXPECT_EQ(ledger.usage().context_bytes, 100);
}

TEST(MemoryLedgerTest, RequestChargesRiseFallAndGoWithTheirHandle) {
  MemoryLedger ledger(Shared(1000), nullptr);
  {
    MemoryLedger::RequestCharge a = ledger.NewRequestCharge();
    ASSERT_TRUE(a.Set(600, "x").ok());
    MemoryLedger::RequestCharge b = ledger.NewRequestCharge();
    absl::Status st = b.Set(401, "dout");
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_TRUE(Contains(st, "dout: this request's tensors would hold 401 bytes")) << st;
    EXPECT_TRUE(Contains(st, "400 of the 1000-byte budget of host memory")) << st;
    EXPECT_EQ(b.bytes(), 0);
    // Layers and contexts share the budget on host memory.
    EXPECT_EQ(ledger.AdmitLayer(kAlice, "l", 401).code(), absl::StatusCode::kResourceExhausted);
    ASSERT_TRUE(a.Set(100, "x").ok());  // falls always fit
    ASSERT_TRUE(b.Set(900, "dout").ok());
    MemoryLedger::RequestCharge moved = std::move(b);
    EXPECT_EQ(ledger.usage().request_bytes, 1000);
    a.Reset();
    EXPECT_EQ(ledger.usage().request_bytes, 900);
  }  // `moved` gives its bytes back here
  EXPECT_EQ(ledger.usage().request_bytes, 0);
  MemoryLedger::RequestCharge none;
  EXPECT_FALSE(none.Set(1, "x").ok());
}

TEST(MemoryLedgerTest, WorkingChargesShareTheHostBudgetAndSayWhatTheyAreFor) {
  MemoryLedger ledger(Shared(1000), nullptr);
  MemoryLedger::RequestCharge tensors = ledger.NewRequestCharge();
  ASSERT_TRUE(tensors.Set(700, "x").ok());
  MemoryLedger::RequestCharge working = ledger.NewWorkingCharge();
  absl::Status st = working.Set(301, "forward of 9 tokens");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(Contains(st, "forward of 9 tokens: this call's working memory would need 301 bytes"))
      << st;
  ASSERT_TRUE(working.Set(300, "forward of 9 tokens").ok());
  MemoryLedger::RequestCharge moved = std::move(working);
  st = moved.Set(400, "forward of 12 tokens");  // a moved charge keeps its kind
  EXPECT_TRUE(Contains(st, "this call's working memory")) << st;
  EXPECT_EQ(ledger.usage().request_bytes, 1000);
  moved.Reset();
  EXPECT_EQ(ledger.usage().request_bytes, 700);
}

// A GPU engine: layer state and contexts in the device's budget, requests in the host's.
TEST(MemoryLedgerTest, OnAGpuRequestsHaveTheHostBudget) {
  MemoryLedger::Limits limits;
  limits.budget.engine_bytes = 1000;
  limits.budget.host_bytes = 300;
  limits.budget.shared = false;
  limits.budget.engine_memory = "cuda:0 memory";
  MemoryLedger ledger(limits, nullptr);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "l", 1000).ok());
  MemoryLedger::RequestCharge r = ledger.NewRequestCharge();
  EXPECT_TRUE(r.Set(300, "x").ok());
  EXPECT_EQ(r.Set(301, "x").code(), absl::StatusCode::kResourceExhausted);
  absl::Status st = ledger.AdmitContext(kAlice, 1);
  EXPECT_TRUE(Contains(st, "budget of cuda:0 memory")) << st;
  EXPECT_EQ(ledger.usage().engine_bytes(), 1000);
}

TEST(MemoryLedgerTest, PublishesBudgetAdmittedBytesAndRefusals) {
  Metrics metrics("cpu");
  MemoryLedger ledger(Shared(1000, 100), &metrics);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "l", 80).ok());
  EXPECT_FALSE(ledger.AdmitLayer(kAlice, "m", 30).ok());
  ASSERT_TRUE(ledger.AdmitContext(kAlice, 7).ok());
  std::ostringstream text;
  prometheus::TextSerializer().Serialize(text, metrics.registry()->Collect());
  const std::string s = text.str();
  EXPECT_NE(s.find("moe_memory_budget_bytes{memory=\"host\"} 1000"), std::string::npos) << s;
  EXPECT_NE(s.find("moe_memory_admitted_bytes{kind=\"layer_state\"} 80"), std::string::npos) << s;
  EXPECT_NE(s.find("moe_memory_admitted_bytes{kind=\"saved_contexts\"} 7"), std::string::npos) << s;
  EXPECT_NE(s.find("moe_admission_rejections_total{reason=\"layer_quota\"} 1"), std::string::npos)
      << s;
}

}  // namespace
}  // namespace moe::server
