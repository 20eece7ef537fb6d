// The saved-context store (see context_store.h). Contexts are destroyed outside the lock, so
// freeing a large context never stalls other streams' lookups.
#include "server/context_store.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::server {

ContextStore::ContextStore(int64_t budget_bytes, std::chrono::milliseconds ttl,
                           std::chrono::milliseconds sessionless_ttl, MemoryLedger* ledger,
                           Metrics* metrics)
    : budget_(budget_bytes),
      ttl_(ttl),
      sessionless_ttl_(sessionless_ttl),
      ledger_(ledger),
      metrics_(metrics) {
  if (metrics_) {
    metrics_->SavedContextBudget(budget_);
    metrics_->SavedContexts(0, 0);
  }
}

void ContextStore::OpenSession(const std::string& session, const std::string& principal) {
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[session] = principal;
  if (metrics_) metrics_->Sessions(static_cast<int64_t>(sessions_.size()));
}

void ContextStore::CloseSession(const std::string& session) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(session);
    if (metrics_) metrics_->Sessions(static_cast<int64_t>(sessions_.size()));
  }
  DropIf([&](const Key&, const Entry& e) { return e.session == session; }, "session_closed");
}

absl::Status ContextStore::CheckSession(const std::string& session,
                                        const std::string& principal) const {
  if (session.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return CheckSessionLocked(session, principal);
}

absl::Status ContextStore::CheckSessionLocked(const std::string& session,
                                              const std::string& principal) const {
  if (session.empty()) return absl::OkStatus();
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("moe-session-id: session ", session, " is not open"));
  }
  if (it->second != principal) {
    return absl::PermissionDeniedError(absl::StrCat(
        "moe-session-id: session ", session, " is not a session of principal \"", principal, "\""));
  }
  return absl::OkStatus();
}

int64_t ContextStore::sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(sessions_.size());
}

bool ContextStore::Live(const Entry& e, Clock::time_point now) const {
  return now - e.created <= (e.session.empty() ? sessionless_ttl_ : ttl_);
}

absl::Status ContextStore::Put(const std::string& layer, uint64_t id, const std::string& principal,
                               const std::string& session, std::unique_ptr<SavedContext> context) {
  const int64_t size = context->bytes();
  std::lock_guard<std::mutex> lock(mu_);
  MOE_RETURN_IF_ERROR(CheckSessionLocked(session, principal));
  Key key{layer, principal, id};
  if (entries_.count(key)) {
    return absl::AlreadyExistsError(
        absl::StrCat("context_id: ", id, " is already live for layer ", layer));
  }
  if (bytes_ + size > budget_) {
    if (metrics_) metrics_->ContextRejected();
    return absl::ResourceExhaustedError(
        absl::StrCat("saved-context budget: this context needs ", size, " bytes, ",
                     budget_ - bytes_, " of ", budget_,
                     " are free; run Backward for outstanding contexts or send smaller "
                     "micro-batches"));
  }
  if (ledger_) {
    MOE_RETURN_IF_ERROR(ledger_->AdmitContext(principal, size));
  }
  Entry& e = entries_[key];
  e.context = std::move(context);
  e.bytes = size;
  e.session = session;
  e.created = Clock::now();
  bytes_ += size;
  PublishLocked();
  return absl::OkStatus();
}

namespace {
absl::Status NoContext(const std::string& layer, uint64_t id) {
  return absl::NotFoundError(absl::StrCat("context_id: no live context ", id, " for layer ", layer,
                                          " (never created, already consumed, expired or freed "
                                          "with its session)"));
}
}  // namespace

absl::StatusOr<int64_t> ContextStore::NumTokens(const std::string& layer, uint64_t id,
                                                const std::string& principal) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(Key{layer, principal, id});
  if (it == entries_.end() || !Live(it->second, Clock::now())) return NoContext(layer, id);
  return it->second.context->num_tokens();
}

absl::StatusOr<std::unique_ptr<SavedContext>> ContextStore::Take(const std::string& layer,
                                                                 uint64_t id,
                                                                 const std::string& principal) {
  std::unique_ptr<SavedContext> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key{layer, principal, id});
    if (it != entries_.end() && Live(it->second, Clock::now())) {
      out = std::move(it->second.context);
      bytes_ -= it->second.bytes;
      if (ledger_) ledger_->ReleaseContext(principal, it->second.bytes);
      entries_.erase(it);
      PublishLocked();
      return out;
    }
  }
  return NoContext(layer, id);
}

template <typename Pred>
int64_t ContextStore::DropIf(Pred pred, const char* reason) {
  std::vector<std::unique_ptr<SavedContext>> doomed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (pred(it->first, it->second)) {
        bytes_ -= it->second.bytes;
        if (ledger_) ledger_->ReleaseContext(it->first.principal, it->second.bytes);
        doomed.push_back(std::move(it->second.context));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    if (!doomed.empty()) {
      PublishLocked();
      if (metrics_) metrics_->ContextsDropped(reason, static_cast<int64_t>(doomed.size()));
    }
  }
  return static_cast<int64_t>(doomed.size());
}

void ContextStore::DropLayer(const std::string& layer) {
  DropIf([&](const Key& k, const Entry&) { return k.layer == layer; }, "layer_deleted");
}

int64_t ContextStore::Expire() {
  const Clock::time_point now = Clock::now();
  return DropIf([&](const Key&, const Entry& e) { return !Live(e, now); }, "expired");
}

int64_t ContextStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

int64_t ContextStore::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(entries_.size());
}

std::pair<int64_t, int64_t> ContextStore::LayerUsage(const std::string& layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0, b = 0;
  for (auto it = entries_.lower_bound(Key{layer, "", 0});
       it != entries_.end() && it->first.layer == layer; ++it) {
    ++n;
    b += it->second.bytes;
  }
  return {n, b};
}

void ContextStore::PublishLocked() {
  if (metrics_) metrics_->SavedContexts(static_cast<int64_t>(entries_.size()), bytes_);
}

}  // namespace moe::server
