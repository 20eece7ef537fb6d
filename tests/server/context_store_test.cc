// ContextStore: budget (refusal loses nothing else), TTL expiry (shorter for contexts outside a
// session), session ownership, NotFound, and every context bound to its principal and charged to
// that principal's quota in the memory ledger.
#include "server/context_store.h"

#include <gtest/gtest.h>

#include <thread>

namespace moe::server {
namespace {

constexpr char kAlice[] = "alice";
constexpr char kBob[] = "bob";
const std::chrono::seconds kLong(60);

class FakeContext : public SavedContext {
 public:
  FakeContext(int64_t tokens, int64_t bytes) : tokens_(tokens), bytes_(bytes) {}
  int64_t num_tokens() const override { return tokens_; }
  int64_t bytes() const override { return bytes_; }

 private:
  int64_t tokens_, bytes_;
};

std::unique_ptr<SavedContext> Ctx(int64_t tokens, int64_t bytes) {
  return std::make_unique<FakeContext>(tokens, bytes);
}

// A ledger whose memory budget is `budget` bytes, with a context quota per principal.
MemoryLedger::Limits LedgerLimits(int64_t budget, int64_t context_quota) {
  MemoryLedger::Limits l;
  l.budget.engine_bytes = budget;
  l.budget.host_bytes = budget;
  l.budget.shared = true;
  l.budget.engine_memory = "host memory";
  l.principal_context_bytes_quota = context_quota;
  return l;
}

TEST(ContextStoreTest, BudgetRefusesOnlyTheNewContext) {
  ContextStore store(1000, kLong, kLong, nullptr, nullptr);
  ASSERT_TRUE(store.Put("a", 1, kAlice, "", Ctx(3, 600)).ok());
  absl::Status st = store.Put("a", 2, kAlice, "", Ctx(5, 500));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(store.bytes(), 600);
  EXPECT_EQ(store.count(), 1);
  auto c = store.Take("a", 1, kAlice);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->num_tokens(), 3);
  EXPECT_TRUE(store.Put("a", 2, kAlice, "", Ctx(5, 1000)).ok());  // exactly the budget fits
  EXPECT_EQ(store.bytes(), 1000);
}

TEST(ContextStoreTest, DuplicateIdIsAlreadyExistsAndUnknownIsNotFound) {
  ContextStore store(1000, kLong, kLong, nullptr, nullptr);
  ASSERT_TRUE(store.Put("a", 1, kAlice, "", Ctx(1, 10)).ok());
  EXPECT_EQ(store.Put("a", 1, kAlice, "", Ctx(1, 10)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(store.Put("b", 1, kAlice, "", Ctx(1, 10)).ok());  // same id, other layer
  EXPECT_EQ(store.Take("a", 2, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.NumTokens("c", 1, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Take("a", 1, kAlice).ok());
  EXPECT_EQ(store.Take("a", 1, kAlice).status().code(), absl::StatusCode::kNotFound);  // consumed
}

TEST(ContextStoreTest, ExpiredContextsAreGone) {
  ContextStore store(1000, std::chrono::milliseconds(50), std::chrono::milliseconds(50), nullptr,
                     nullptr);
  ASSERT_TRUE(store.Put("a", 1, kAlice, "", Ctx(1, 10)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_EQ(store.NumTokens("a", 1, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Expire(), 1);
  EXPECT_EQ(store.bytes(), 0);
}

TEST(ContextStoreTest, ContextsOutsideASessionExpireAfterTheShorterTtl) {
  ContextStore store(1000, kLong, std::chrono::milliseconds(50), nullptr, nullptr);
  store.OpenSession("s1", kAlice);
  ASSERT_TRUE(store.Put("a", 1, kAlice, "s1", Ctx(1, 10)).ok());
  ASSERT_TRUE(store.Put("a", 2, kAlice, "", Ctx(2, 20)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  // Past its TTL the sessionless context is gone even before the sweep runs.
  EXPECT_EQ(store.NumTokens("a", 2, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Expire(), 1);
  EXPECT_EQ(store.bytes(), 10);
  auto kept = store.NumTokens("a", 1, kAlice);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 1);
}

TEST(ContextStoreTest, ClosingASessionFreesOnlyItsContexts) {
  ContextStore store(1000, kLong, kLong, nullptr, nullptr);
  store.OpenSession("s1", kAlice);
  store.OpenSession("s2", kAlice);
  ASSERT_TRUE(store.Put("a", 1, kAlice, "s1", Ctx(1, 10)).ok());
  ASSERT_TRUE(store.Put("a", 2, kAlice, "s2", Ctx(1, 20)).ok());
  ASSERT_TRUE(store.Put("a", 3, kAlice, "", Ctx(1, 40)).ok());
  store.CloseSession("s1");
  EXPECT_EQ(store.bytes(), 60);
  EXPECT_EQ(store.Take("a", 1, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Take("a", 2, kAlice).ok());
  EXPECT_EQ(store.Put("a", 4, kAlice, "s1", Ctx(1, 10)).code(),
            absl::StatusCode::kFailedPrecondition);
  store.DropLayer("a");
  EXPECT_EQ(store.count(), 0);
}

// Another principal's context is NOT_FOUND, with the same message as an id never used, and the
// two principals' ids never collide.
TEST(ContextStoreTest, AContextIsOnlyItsPrincipals) {
  ContextStore store(1000, kLong, kLong, nullptr, nullptr);
  ASSERT_TRUE(store.Put("a", 7, kAlice, "", Ctx(4, 10)).ok());
  absl::StatusOr<int64_t> tokens = store.NumTokens("a", 7, kBob);
  EXPECT_EQ(tokens.status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::unique_ptr<SavedContext>> taken = store.Take("a", 7, kBob);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(taken.status().message(), store.Take("a", 7, "carol").status().message());
  // Bob's own context 7 is another context; Alice's is still there, whole.
  ASSERT_TRUE(store.Put("a", 7, kBob, "", Ctx(9, 20)).ok());
  auto alices = store.Take("a", 7, kAlice);
  ASSERT_TRUE(alices.ok()) << alices.status();
  EXPECT_EQ((*alices)->num_tokens(), 4);
  auto bobs = store.Take("a", 7, kBob);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ((*bobs)->num_tokens(), 9);
  EXPECT_EQ(store.LayerUsage("a"), std::make_pair(int64_t{0}, int64_t{0}));
}

TEST(ContextStoreTest, ASessionIsOnlyItsPrincipals) {
  ContextStore store(1000, kLong, kLong, nullptr, nullptr);
  store.OpenSession("s1", kAlice);
  EXPECT_TRUE(store.CheckSession("s1", kAlice).ok());
  EXPECT_TRUE(store.CheckSession("", kBob).ok());
  absl::Status st = store.CheckSession("s1", kBob);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_NE(st.message().find("moe-session-id"), absl::string_view::npos) << st;
  EXPECT_EQ(store.CheckSession("nope", kBob).code(), absl::StatusCode::kFailedPrecondition);
  st = store.Put("a", 1, kBob, "s1", Ctx(1, 10));
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_EQ(store.count(), 0);
  // Alice's session still works, and closing it frees what she put in it.
  ASSERT_TRUE(store.Put("a", 1, kAlice, "s1", Ctx(1, 10)).ok());
  store.CloseSession("s1");
  EXPECT_EQ(store.count(), 0);
}

// The context quota is kept per principal; every way a context leaves the store (Take, expiry,
// session end, layer deletion) gives its bytes back.
TEST(ContextStoreTest, ContextsAreChargedToTheirPrincipalsQuota) {
  MemoryLedger ledger(LedgerLimits(1 << 20, 100), nullptr);
  ContextStore store(1 << 20, kLong, std::chrono::milliseconds(50), &ledger, nullptr);
  store.OpenSession("s1", kAlice);
  ASSERT_TRUE(store.Put("a", 1, kAlice, "s1", Ctx(1, 60)).ok());
  absl::Status st = store.Put("a", 2, kAlice, "s1", Ctx(1, 50));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("--principal_context_bytes_quota"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("\"alice\""), absl::string_view::npos) << st;
  EXPECT_EQ(store.count(), 1);
  // Bob has a quota of his own.
  ASSERT_TRUE(store.Put("a", 1, kBob, "", Ctx(1, 100)).ok());
  EXPECT_EQ(ledger.principal_context_bytes(kAlice), 60);
  EXPECT_EQ(ledger.principal_context_bytes(kBob), 100);
  EXPECT_EQ(ledger.usage().context_bytes, 160);

  ASSERT_TRUE(store.Take("a", 1, kAlice).ok());
  EXPECT_EQ(ledger.principal_context_bytes(kAlice), 0);
  ASSERT_TRUE(store.Put("a", 2, kAlice, "s1", Ctx(1, 100)).ok());  // fits again
  store.CloseSession("s1");
  EXPECT_EQ(ledger.principal_context_bytes(kAlice), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_EQ(store.Expire(), 1);  // Bob's, made outside a session
  EXPECT_EQ(ledger.principal_context_bytes(kBob), 0);
  ASSERT_TRUE(store.Put("b", 3, kBob, "", Ctx(1, 30)).ok());
  store.DropLayer("b");
  EXPECT_EQ(ledger.usage().context_bytes, 0);
}

// Contexts count against the memory budget too, which layer state shares.
TEST(ContextStoreTest, ContextsAreChargedToTheMemoryBudget) {
  MemoryLedger ledger(LedgerLimits(1000, 0), nullptr);
  ASSERT_TRUE(ledger.AdmitLayer(kAlice, "a", 900).ok());
  ContextStore store(1 << 20, kLong, kLong, &ledger, nullptr);
  ASSERT_TRUE(store.Put("a", 1, kBob, "", Ctx(1, 100)).ok());
  absl::Status st = store.Put("a", 2, kBob, "", Ctx(1, 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("memory budget"), absl::string_view::npos) << st;
  EXPECT_EQ(store.count(), 1);
  EXPECT_EQ(store.bytes(), 100);
}

}  // namespace
}  // namespace moe::server
