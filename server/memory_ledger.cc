// The memory ledger (see memory_ledger.h). Every check and its charge happen under one lock, so
// two calls can never both fit into the same free bytes.
#include "server/memory_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"

namespace moe::server {
namespace {

void Add(std::map<std::string, int64_t>& by_principal, const std::string& principal,
         int64_t delta) {
  auto it = by_principal.emplace(principal, 0).first;
  it->second += delta;
  if (it->second == 0) by_principal.erase(it);
}

int64_t Get(const std::map<std::string, int64_t>& by_principal, const std::string& principal) {
  auto it = by_principal.find(principal);
  return it == by_principal.end() ? 0 : it->second;
}

}  // namespace

int64_t MemoryLedger::Usage::engine_bytes() const {
  return layer_bytes + context_bytes + (shared ? request_bytes : 0);
}

MemoryLedger::RequestCharge::RequestCharge(RequestCharge&& other) noexcept
    : ledger_(other.ledger_), working_(other.working_), bytes_(other.bytes_) {
  other.bytes_ = 0;
}

MemoryLedger::RequestCharge& MemoryLedger::RequestCharge::operator=(
    RequestCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    ledger_ = other.ledger_;
    working_ = other.working_;
    bytes_ = other.bytes_;
    other.bytes_ = 0;
  }
  return *this;
}

absl::Status MemoryLedger::RequestCharge::Set(int64_t bytes, absl::string_view what) {
  if (bytes == bytes_) return absl::OkStatus();
  if (ledger_ == nullptr) {
    return absl::InternalError("a request charge without a ledger cannot be raised");
  }
  absl::Status st = ledger_->ChangeRequestBytes(bytes_, bytes, what, working_);
  if (st.ok()) bytes_ = bytes;
  return st;
}

void MemoryLedger::RequestCharge::Reset() {
  if (ledger_ != nullptr && bytes_ != 0) {
    ledger_->ChangeRequestBytes(bytes_, 0, "", working_).IgnoreError();  // a fall always fits
  }
  bytes_ = 0;
}

MemoryLedger::MemoryLedger(Limits limits, Metrics* metrics)
    : limits_(std::move(limits)), metrics_(metrics) {
  usage_.shared = limits_.budget.shared;
  if (metrics_) {
    if (limits_.budget.shared) {
      metrics_->MemoryBudgetBytes("host", limits_.budget.engine_bytes);
    } else {
      metrics_->MemoryBudgetBytes("device", limits_.budget.engine_bytes);
      metrics_->MemoryBudgetBytes("host", limits_.budget.host_bytes);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  PublishLocked();
}

int64_t MemoryLedger::EngineFreeLocked() const {
  return limits_.budget.engine_bytes - usage_.engine_bytes();
}

int64_t MemoryLedger::HostFreeLocked() const {
  return limits_.budget.shared ? EngineFreeLocked()
                               : limits_.budget.host_bytes - usage_.request_bytes;
}

absl::Status MemoryLedger::AdmitLayer(const std::string& principal, const std::string& layer,
                                      int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layers_.count(layer)) {
    return absl::AlreadyExistsError(absl::StrCat("layer \"", layer, "\" is already charged"));
  }
  const int64_t quota = limits_.principal_layer_bytes_quota;
  const int64_t held = Get(principal_layer_bytes_, principal);
  if (quota > 0 && bytes > quota - held) {
    if (metrics_) metrics_->AdmissionRejected("layer_quota");
    return absl::ResourceExhaustedError(
        absl::StrCat("--principal_layer_bytes_quota: principal \"", principal, "\" holds ", held,
                     " bytes of layer state; layer \"", layer, "\" needs ", bytes,
                     " more, past its quota of ", quota, " bytes"));
  }
  const int64_t free = EngineFreeLocked();
  if (bytes > free) {
    if (metrics_) metrics_->AdmissionRejected("memory_budget");
    return absl::ResourceExhaustedError(absl::StrCat(
        "memory budget: layer \"", layer, "\" needs ", bytes,
        " bytes of state (weights, gradients, optimizer state); ", std::max<int64_t>(free, 0),
        " of the ", limits_.budget.engine_bytes, "-byte budget of ", limits_.budget.engine_memory,
        " are free (--memory_budget_bytes)"));
  }
  layers_[layer] = {principal, bytes};
  Add(principal_layer_bytes_, principal, bytes);
  usage_.layer_bytes += bytes;
  PublishLocked();
  return absl::OkStatus();
}

void MemoryLedger::SetLayerBytes(const std::string& layer, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  const int64_t delta = bytes - it->second.bytes;
  it->second.bytes = bytes;
  Add(principal_layer_bytes_, it->second.principal, delta);
  usage_.layer_bytes += delta;
  PublishLocked();
}

void MemoryLedger::ReleaseLayer(const std::string& layer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  Add(principal_layer_bytes_, it->second.principal, -it->second.bytes);
  usage_.layer_bytes -= it->second.bytes;
  layers_.erase(it);
  PublishLocked();
}

absl::Status MemoryLedger::AdmitContext(const std::string& principal, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t quota = limits_.principal_context_bytes_quota;
  const int64_t held = Get(principal_context_bytes_, principal);
  if (quota > 0 && bytes > quota - held) {
    if (metrics_) metrics_->AdmissionRejected("context_quota");
    return absl::ResourceExhaustedError(absl::StrCat(
        "--principal_context_bytes_quota: principal \"", principal, "\" holds ", held,
        " bytes of saved contexts; this context needs ", bytes, " more, past its quota of ", quota,
        " bytes; run Backward for outstanding contexts or send smaller micro-batches"));
  }
  const int64_t free = EngineFreeLocked();
  if (bytes > free) {
    if (metrics_) metrics_->AdmissionRejected("memory_budget");
    return absl::ResourceExhaustedError(absl::StrCat(
        "memory budget: this saved context needs ", bytes, " bytes; ", std::max<int64_t>(free, 0),
        " of the ", limits_.budget.engine_bytes, "-byte budget of ", limits_.budget.engine_memory,
        " are free (--memory_budget_bytes)"));
  }
  Add(principal_context_bytes_, principal, bytes);
  usage_.context_bytes += bytes;
  PublishLocked();
  return absl::OkStatus();
}

void MemoryLedger::ReleaseContext(const std::string& principal, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Add(principal_context_bytes_, principal, -bytes);
  usage_.context_bytes -= bytes;
  PublishLocked();
}

absl::Status MemoryLedger::ChangeRequestBytes(int64_t from, int64_t to, absl::string_view what,
                                              bool working) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t rise = to - from;
  if (rise > 0) {
    const int64_t free = HostFreeLocked();
    if (rise > free) {
      if (metrics_) metrics_->AdmissionRejected("memory_budget");
      const int64_t budget =
          limits_.budget.shared ? limits_.budget.engine_bytes : limits_.budget.host_bytes;
      return absl::ResourceExhaustedError(absl::StrCat(
          "memory budget: ", what,
          working ? ": this call's working memory would need " : ": this request's tensors would hold ",
          to, " bytes; ",
          std::max<int64_t>(free, 0) + from, " of the ", budget,
          "-byte budget of host memory are free to it (--memory_budget_bytes); send smaller "
          "micro-batches"));
    }
  }
  usage_.request_bytes += rise;
  PublishLocked();
  return absl::OkStatus();
}

MemoryLedger::Usage MemoryLedger::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

int64_t MemoryLedger::principal_layer_bytes(const std::string& principal) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Get(principal_layer_bytes_, principal);
}

int64_t MemoryLedger::principal_context_bytes(const std::string& principal) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Get(principal_context_bytes_, principal);
}

void MemoryLedger::PublishLocked() {
  if (metrics_) {
    metrics_->MemoryAdmitted(usage_.layer_bytes, usage_.context_bytes, usage_.request_bytes);
  }
}

}  // namespace moe::server
