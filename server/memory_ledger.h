// MemoryLedger: admission control for moe-server's memory, and per-principal quotas.
//
// What the server keeps for its clients is charged here BEFORE it is allocated, against the
// budget of the memory it lives in (memory_limits.h): a layer's state (Engine::LayerStateBytes,
// reconciled with the layer's resident_bytes() once built), every saved context, and the
// tensors of each request being assembled, and the host memory an engine call allocates while
// it runs (Engine::HostWorkingBytes: working buffers, results). A charge that does not fit is
// refused with RESOURCE_EXHAUSTED naming the bytes needed and free, and nothing changes; a
// refused request allocates nothing. What is not charged (results being written back, weight
// exports, checkpoint bytes being read or written, the process itself) is what the margin of a
// derived budget is for.
//
// Two budgets: the engine's memory holds layer state and saved contexts; request tensors are
// in host memory. With the CPU engine both are host memory and one budget covers all three.
//
// Quotas, per principal (0 = unlimited): the layer-state bytes of the layers a principal created,
// and the bytes of its saved contexts. Past one, RESOURCE_EXHAUSTED names the quota's flag.
// Thread-safe.
#ifndef MOE_SERVER_MEMORY_LEDGER_H_
#define MOE_SERVER_MEMORY_LEDGER_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/memory_limits.h"

namespace moe::server {

class Metrics;

class MemoryLedger {
 public:
  struct Limits {
    MemoryBudget budget;
    int64_t principal_layer_bytes_quota = 0;    // 0: unlimited
    int64_t principal_context_bytes_quota = 0;  // 0: unlimited
  };

  // A request's tensors in flight, or an engine call's host working memory while it runs: a
  // charge against the host budget, raised as bytes arrive and dropped when the handle is reset
  // or destroyed. Movable; the ledger must outlive it.
  class RequestCharge {
   public:
    RequestCharge() = default;  // charges nothing and cannot be raised
    RequestCharge(RequestCharge&& other) noexcept;
    RequestCharge& operator=(RequestCharge&& other) noexcept;
    ~RequestCharge() { Reset(); }

    // Sets this charge to `bytes`. A rise that does not fit is ResourceExhausted naming `what`
    // (the tensor, or the call), and the charge stays as it was.
    absl::Status Set(int64_t bytes, absl::string_view what);
    void Reset();
    int64_t bytes() const { return bytes_; }

   private:
    friend class MemoryLedger;
    RequestCharge(MemoryLedger* ledger, bool working) : ledger_(ledger), working_(working) {}
    MemoryLedger* ledger_ = nullptr;
    bool working_ = false;  // an engine call's working memory, not a request's tensors
    int64_t bytes_ = 0;
  };

  struct Usage {
    int64_t layer_bytes = 0;
    int64_t context_bytes = 0;
    int64_t request_bytes = 0;
    // What the engine's budget holds: layers and contexts, and requests when shared.
    int64_t engine_bytes() const;
    bool shared = false;
  };

  MemoryLedger(Limits limits, Metrics* metrics);

  const Limits& limits() const { return limits_; }

  // A new layer `layer` of `principal` holding `bytes` of state: refused past the principal's
  // layer quota or the engine's budget.
  absl::Status AdmitLayer(const std::string& principal, const std::string& layer, int64_t bytes);
  // The layer's charge becomes `bytes` (what it reports once built), without a check: the
  // memory is already held.
  void SetLayerBytes(const std::string& layer, int64_t bytes);
  // Frees the layer's charge (unknown layers: nothing).
  void ReleaseLayer(const std::string& layer);

  // A saved context of `bytes` for `principal`: refused past its context quota or the engine's
  // budget.
  absl::Status AdmitContext(const std::string& principal, int64_t bytes);
  void ReleaseContext(const std::string& principal, int64_t bytes);

  RequestCharge NewRequestCharge() { return RequestCharge(this, /*working=*/false); }
  // Held around an engine call: Set(Engine::HostWorkingBytes(...)) before it, dropped after.
  RequestCharge NewWorkingCharge() { return RequestCharge(this, /*working=*/true); }

  Usage usage() const;
  int64_t principal_layer_bytes(const std::string& principal) const;
  int64_t principal_context_bytes(const std::string& principal) const;

 private:
  int64_t EngineFreeLocked() const;
  int64_t HostFreeLocked() const;
  absl::Status ChangeRequestBytes(int64_t from, int64_t to, absl::string_view what, bool working);
  void PublishLocked();

  const Limits limits_;
  Metrics* metrics_;
  mutable std::mutex mu_;
  Usage usage_;
  struct LayerCharge {
    std::string principal;
    int64_t bytes = 0;
  };
  std::map<std::string, LayerCharge> layers_;               // by layer name
  std::map<std::string, int64_t> principal_layer_bytes_;    // no zero entries
  std::map<std::string, int64_t> principal_context_bytes_;  // no zero entries
};

}  // namespace moe::server

#endif  // MOE_SERVER_MEMORY_LEDGER_H_
