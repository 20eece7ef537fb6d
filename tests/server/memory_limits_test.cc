// Host memory limits from a fake /proc and /sys tree (cgroup v2 and v1, nested cgroups, "max",
// missing files), their parsers, and the budgets derived from them.
#include "server/memory_limits.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_split.h"

namespace moe::server {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

// A fresh, empty directory standing for "/", removed with it: a directory left by an earlier
// run (its name made of a reused pid) would show another test's files.
class FakeRoot {
 public:
  FakeRoot() {
    std::string name = ::testing::TempDir() + "/moe_memory_limits_XXXXXX";
    if (::mkdtemp(name.data()) != nullptr) root_ = name;
    EXPECT_FALSE(root_.empty()) << "mkdtemp in " << ::testing::TempDir() << " failed";
  }
  ~FakeRoot() {
    if (!root_.empty()) std::filesystem::remove_all(root_);
  }
  FakeRoot(const FakeRoot&) = delete;
  FakeRoot& operator=(const FakeRoot&) = delete;
  // Writes `text` to root/`path`, making its directories.
  void Write(const std::string& path, const std::string& text) {
    if (root_.empty()) return;  // never the real "/"
    std::string dir = root_;
    std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      dir += "/" + parts[i];
      ::mkdir(dir.c_str(), 0755);
    }
    std::ofstream(root_ + "/" + path) << text;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

constexpr char kMemInfo[] =
    "MemTotal:       16318480 kB\n"
    "MemFree:         1234567 kB\n"
    "MemAvailable:    9876543 kB\n";

TEST(MemoryLimitsTest, ParsesMemTotal) {
  EXPECT_EQ(ParseMemTotal(kMemInfo), int64_t{16318480} * 1024);
  EXPECT_EQ(ParseMemTotal("MemFree: 1 kB\n"), -1);
  EXPECT_EQ(ParseMemTotal("MemTotal: lots kB\n"), -1);
  EXPECT_EQ(ParseMemTotal("MemTotal: -5 kB\n"), -1);
  EXPECT_EQ(ParseMemTotal("MemTotal: 99999999999999999999 kB\n"), -1);
}

TEST(MemoryLimitsTest, ParsesCgroupLimits) {
  EXPECT_EQ(ParseCgroupLimit("3221225472\n"), 3 * kGiB);
  EXPECT_EQ(ParseCgroupLimit("max\n"), -1);
  EXPECT_EQ(ParseCgroupLimit("9223372036854771712\n"), -1);  // v1 "unlimited"
  EXPECT_EQ(ParseCgroupLimit(""), -1);
  EXPECT_EQ(ParseCgroupLimit("12abc"), -1);
}

TEST(MemoryLimitsTest, CgroupV2TakesTheTightestLimitUpTheTree) {
  FakeRoot fake;
  fake.Write("proc/meminfo", kMemInfo);
  fake.Write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  fake.Write("sys/fs/cgroup/kubepods/memory.max", "8589934592\n");
  fake.Write("sys/fs/cgroup/kubepods/pod1/memory.max", "3221225472\n");
  fake.Write("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n");
  HostMemoryLimits limits = ReadHostMemoryLimits(fake.root());
  EXPECT_EQ(limits.mem_total_bytes, int64_t{16318480} * 1024);
  EXPECT_EQ(limits.cgroup_limit_bytes, 3 * kGiB);
  EXPECT_EQ(limits.limit_bytes(), 3 * kGiB);
}

TEST(MemoryLimitsTest, CgroupV2NamespaceRootIsTheContainersLimit) {
  FakeRoot fake;
  fake.Write("proc/meminfo", kMemInfo);
  fake.Write("proc/self/cgroup", "0::/\n");
  fake.Write("sys/fs/cgroup/memory.max", "1073741824\n");
  EXPECT_EQ(ReadHostMemoryLimits(fake.root()).limit_bytes(), kGiB);
}

TEST(MemoryLimitsTest, CgroupV1UsesTheMemoryController) {
  FakeRoot fake;
  fake.Write("proc/meminfo", kMemInfo);
  fake.Write("proc/self/cgroup",
             "12:cpu,cpuacct:/docker/abc\n"
             "4:memory:/docker/abc\n"
             "1:name=systemd:/docker/abc\n");
  fake.Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  fake.Write("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "2147483648\n");
  EXPECT_EQ(ReadHostMemoryLimits(fake.root()).cgroup_limit_bytes, 2 * kGiB);
}

TEST(MemoryLimitsTest, NoCgroupLimitLeavesMemTotal) {
  FakeRoot fake;
  fake.Write("proc/meminfo", "MemTotal: 4096 kB\n");
  fake.Write("proc/self/cgroup", "0::/user.slice\n");
  fake.Write("sys/fs/cgroup/user.slice/memory.max", "max\n");
  HostMemoryLimits limits = ReadHostMemoryLimits(fake.root());
  EXPECT_EQ(limits.cgroup_limit_bytes, -1);
  EXPECT_EQ(limits.limit_bytes(), 4 * kMiB);
  // Nothing readable at all: no limit known.
  FakeRoot empty;
  EXPECT_EQ(ReadHostMemoryLimits(empty.root()).limit_bytes(), -1);
}

TEST(MemoryLimitsTest, ACgroupLimitAboveMemTotalLeavesMemTotal) {
  FakeRoot fake;
  fake.Write("proc/meminfo", "MemTotal: 1048576 kB\n");
  fake.Write("proc/self/cgroup", "0::/\n");
  fake.Write("sys/fs/cgroup/memory.max", "4294967296\n");
  EXPECT_EQ(ReadHostMemoryLimits(fake.root()).limit_bytes(), kGiB);
}

TEST(MemoryLimitsTest, BudgetKeepsATenthAtLeast256MiB) {
  EXPECT_EQ(BudgetWithinLimit(10 * kGiB), 9 * kGiB);
  EXPECT_EQ(BudgetWithinLimit(kGiB), kGiB - 256 * kMiB);
  EXPECT_EQ(BudgetWithinLimit(200 * kMiB), 0);
  EXPECT_EQ(BudgetWithinLimit(-1), 0);
}

TEST(MemoryLimitsTest, DerivesOneBudgetForHostMemory) {
  DeviceMemoryInfo host_engine;
  host_engine.total_bytes = 64 * kGiB;
  host_engine.free_bytes = 10 * kGiB;
  host_engine.host = true;
  HostMemoryLimits limits;
  limits.mem_total_bytes = 64 * kGiB;
  limits.cgroup_limit_bytes = 3 * kGiB;
  MemoryBudget b = DeriveMemoryBudget(0, "cpu", host_engine, limits);
  EXPECT_TRUE(b.shared);
  EXPECT_EQ(b.engine_bytes, 3 * kGiB - 3 * kGiB / 10);
  EXPECT_EQ(b.host_bytes, b.engine_bytes);
  EXPECT_EQ(b.engine_memory, "host memory");
  EXPECT_EQ(DeriveMemoryBudget(12345, "cpu", host_engine, limits).engine_bytes, 12345);
  // No limit readable: the engine's own report of the machine's memory.
  EXPECT_EQ(DeriveMemoryBudget(0, "cpu", host_engine, HostMemoryLimits{}).engine_bytes,
            64 * kGiB - 64 * kGiB / 10);
}

TEST(MemoryLimitsTest, DerivesADeviceAndAHostBudgetForAGpu) {
  DeviceMemoryInfo gpu;
  gpu.total_bytes = 80 * kGiB;
  gpu.free_bytes = 70 * kGiB;
  HostMemoryLimits limits;
  limits.mem_total_bytes = 100 * kGiB;
  MemoryBudget b = DeriveMemoryBudget(0, "cuda:0", gpu, limits);
  EXPECT_FALSE(b.shared);
  EXPECT_EQ(b.engine_bytes, 63 * kGiB);
  EXPECT_EQ(b.host_bytes, 90 * kGiB);
  EXPECT_EQ(b.engine_memory, "cuda:0 memory");
  EXPECT_EQ(DeriveMemoryBudget(5 * kGiB, "cuda:0", gpu, limits).engine_bytes, 5 * kGiB);
  EXPECT_EQ(DeriveMemoryBudget(0, "cuda:0", gpu, HostMemoryLimits{}).host_bytes,
            std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace moe::server
