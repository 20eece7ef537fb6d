// What memory moe-server may commit, and how its budget follows from the machine's limits.
//
// The host limit is the tightest of the machine's MemTotal and the cgroup memory limit of this
// process's cgroup and every ancestor (v2 memory.max, v1 memory.limit_in_bytes): a container's
// limit is what the kernel OOM-kills at, whatever the machine has. Everything is read below a
// root directory so tests can give a fake /proc and /sys tree.
//
// The budget is what layer state and saved contexts (and, where they share the memory, request
// tensors in flight) may hold: --memory_budget_bytes when set, otherwise the limit of the memory
// they live in less a margin for what is not accounted (code, gRPC's buffers, a call's working
// memory, the CUDA context): a tenth of the limit, at least 256 MiB.
#ifndef MOE_SERVER_MEMORY_LIMITS_H_
#define MOE_SERVER_MEMORY_LIMITS_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "engine/layer.h"

namespace moe::server {

struct HostMemoryLimits {
  int64_t mem_total_bytes = -1;     // /proc/meminfo MemTotal; -1 when unreadable
  int64_t cgroup_limit_bytes = -1;  // the tightest cgroup limit; -1 when none applies
  // The smaller of the two known; -1 when neither is.
  int64_t limit_bytes() const;
};

// Reads the limits under `root` ("/" for the real ones): root/proc/meminfo, root/proc/self/cgroup
// and the cgroup files under root/sys/fs/cgroup. Missing or malformed files count as "no limit".
HostMemoryLimits ReadHostMemoryLimits(const std::string& root = "/");

// MemTotal of /proc/meminfo's text, in bytes; -1 when absent or malformed.
int64_t ParseMemTotal(absl::string_view meminfo);
// A cgroup limit file's text (memory.max or memory.limit_in_bytes), in bytes; -1 for "max", for
// v1's "unlimited" (a value of 2^62 or more) and for malformed text.
int64_t ParseCgroupLimit(absl::string_view text);

// `limit` less a tenth of it (at least 256 MiB); 0 when the margin takes it all.
int64_t BudgetWithinLimit(int64_t limit);

// The memory budgets the server admits against.
struct MemoryBudget {
  // Layer state and saved contexts: the engine's memory (the GPU's, or host memory for the CPU
  // engine).
  int64_t engine_bytes = 0;
  // Request tensors in flight, which are always in host memory. With the CPU engine the two are
  // one memory and one budget (engine_bytes, `shared`).
  int64_t host_bytes = 0;
  bool shared = false;
  std::string engine_memory;  // "host memory" or "cuda:0 memory", for messages
};

// The budgets for an engine whose memory is `device` (Engine::DeviceMemory), under `host`:
// `configured` > 0 sets the engine's budget; 0 derives it (BudgetWithinLimit of the host limit
// for host memory, of the device's free memory for a GPU). The host budget of a GPU engine is
// always derived from `host` (or, when no host limit is known, from nothing: unlimited).
MemoryBudget DeriveMemoryBudget(int64_t configured, const std::string& engine_name,
                                const DeviceMemoryInfo& device, const HostMemoryLimits& host);

}  // namespace moe::server

#endif  // MOE_SERVER_MEMORY_LIMITS_H_
