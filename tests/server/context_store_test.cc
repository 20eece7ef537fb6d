// ContextStore: budget (refusal loses nothing else), TTL expiry, session ownership, NotFound.
#include "server/context_store.h"

#include <gtest/gtest.h>

#include <thread>

namespace moe::server {
namespace {

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

TEST(ContextStoreTest, BudgetRefusesOnlyTheNewContext) {
  ContextStore store(1000, std::chrono::seconds(60), nullptr);
  ASSERT_TRUE(store.Put("a", 1, "", Ctx(3, 600)).ok());
  absl::Status st = store.Put("a", 2, "", Ctx(5, 500));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(store.bytes(), 600);
  EXPECT_EQ(store.count(), 1);
  auto c = store.Take("a", 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->num_tokens(), 3);
  EXPECT_TRUE(store.Put("a", 2, "", Ctx(5, 1000)).ok());  // exactly the budget fits
  EXPECT_EQ(store.bytes(), 1000);
}

TEST(ContextStoreTest, DuplicateIdIsAlreadyExistsAndUnknownIsNotFound) {
  ContextStore store(1000, std::chrono::seconds(60), nullptr);
  ASSERT_TRUE(store.Put("a", 1, "", Ctx(1, 10)).ok());
  EXPECT_EQ(store.Put("a", 1, "", Ctx(1, 10)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(store.Put("b", 1, "", Ctx(1, 10)).ok());  // same id, other layer
  EXPECT_EQ(store.Take("a", 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.NumTokens("c", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Take("a", 1).ok());
  EXPECT_EQ(store.Take("a", 1).status().code(), absl::StatusCode::kNotFound);  // consumed
}

TEST(ContextStoreTest, ExpiredContextsAreGone) {
  ContextStore store(1000, std::chrono::milliseconds(50), nullptr);
  ASSERT_TRUE(store.Put("a", 1, "", Ctx(1, 10)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_EQ(store.NumTokens("a", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Expire(), 1);
  EXPECT_EQ(store.bytes(), 0);
}

TEST(ContextStoreTest, ClosingASessionFreesOnlyItsContexts) {
  ContextStore store(1000, std::chrono::seconds(60), nullptr);
  store.OpenSession("s1");
  store.OpenSession("s2");
  ASSERT_TRUE(store.Put("a", 1, "s1", Ctx(1, 10)).ok());
  ASSERT_TRUE(store.Put("a", 2, "s2", Ctx(1, 20)).ok());
  ASSERT_TRUE(store.Put("a", 3, "", Ctx(1, 40)).ok());
  store.CloseSession("s1");
  EXPECT_EQ(store.bytes(), 60);
  EXPECT_EQ(store.Take("a", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Take("a", 2).ok());
  EXPECT_EQ(store.Put("a", 4, "s1", Ctx(1, 10)).code(), absl::StatusCode::kFailedPrecondition);
  store.DropLayer("a");
  EXPECT_EQ(store.count(), 0);
}

}  // namespace
}  // namespace moe::server
