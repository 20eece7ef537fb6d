// Host memory limits and the derived budgets (see memory_limits.h).
//
// cgroup v2: /proc/self/cgroup has a line "0::<path>"; the limit of <path> and of each ancestor
// is <mount>/<...>/memory.max, and the tightest applies. cgroup v1: the line whose controller
// list names "memory" gives the path below <mount>/memory, with memory.limit_in_bytes. In a
// container with its own cgroup namespace the path is "/" and the mount's root file is the
// container's limit; where the path is not found under the mount (a host namespace path), the
// mount's root still counts.
#include "server/memory_limits.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe::server {
namespace {

constexpr int64_t kMinMarginBytes = int64_t{256} << 20;
// v1 reports "no limit" as the largest page-aligned value near 2^63.
constexpr int64_t kNoLimitAbove = int64_t{1} << 62;

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream text;
  text << in.rdbuf();
  *out = text.str();
  return true;
}

// The tightest known limit of `a` and `b` (-1: none).
int64_t Tighter(int64_t a, int64_t b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return std::min(a, b);
}

// `file` in the cgroup directory `path` below `mount` and in each of its ancestors up to the
// mount's root: the tightest limit among those that exist.
int64_t TightestUpTheTree(const std::string& mount, absl::string_view path,
                          const std::string& file) {
  std::vector<std::string> parts;
  for (absl::string_view p : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (p == "." || p == "..") return -1;  // not a cgroup path
    parts.emplace_back(p);
  }
  int64_t limit = -1;
  for (size_t depth = 0; depth <= parts.size(); ++depth) {
    std::string dir = mount;
    for (size_t i = 0; i < depth; ++i) absl::StrAppend(&dir, "/", parts[i]);
    std::string text;
    if (ReadFile(absl::StrCat(dir, "/", file), &text)) {
      limit = Tighter(limit, ParseCgroupLimit(text));
    }
  }
  return limit;
}

}  // namespace

int64_t HostMemoryLimits::limit_bytes() const {
  return Tighter(mem_total_bytes, cgroup_limit_bytes);
}

int64_t ParseMemTotal(absl::string_view meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemTotal:")) continue;
    line = absl::StripAsciiWhitespace(line);
    int64_t scale = 1;
    if (absl::ConsumeSuffix(&line, "kB")) scale = 1024;
    int64_t value = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value) || value < 0 ||
        value > std::numeric_limits<int64_t>::max() / scale) {
      return -1;
    }
    return value * scale;
  }
  return -1;
}

int64_t ParseCgroupLimit(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  int64_t value = 0;
  if (text == "max" || !absl::SimpleAtoi(text, &value) || value < 0 || value >= kNoLimitAbove) {
    return -1;
  }
  return value;
}

HostMemoryLimits ReadHostMemoryLimits(const std::string& root) {
  const std::string base = root == "/" ? "" : root;
  HostMemoryLimits limits;
  std::string text;
  if (ReadFile(base + "/proc/meminfo", &text)) limits.mem_total_bytes = ParseMemTotal(text);

  const std::string mount = base + "/sys/fs/cgroup";
  std::string v2_path = "/", v1_path = "/";
  if (ReadFile(base + "/proc/self/cgroup", &text)) {
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      // hierarchy-id:controller-list:path (the path may itself contain ':').
      std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
      if (f.size() != 3) continue;
      if (f[0] == "0" && f[1].empty()) {
        v2_path = std::string(f[2]);
      } else {
        for (absl::string_view c : absl::StrSplit(f[1], ',')) {
          if (c == "memory") v1_path = std::string(f[2]);
        }
      }
    }
  }
  limits.cgroup_limit_bytes =
      Tighter(TightestUpTheTree(mount, v2_path, "memory.max"),
              TightestUpTheTree(mount + "/memory", v1_path, "memory.limit_in_bytes"));
  return limits;
}

int64_t BudgetWithinLimit(int64_t limit) {
  if (limit <= 0) return 0;
  const int64_t margin = std::max(limit / 10, kMinMarginBytes);
  return limit > margin ? limit - margin : 0;
}

MemoryBudget DeriveMemoryBudget(int64_t configured, const std::string& engine_name,
                                const DeviceMemoryInfo& device, const HostMemoryLimits& host) {
  MemoryBudget budget;
  int64_t host_limit = host.limit_bytes();
  if (device.host) {
    if (host_limit < 0) host_limit = device.total_bytes;
    budget.shared = true;
    budget.engine_memory = "host memory";
    budget.engine_bytes = configured > 0 ? configured : BudgetWithinLimit(host_limit);
    budget.host_bytes = budget.engine_bytes;
    return budget;
  }
  budget.engine_memory = absl::StrCat(engine_name, " memory");
  budget.engine_bytes = configured > 0 ? configured : BudgetWithinLimit(device.free_bytes);
  budget.host_bytes =
      host_limit < 0 ? std::numeric_limits<int64_t>::max() : BudgetWithinLimit(host_limit);
  return budget;
}

}  // namespace moe::server
