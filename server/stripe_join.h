// Where the streams of one striped micro-batch meet (moe.proto, `Stripe`).
//
// Why: one TCP connection carries a large tensor at about 3 GB/s however many calls share it
// (docs/SERVICE_PERFORMANCE.md), so a trainer with one large micro-batch in flight waited on one
// connection while the others sat idle. A striped micro-batch travels as several streams on
// several connections, each carrying a contiguous range of its rows; the server runs it once.
//
// How: each stream's reactor enters the join on its first message (StripeJoins::Enter), then
// registers the shape every stream must agree on, and arrives once it holds all its rows. The
// arrival that completes the micro-batch gets every stream's part back, in row order, and runs
// it for all of them. Until then the join is the only place that knows which streams are
// waiting, so it is where one stream's failure (bad input, a cancelled call) reaches the
// others: every waiting stream is aborted with that status, and a stream that registers or
// arrives later gets it too. Nothing runs, and so no state changes, unless every stream arrived.
//
// A stream may fail (bad rows, a bad tensor) before a sibling's first message has reached the
// server. So that the sibling is answered at once instead of at its deadline, a join that failed
// so (not by a cancelled call or a passed deadline) and knows its stream count is kept for a
// short while after its last stream left (StripeJoins): a stream of an index that had not
// joined it yet gets its failure; a stream of an index that had is a retry of the micro-batch
// and starts a fresh join.
#ifndef MOE_SERVER_STRIPE_JOIN_H_
#define MOE_SERVER_STRIPE_JOIN_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "wire/wire.h"

namespace moe::server {

using wire::kMaxStripes;

class StripeJoin {
 public:
  // A stream's side of the join: its reactor.
  class Part {
   public:
    virtual ~Part() = default;
    // The micro-batch failed on another stream, or this stream was cancelled while it waited:
    // finish this stream with `status`. Called at most once per arrival, from any thread, never
    // under the join's lock.
    virtual void AbortStripe(const absl::Status& status) = 0;
  };

  // What every stream of the micro-batch must agree on: besides the stripe's own fields, the
  // request fields each stream repeats (Forward's `training`), named for the error message and
  // in a form that compares equal when they agree.
  struct Shape {
    uint32_t count = 0;
    int64_t total_rows = 0;
    std::string header_fields;
    std::string header_values;
  };

  // Stream `index`'s first message. InvalidArgument naming the stripe field that is out of range
  // or disagrees with an earlier stream, or that repeats an index; AlreadyExists once the
  // micro-batch has run (an id reused too early); the join's failure once it has failed.
  absl::Status Register(uint32_t index, const Shape& shape);

  // Stream `index` holds all its rows, [row_begin, row_begin + rows), and `part` waits for the
  // result. Returns every stream's part in row order when this arrival completes the micro-batch
  // (the caller runs it and answers each part), or an empty vector when others are still to
  // come. On error (the rows leave a gap or overlap: InvalidArgument naming stripe.row_begin; or
  // the join had failed) the join is failed, the waiting parts are aborted, and the caller
  // finishes its own stream with the returned status.
  absl::StatusOr<std::vector<Part*>> Arrive(uint32_t index, int64_t row_begin, int64_t rows,
                                            Part* part);

  // State the streams share (their reactors' inputs, assembled in place), made by `make` for the
  // first stream that asks and the same object for every later one. Released when the join fails.
  std::shared_ptr<void> Shared(const std::function<std::shared_ptr<void>()>& make);

  // A stream failed, or its call was cancelled, before the micro-batch ran: the join fails with
  // `status` and every waiting part is aborted with it, the failing stream's own included if it
  // was waiting (one still reading finishes itself). No effect once the micro-batch runs.
  void Fail(const absl::Status& status);

  // Whether the join failed.
  bool failed() const;
  // Whether a stream of `index` registered, or tried to, since the join learned its count.
  bool Saw(uint32_t index) const;
  // Whether the join failed for a reason other than a cancelled call or a passed deadline while
  // streams of some index it knows of never registered: a late sibling of the failed micro-batch
  // may still come.
  bool AwaitsLateStreams() const;

 private:
  enum class State { kCollecting, kRunning, kFailed };
  struct Stream {
    bool seen = false;  // a stream of this index registered or tried to
    bool registered = false;
    Part* waiting = nullptr;  // set from Arrive until the micro-batch runs or fails
    int64_t row_begin = 0;
    int64_t rows = 0;
  };
  // Fails the join and returns the parts to abort; the caller aborts them after unlocking.
  std::vector<Part*> FailLocked(const absl::Status& status);
  static void AbortAll(const std::vector<Part*>& parts, const absl::Status& status);

  mutable std::mutex mu_;
  State state_ = State::kCollecting;
  absl::Status failure_;
  Shape shape_;  // from the first Register
  std::vector<Stream> streams_;
  uint32_t arrived_ = 0;
  std::shared_ptr<void> shared_;
};

// How long a failed join waits for late siblings after its last stream left, and how many such
// joins are kept at most (the oldest go first).
inline constexpr std::chrono::milliseconds kFailedJoinRetention{2000};
inline constexpr size_t kMaxRetainedFailedJoins = 4096;

// The joins in progress, by key (method, layer, session, context id). A join lives while any of
// its streams is between its first message and the end of its response; a failed one that
// awaits late streams (StripeJoin::AwaitsLateStreams) up to `failure_retention` longer.
class StripeJoins {
 public:
  explicit StripeJoins(std::chrono::milliseconds failure_retention = kFailedJoinRetention)
      : retention_(failure_retention) {}
  static std::string Key(const std::string& method, const std::string& layer,
                         const std::string& session, uint64_t context_id);
  // The join of `key` for a stream of index `index`, made on first use; counts one stream in.
  // A failed join is given to a stream of an index it has not seen (a late sibling, which its
  // Register then fails); a stream of an index it has seen, or one that comes after the
  // retention, gets a fresh join (a retry).
  std::shared_ptr<StripeJoin> Enter(const std::string& key, uint32_t index);
  // Counts one stream of `join` out; the join is forgotten when none is left, unless it failed
  // and awaits late streams.
  void Leave(const std::string& key, const std::shared_ptr<StripeJoin>& join);
  // Joins held: in progress, and failed ones retained.
  size_t size() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    std::shared_ptr<StripeJoin> join;
    int streams = 0;
    Clock::time_point left;  // when the last stream left a retained failed join
  };
  // Forgets retained failed joins past the retention or beyond the most kept. Under mu_.
  void ExpireLocked(Clock::time_point now);
  const std::chrono::milliseconds retention_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> joins_;
  // Retained failed joins, oldest first (an entry may have been replaced since).
  std::deque<std::pair<std::string, std::weak_ptr<StripeJoin>>> retained_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_STRIPE_JOIN_H_
