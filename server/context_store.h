// Saved training contexts, keyed by (layer, context id), within a byte budget.
//
// Ownership and "disconnect": a context belongs to the client session named by the
// "moe-session-id" metadata of the Forward that created it (or to no session). A session exists
// while that client's OpenSession stream is open; when the stream ends (the client closed it,
// its process died, or the connection broke) every context of the session is freed. Contexts
// without a session, and any context older than the TTL, are freed by Expire(). A Put that
// would exceed the budget is refused with RESOURCE_EXHAUSTED and changes nothing else.
// Thread-safe: reactors, the executor and the sweeper all use it.
#ifndef MOE_SERVER_CONTEXT_STORE_H_
#define MOE_SERVER_CONTEXT_STORE_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layer.h"
#include "server/metrics.h"

namespace moe::server {

class ContextStore {
 public:
  using Clock = std::chrono::steady_clock;

  ContextStore(int64_t budget_bytes, std::chrono::milliseconds ttl, Metrics* metrics);

  // Sessions. Put() with a session that is not open fails (FailedPrecondition), so a context can
  // never outlive the session it belongs to.
  void OpenSession(const std::string& session);
  void CloseSession(const std::string& session);  // frees the session's contexts
  bool SessionOpen(const std::string& session) const;
  int64_t sessions() const;

  // AlreadyExists for a live (layer, id); ResourceExhausted past the budget; the context is
  // destroyed in both cases.
  absl::Status Put(const std::string& layer, uint64_t id, const std::string& session,
                   std::unique_ptr<SavedContext> context);
  // Tokens of a live context (to validate dout before consuming it); NotFound otherwise.
  absl::StatusOr<int64_t> NumTokens(const std::string& layer, uint64_t id) const;
  // Removes and returns the context; NotFound for unknown or expired ids.
  absl::StatusOr<std::unique_ptr<SavedContext>> Take(const std::string& layer, uint64_t id);

  void DropLayer(const std::string& layer);
  // Frees contexts older than the TTL; returns how many.
  int64_t Expire();

  int64_t bytes() const;
  int64_t count() const;
  int64_t budget() const { return budget_; }
  std::pair<int64_t, int64_t> LayerUsage(const std::string& layer) const;  // count, bytes

 private:
  struct Entry {
    std::unique_ptr<SavedContext> context;
    int64_t bytes = 0;
    std::string session;
    Clock::time_point created;
  };
  using Key = std::pair<std::string, uint64_t>;
  // Drops entries matching `pred` under the lock; returns how many.
  template <typename Pred>
  int64_t DropIf(Pred pred, const char* reason);
  void PublishLocked();

  const int64_t budget_;
  const std::chrono::milliseconds ttl_;
  Metrics* metrics_;
  mutable std::mutex mu_;
  std::map<Key, Entry> entries_;
  std::set<std::string> sessions_;
  int64_t bytes_ = 0;
};

}  // namespace moe::server

#endif  // MOE_SERVER_CONTEXT_STORE_H_
