// StripeJoin and StripeJoins (see stripe_join.h).
#include "server/stripe_join.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "wire/wire.h"

namespace moe::server {

absl::Status StripeJoin::Register(uint32_t index, const Shape& shape) {
  if (shape.count < 2 || shape.count > kMaxStripes) {
    return absl::InvalidArgumentError(absl::StrCat("stripe.count: must be 2 to ", kMaxStripes,
                                                   " (0: not striped), got ", shape.count));
  }
  if (index >= shape.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.index: ", index, " is not below stripe.count ", shape.count));
  }
  if (shape.total_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.total_rows: must be positive, got ", shape.total_rows));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (index < streams_.size()) streams_[index].seen = true;
  if (state_ == State::kFailed) return failure_;
  if (state_ == State::kRunning) {
    return absl::AlreadyExistsError(
        "context_id: a striped micro-batch with this id is still being answered");
  }
  if (streams_.empty()) {
    shape_ = shape;
    streams_.resize(shape.count);
    streams_[index].seen = true;
  } else if (shape.count != shape_.count) {
    return absl::InvalidArgumentError(absl::StrCat("stripe.count: ", shape.count,
                                                   ", but another stream of the micro-batch said ",
                                                   shape_.count));
  } else if (shape.total_rows != shape_.total_rows) {
    return absl::InvalidArgumentError(absl::StrCat("stripe.total_rows: ", shape.total_rows,
                                                   ", but another stream of the micro-batch said ",
                                                   shape_.total_rows));
  } else if (shape.header_values != shape_.header_values) {
    return absl::InvalidArgumentError(
        absl::StrCat(shape.header_fields,
                     ": must be the same on every stream of a striped "
                     "micro-batch (",
                     shape.header_values, " here, ", shape_.header_values, " on another)"));
  }
  if (streams_[index].registered) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.index: ", index, " is carried by two streams"));
  }
  streams_[index].registered = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StripeJoin::Part*>> StripeJoin::Arrive(uint32_t index, int64_t row_begin,
                                                                  int64_t rows, Part* part) {
  std::vector<Part*> abort;
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kCollecting) return failure_;
    Stream& s = streams_[index];
    s.row_begin = row_begin;
    s.rows = rows;
    if (row_begin < 0 || rows < 0 || row_begin > shape_.total_rows - rows) {
      status = absl::InvalidArgumentError(
          absl::StrCat("stripe.row_begin: rows [", row_begin, ", ", row_begin + rows,
                       ") of stream ", index, " are outside [0, ", shape_.total_rows, ")"));
    } else {
      s.waiting = part;
      if (++arrived_ < shape_.count) return std::vector<Part*>();
      // Every stream is here: their rows must tile [0, total_rows).
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (const Stream& t : streams_) ranges.emplace_back(t.row_begin, t.rows);
      const int64_t next = wire::TiledRows(ranges);
      if (next == shape_.total_rows) {
        state_ = State::kRunning;
        std::vector<std::pair<int64_t, Part*>> order;
        for (Stream& t : streams_)
          order.emplace_back(t.row_begin, std::exchange(t.waiting, nullptr));
        std::sort(order.begin(), order.end(),
                  [](const auto& a, const auto& b) { return a.first < b.first; });
        std::vector<Part*> parts;
        for (const auto& [begin, p] : order) parts.push_back(p);
        return parts;
      }
      s.waiting = nullptr;  // the caller finishes its own stream
      status = absl::InvalidArgumentError(
          absl::StrCat("stripe.row_begin: the streams' rows do not tile [0, ", shape_.total_rows,
                       ") exactly once (a gap or an overlap at row ", next, ")"));
    }
    abort = FailLocked(status);
  }
  AbortAll(abort, status);
  return status;
}

std::shared_ptr<void> StripeJoin::Shared(const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!shared_) shared_ = make();
  return shared_;
}

bool StripeJoin::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == State::kFailed;
}

bool StripeJoin::Saw(uint32_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index < streams_.size() && streams_[index].seen;
}

bool StripeJoin::AwaitsLateStreams() const {
  std::lock_guard<std::mutex> lock(mu_);
  // A cancelled call or a passed deadline says nothing about the micro-batch: a stream that comes
  // later is more likely a retry than a sibling.
  if (state_ != State::kFailed || absl::IsCancelled(failure_) ||
      absl::IsDeadlineExceeded(failure_)) {
    return false;
  }
  return std::any_of(streams_.begin(), streams_.end(), [](const Stream& s) { return !s.seen; });
}

void StripeJoin::Fail(const absl::Status& status) {
  std::vector<Part*> abort;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kCollecting) return;
    abort = FailLocked(status);
  }
  AbortAll(abort, status);
}

std::vector<StripeJoin::Part*> StripeJoin::FailLocked(const absl::Status& status) {
  state_ = State::kFailed;
  failure_ = status;
  shared_.reset();  // nothing will run: the inputs go with the last stream that holds them
  std::vector<Part*> parts;
  for (Stream& s : streams_) {
    if (s.waiting != nullptr) parts.push_back(s.waiting);
    s.waiting = nullptr;
  }
  return parts;
}

void StripeJoin::AbortAll(const std::vector<Part*>& parts, const absl::Status& status) {
  for (Part* p : parts) p->AbortStripe(status);
}

std::string StripeJoins::Key(const std::string& method, const std::string& layer,
                             const std::string& session, uint64_t context_id) {
  // Length-prefixed, so no choice of names makes two keys equal.
  return absl::StrCat(method.size(), ":", method, layer.size(), ":", layer, session.size(), ":",
                      session, context_id);
}

std::shared_ptr<StripeJoin> StripeJoins::Enter(const std::string& key, uint32_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked(Clock::now());
  Entry& e = joins_[key];
  // A failed join is no place for a retry: a stream of an index it saw starts afresh (the old
  // join lives on with the streams that still hold it).
  if (!e.join || (e.join->failed() && e.join->Saw(index))) {
    e.join = std::make_shared<StripeJoin>();
    e.streams = 0;
  }
  ++e.streams;
  return e.join;
}

void StripeJoins::Leave(const std::string& key, const std::shared_ptr<StripeJoin>& join) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = joins_.find(key);
  if (it == joins_.end() || it->second.join != join) return;
  if (--it->second.streams > 0) return;
  if (join->AwaitsLateStreams()) {
    it->second.left = Clock::now();
    retained_.emplace_back(key, join);
    ExpireLocked(it->second.left);
  } else {
    joins_.erase(it);
  }
}

void StripeJoins::ExpireLocked(Clock::time_point now) {
  while (!retained_.empty()) {
    auto it = joins_.find(retained_.front().first);
    // Still the retained join, and nobody entered it since it was retained.
    const bool current = it != joins_.end() && it->second.join == retained_.front().second.lock() &&
                         it->second.streams == 0;
    if (current && retained_.size() <= kMaxRetainedFailedJoins &&
        now - it->second.left < retention_) {
      break;
    }
    if (current) joins_.erase(it);
    retained_.pop_front();
  }
}

size_t StripeJoins::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return joins_.size();
}

}  // namespace moe::server
