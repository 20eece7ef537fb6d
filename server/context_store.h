// Saved training contexts, keyed by (layer, principal, context id), within a byte budget.
//
// Ownership and "disconnect": a context belongs to the principal whose training Forward made it
// (server/auth.h) and to the client session named by that Forward's "moe-session-id" metadata
// (or to no session). A session belongs to the principal that opened it and exists while that
// client's OpenSession stream is open; when the stream ends (the client closed it, its process
// died, or the connection broke) every context of the session is freed. Contexts of an open
// session are freed once older than the TTL; contexts made outside a session once older than the
// (shorter) sessionless TTL, since nothing else frees them when their client goes away.
//
// Principals: each principal has its own context ids. A call finds only its own principal's
// contexts, so another principal's context is NOT_FOUND, exactly as an id never used: context ids
// are chosen by clients, and a different answer would tell a caller which ids another principal
// has in flight. A call naming another principal's session is PERMISSION_DENIED (session ids are
// random and handed only to their opener, so naming one is a stolen or forged id).
//
// A Put that would exceed the context budget, its principal's context quota or the memory budget
// (the MemoryLedger, when given) is refused with RESOURCE_EXHAUSTED and changes nothing else.
// Thread-safe: reactors, the executor and the sweeper all use it.
#ifndef MOE_SERVER_CONTEXT_STORE_H_
#define MOE_SERVER_CONTEXT_STORE_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layer.h"
#include "server/memory_ledger.h"
#include "server/metrics.h"

namespace moe::server {

class ContextStore {
 public:
  using Clock = std::chrono::steady_clock;

  // `ttl` for contexts of an open session, `sessionless_ttl` for the others. `ledger` (may be
  // null) charges every context to its principal's quota and the memory budget.
  ContextStore(int64_t budget_bytes, std::chrono::milliseconds ttl,
               std::chrono::milliseconds sessionless_ttl, MemoryLedger* ledger, Metrics* metrics);

  // Sessions. Put() with a session that is not open fails (FailedPrecondition), so a context can
  // never outlive the session it belongs to.
  void OpenSession(const std::string& session, const std::string& principal);
  void CloseSession(const std::string& session);  // frees the session's contexts
  // OK for no session ("") or an open session of `principal`; FailedPrecondition when the
  // session is not open; PermissionDenied when it is another principal's.
  absl::Status CheckSession(const std::string& session, const std::string& principal) const;
  int64_t sessions() const;

  // AlreadyExists for a live (layer, principal, id); the errors of CheckSession; ResourceExhausted
  // past the budget, the principal's quota or the memory budget. The context is destroyed on
  // every error.
  absl::Status Put(const std::string& layer, uint64_t id, const std::string& principal,
                   const std::string& session, std::unique_ptr<SavedContext> context);
  // Tokens of a live context of `principal` (to validate dout before consuming it); NotFound
  // otherwise.
  absl::StatusOr<int64_t> NumTokens(const std::string& layer, uint64_t id,
                                    const std::string& principal) const;
  // Removes and returns the context; NotFound for unknown or expired ids and for other
  // principals' contexts.
  absl::StatusOr<std::unique_ptr<SavedContext>> Take(const std::string& layer, uint64_t id,
                                                     const std::string& principal);

  void DropLayer(const std::string& layer);
  // Frees contexts older than their TTL; returns how many.
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
  struct Key {
    std::string layer;
    std::string principal;
    uint64_t id = 0;
    bool operator<(const Key& o) const {
      return std::tie(layer, principal, id) < std::tie(o.layer, o.principal, o.id);
    }
  };
  bool Live(const Entry& e, Clock::time_point now) const;
  absl::Status CheckSessionLocked(const std::string& session, const std::string& principal) const;
  // Drops entries matching `pred` under the lock; returns how many.
  template <typename Pred>
  int64_t DropIf(Pred pred, const char* reason);
  void PublishLocked();

  const int64_t budget_;
  const std::chrono::milliseconds ttl_;
  const std::chrono::milliseconds sessionless_ttl_;
  MemoryLedger* ledger_;
  Metrics* metrics_;
  mutable std::mutex mu_;
  std::map<Key, Entry> entries_;
  std::map<std::string, std::string> sessions_;  // session -> its principal
  int64_t bytes_ = 0;
};

}  // namespace moe::server

#endif  // MOE_SERVER_CONTEXT_STORE_H_
