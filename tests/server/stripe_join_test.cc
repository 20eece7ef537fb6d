// StripeJoin and StripeJoins on their own: which stream runs a striped micro-batch, what the
// streams must agree on, and that one stream's failure reaches every waiting stream exactly once.
#include "server/stripe_join.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace moe::server {
namespace {

// A stream that records the statuses it was aborted with.
struct FakePart : StripeJoin::Part {
  void AbortStripe(const absl::Status& status) override { aborts.push_back(status); }
  std::vector<absl::Status> aborts;
};

StripeJoin::Shape ShapeOf(uint32_t count, int64_t total_rows, std::string training = "true") {
  return {count, total_rows, "training", std::move(training)};
}

void ExpectInvalidNaming(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << "should name " << field << ": " << st;
}

TEST(StripeJoinTest, TheLastArrivalGetsEveryPartInRowOrder) {
  StripeJoin join;
  FakePart a, b, c;
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(join.Register(i, ShapeOf(3, 10)).ok());
  // Stream 2 holds rows [0, 3), stream 0 rows [3, 7), stream 1 rows [7, 10).
  auto r = join.Arrive(0, 3, 4, &a);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->empty());
  r = join.Arrive(2, 0, 3, &c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->empty());
  r = join.Arrive(1, 7, 3, &b);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<StripeJoin::Part*>{&c, &a, &b}));
  // Once it runs, a failure of one stream no longer touches the others, and the id is taken.
  join.Fail(absl::CancelledError("late"));
  EXPECT_TRUE(a.aborts.empty() && b.aborts.empty() && c.aborts.empty());
  EXPECT_EQ(join.Register(0, ShapeOf(3, 10)).code(), absl::StatusCode::kAlreadyExists);
}

TEST(StripeJoinTest, RegisterNamesTheFieldThatIsWrong) {
  StripeJoin join;
  ExpectInvalidNaming(join.Register(0, ShapeOf(1, 10)), "stripe.count");
  ExpectInvalidNaming(join.Register(0, ShapeOf(kMaxStripes + 1, 10)), "stripe.count");
  ExpectInvalidNaming(join.Register(2, ShapeOf(2, 10)), "stripe.index");
  ExpectInvalidNaming(join.Register(0, ShapeOf(2, 0)), "stripe.total_rows");
  ASSERT_TRUE(join.Register(0, ShapeOf(2, 10)).ok());
  ExpectInvalidNaming(join.Register(1, ShapeOf(3, 10)), "stripe.count");
  ExpectInvalidNaming(join.Register(1, ShapeOf(2, 11)), "stripe.total_rows");
  ExpectInvalidNaming(join.Register(1, ShapeOf(2, 10, "false")), "training");
  ExpectInvalidNaming(join.Register(0, ShapeOf(2, 10)), "stripe.index");
  EXPECT_TRUE(join.Register(1, ShapeOf(2, 10)).ok());
}

TEST(StripeJoinTest, RowsThatDoNotTileFailEveryStream) {
  for (auto [second_begin, second_rows] : {std::pair<int64_t, int64_t>{5, 5},  // gap at 4
                                           {3, 6},                             // overlap at 3
                                           {4, 5}}) {                          // short
    StripeJoin join;
    FakePart a, b;
    ASSERT_TRUE(join.Register(0, ShapeOf(2, 10)).ok());
    ASSERT_TRUE(join.Register(1, ShapeOf(2, 10)).ok());
    ASSERT_TRUE(join.Arrive(0, 0, 4, &a).ok());
    auto r = join.Arrive(1, second_begin, second_rows, &b);
    ExpectInvalidNaming(r.status(), "stripe.row_begin");
    ASSERT_EQ(a.aborts.size(), 1u);  // the waiting stream is told
    EXPECT_EQ(a.aborts[0], r.status());
    EXPECT_TRUE(b.aborts.empty());  // the arriving one finishes itself with the returned status
  }
  StripeJoin join;
  FakePart a;
  ASSERT_TRUE(join.Register(0, ShapeOf(2, 10)).ok());
  ExpectInvalidNaming(join.Arrive(0, 8, 4, &a).status(), "stripe.row_begin");  // past the end
}

TEST(StripeJoinTest, OneStreamsFailureAbortsTheWaitingOnesOnceAndSticks) {
  StripeJoin join;
  FakePart a, b, c;
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(join.Register(i, ShapeOf(3, 9)).ok());
  ASSERT_TRUE(join.Arrive(0, 0, 3, &a).ok());
  ASSERT_TRUE(join.Arrive(1, 3, 3, &b).ok());
  const absl::Status bad = absl::InvalidArgumentError("x: 12 bytes do not match shape");
  join.Fail(bad);
  join.Fail(absl::CancelledError("second failure"));
  ASSERT_EQ(a.aborts.size(), 1u);
  ASSERT_EQ(b.aborts.size(), 1u);
  EXPECT_EQ(a.aborts[0], bad);
  EXPECT_EQ(b.aborts[0], bad);
  // The stream still reading learns it when it arrives.
  EXPECT_EQ(join.Arrive(2, 6, 3, &c).status(), bad);
  EXPECT_TRUE(c.aborts.empty());
  EXPECT_EQ(join.Register(0, ShapeOf(3, 9)), bad);
}

TEST(StripeJoinsTest, AJoinLivesWhileAnyOfItsStreamsDoes) {
  StripeJoins joins;
  const std::string key = StripeJoins::Key("Forward", "layer", "session", 7);
  EXPECT_NE(key, StripeJoins::Key("Backward", "layer", "session", 7));
  EXPECT_NE(key, StripeJoins::Key("Forward", "layer", "session", 8));
  EXPECT_NE(StripeJoins::Key("F", "ab", "", 1), StripeJoins::Key("F", "a", "b", 1));
  auto first = joins.Enter(key, 0);
  auto second = joins.Enter(key, 0);
  EXPECT_EQ(first, second);
  EXPECT_EQ(joins.size(), 1u);
  joins.Leave(key, first);
  EXPECT_EQ(joins.size(), 1u);
  joins.Leave(key, second);
  EXPECT_EQ(joins.size(), 0u);
  // A new micro-batch under the same key gets a fresh join; leaving the old one does not end it.
  auto third = joins.Enter(key, 0);
  EXPECT_NE(third, first);
  joins.Leave(key, first);
  EXPECT_EQ(joins.size(), 1u);
  joins.Leave(key, third);
  EXPECT_EQ(joins.size(), 0u);
}

// A failed join whose count is known is kept after its last stream left, for a while: a stream
// of an index it never saw (a late sibling) gets its failure at once; one of an index it saw (a
// retry) gets a fresh join; after the retention, or once every index has been seen, it is gone.
TEST(StripeJoinsTest, AFailedJoinAnswersLateSiblingsThenGoes) {
  const std::string key = StripeJoins::Key("Forward", "layer", "", 7);
  const absl::Status bad = absl::InvalidArgumentError("stripe.row_begin: rows [8, 12)");
  auto fail_alone = [&](StripeJoins& joins, uint32_t index) {
    auto join = joins.Enter(key, index);
    EXPECT_TRUE(join->Register(index, ShapeOf(3, 10)).ok());
    join->Fail(bad);
    joins.Leave(key, join);
    return join;
  };
  {
    StripeJoins joins;
    auto failed = fail_alone(joins, 1);
    EXPECT_EQ(joins.size(), 1u);  // kept: streams 0 and 2 may still come
    auto late = joins.Enter(key, 0);
    EXPECT_EQ(late, failed);
    EXPECT_EQ(late->Register(0, ShapeOf(3, 10)), bad);
    joins.Leave(key, late);
    EXPECT_EQ(joins.size(), 1u);  // stream 2 may still come
    auto retry = joins.Enter(key, 1);
    EXPECT_NE(retry, failed);
    EXPECT_TRUE(retry->Register(1, ShapeOf(3, 10)).ok());
    joins.Leave(key, retry);
    EXPECT_EQ(joins.size(), 0u);
  }
  {  // every index seen: nothing left to wait for
    StripeJoins joins;
    auto failed = fail_alone(joins, 1);
    for (uint32_t i : {0u, 2u}) {
      auto late = joins.Enter(key, i);
      EXPECT_EQ(late->Register(i, ShapeOf(3, 10)), bad);
      joins.Leave(key, late);
    }
    EXPECT_EQ(joins.size(), 0u);
  }
  {  // past the retention, a stream of an unseen index starts afresh
    StripeJoins joins(std::chrono::milliseconds(20));
    auto failed = fail_alone(joins, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    auto fresh = joins.Enter(key, 0);
    EXPECT_NE(fresh, failed);
    EXPECT_TRUE(fresh->Register(0, ShapeOf(3, 10)).ok());
    joins.Leave(key, fresh);
    EXPECT_EQ(joins.size(), 0u);
  }
  {  // a cancelled call or a passed deadline leaves no failure behind: a later stream is a retry
    for (const absl::Status& why : {absl::CancelledError("stripe 1 of 3: the call was cancelled"),
                                    absl::DeadlineExceededError("deadline")}) {
      StripeJoins joins;
      auto join = joins.Enter(key, 1);
      EXPECT_TRUE(join->Register(1, ShapeOf(3, 10)).ok());
      join->Fail(why);
      joins.Leave(key, join);
      EXPECT_EQ(joins.size(), 0u) << why;
    }
  }
  {  // a join that failed before it knew its count waits for nobody
    StripeJoins joins;
    auto join = joins.Enter(key, 0);
    EXPECT_FALSE(join->Register(0, ShapeOf(1, 10)).ok());
    join->Fail(bad);
    joins.Leave(key, join);
    EXPECT_EQ(joins.size(), 0u);
  }
  {  // at most kMaxRetainedFailedJoins are kept
    StripeJoins joins;
    for (size_t i = 0; i < kMaxRetainedFailedJoins + 10; ++i) {
      const std::string k = StripeJoins::Key("Forward", "layer", "", 100 + i);
      auto join = joins.Enter(k, 0);
      EXPECT_TRUE(join->Register(0, ShapeOf(2, 10)).ok());
      join->Fail(bad);
      joins.Leave(k, join);
    }
    EXPECT_EQ(joins.size(), kMaxRetainedFailedJoins);
  }
}

}  // namespace
}  // namespace moe::server
