// DispatchCpu against an independent construction (a stable sort of (local expert, entry)),
// plus its structural invariants, on random and adversarial routings. Outputs are poisoned
// first so an element the dispatch forgets to write shows up.
#include "kernels/cpu/dispatch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace moe::kernels {
namespace {

constexpr int32_t kPoison = 0x7eadbeef;

struct Dispatch {
  std::vector<int32_t> counts, offsets, entries, slot_of;
};

Dispatch RunDispatch(const std::vector<int32_t>& ids, int64_t t, int32_t k, int32_t first,
                     int32_t count) {
  Dispatch d;
  d.counts.assign(count, kPoison);
  d.offsets.assign(count + 1, kPoison);
  d.entries.assign(t * k, kPoison);
  d.slot_of.assign(t * k, kPoison);
  DispatchCpu(ids.data(), t, k, first, count, d.counts.data(), d.offsets.data(), d.entries.data(),
              d.slot_of.data());
  return d;
}

// Checks `d` against a stable sort and the invariants of dispatch.h; `what` names the case.
void Check(const std::vector<int32_t>& ids, int64_t t, int32_t k, int32_t first, int32_t count,
           const std::string& what) {
  SCOPED_TRACE(what + " T=" + std::to_string(t) + " K=" + std::to_string(k) +
               " first=" + std::to_string(first) + " count=" + std::to_string(count));
  const Dispatch d = RunDispatch(ids, t, k, first, count);
  std::vector<std::pair<int32_t, int32_t>> routed;  // (local expert, entry)
  for (int32_t i = 0; i < t * k; ++i) {
    const int32_t l = ids[i] - first;
    if (l >= 0 && l < count) routed.emplace_back(l, i);
  }
  std::stable_sort(routed.begin(), routed.end());
  const int32_t n = static_cast<int32_t>(routed.size());
  ASSERT_EQ(d.offsets[0], 0);
  ASSERT_EQ(d.offsets[count], n);
  for (int32_t l = 0; l < count; ++l) {
    const int32_t want = static_cast<int32_t>(
        std::count_if(routed.begin(), routed.end(), [&](const auto& r) { return r.first == l; }));
    ASSERT_EQ(d.counts[l], want) << "expert " << l;
    ASSERT_EQ(d.offsets[l + 1] - d.offsets[l], want) << "expert " << l;
  }
  for (int32_t s = 0; s < n; ++s) {
    ASSERT_EQ(d.entries[s], routed[s].second) << "slot " << s;
    ASSERT_EQ(d.slot_of[d.entries[s]], s) << "slot " << s;
  }
  for (int32_t s = n; s < t * k; ++s) ASSERT_EQ(d.entries[s], kPoison) << "wrote past N";
  for (int32_t i = 0; i < t * k; ++i) {
    const int32_t l = ids[i] - first;
    if (l < 0 || l >= count) ASSERT_EQ(d.slot_of[i], -1) << "entry " << i;
  }
}

// T tokens, K distinct experts each out of E, uniformly.
std::vector<int32_t> RandomRouting(int64_t t, int32_t k, int32_t e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> perm(e), ids;
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = 0; i < t; ++i) {
    std::shuffle(perm.begin(), perm.end(), rng);
    ids.insert(ids.end(), perm.begin(), perm.begin() + k);
  }
  return ids;
}

TEST(DispatchCpuTest, RandomRoutingMatchesStableSort) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    const auto ids = RandomRouting(333, 3, 16, seed);
    Check(ids, 333, 3, 0, 16, "random seed " + std::to_string(seed));
  }
}

TEST(DispatchCpuTest, AllTokensOnOneExpert) {
  std::vector<int32_t> ids(257, 5);
  Check(ids, 257, 1, 0, 8, "all on expert 5");
  Dispatch d = RunDispatch(ids, 257, 1, 0, 8);
  EXPECT_EQ(d.counts[5], 257);
  for (int l = 0; l < 8; ++l)
    if (l != 5) EXPECT_EQ(d.counts[l], 0);
}

TEST(DispatchCpuTest, EmptyExperts) {
  // Only even experts used: every odd expert's segment is empty, offsets still monotone.
  std::vector<int32_t> ids;
  for (int t = 0; t < 50; ++t) {
    ids.push_back((2 * t) % 10);
    ids.push_back((2 * t + 2) % 10);
  }
  Check(ids, 50, 2, 0, 10, "even experts only");
}

TEST(DispatchCpuTest, TopKEqualsNumExperts) {
  Check(RandomRouting(40, 6, 6, 7), 40, 6, 0, 6, "K = E");
}

TEST(DispatchCpuTest, SingleToken) { Check({3, 0, 2}, 1, 3, 0, 4, "T = 1"); }

TEST(DispatchCpuTest, ShardRanges) {
  const auto ids = RandomRouting(200, 4, 12, 11);
  for (int32_t first : {0, 3, 8, 11}) {
    for (int32_t count : {1, 4}) {
      if (first + count > 12) continue;
      Check(ids, 200, 4, first, count, "shard");
    }
  }
}

TEST(DispatchCpuTest, ShardThatReceivesNothing) {
  std::vector<int32_t> ids(64, 0);
  Check(ids, 64, 1, 4, 4, "no token in shard");
  Dispatch d = RunDispatch(ids, 64, 1, 4, 4);
  EXPECT_EQ(d.offsets[4], 0);
}

}  // namespace
}  // namespace moe::kernels
