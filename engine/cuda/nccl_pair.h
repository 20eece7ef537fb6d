// Two two-rank NCCL communicators between this process's GPU and a peer's, one per direction:
// what the server's NCCL links (engine/nccl.h) and the client's NCCL channels are made of
// (docs/decisions/0018-nccl-transport.md).
//
// Each communicator carries one direction only, so its transfers match in the order each side
// posts them and a send never waits behind a receive of the other direction. Both are
// non-blocking (ncclConfig_t.blocking = 0): creating them returns at once and Poll says when
// they are ready, and a post that NCCL answers "in progress" is polled to its end under a
// deadline, so no thread waits on the peer without bound. Each direction has its own
// non-blocking CUDA stream (no implicit ordering with the legacy default stream, whose
// synchronisation with a receive waiting for its peer could otherwise stall unrelated work).
//
// Posting is asynchronous: Send and Receive queue the transfers for the direction's own poster
// thread and return. A post on a non-blocking communicator spends long in NCCL's bookkeeping,
// which would otherwise sit on the caller's critical path (the client's call before its request,
// the server's pump and executor); decision 0018, "Posting off the caller", has the cost.
// Posts of one direction keep the order they were queued in, which is all the peer's matching
// needs. Thread-safe; Abort may come from any thread. No CUDA or NCCL type in this header.
#ifndef MOE_ENGINE_CUDA_NCCL_PAIR_H_
#define MOE_ENGINE_CUDA_NCCL_PAIR_H_

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/nccl.h"

namespace moe::cuda {

// A fresh ncclUniqueId (kNcclUniqueIdBytes bytes).
absl::StatusOr<std::string> NewNcclUniqueId();

// Transfers posted together: once their post ran, an event recorded on their stream after them.
class StreamCompletion final : public NcclCompletion {
 public:
  struct State;  // shared with the poster thread (nccl_pair.cc)

  ~StreamCompletion() override;
  // Unavailable while the transfers wait to be posted or run; the post's error if it failed.
  absl::Status Query() const override;
  // Waits on the host until the transfers are posted (bounded; they queue only behind earlier
  // posts of their direction), then gives the cudaEvent_t recorded after them, for a stream to
  // wait on; the post's error if it failed.
  absl::StatusOr<void*> WaitPosted() const;

 private:
  friend class NcclPair;
  explicit StreamCompletion(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class NcclPair {
 public:
  // Starts both communicators on `device` as `rank` (0 or 1) of two: this side sends on
  // `send_id`'s and receives on `recv_id`'s (ncclUniqueId bytes). InvalidArgument for ids of the
  // wrong length; the CUDA or NCCL error otherwise.
  static absl::StatusOr<std::unique_ptr<NcclPair>> Start(int device, int rank,
                                                         absl::string_view send_id,
                                                         absl::string_view recv_id);
  ~NcclPair();  // aborts the communicators unless already aborted; destroys the streams
  NcclPair(const NcclPair&) = delete;
  NcclPair& operator=(const NcclPair&) = delete;

  int device() const { return device_; }
  // OK once both communicators are ready and warm, Unavailable while they bootstrap or warm up,
  // their error once one failed (sticky, as is an abort). Never waits.
  //
  // Warm: the first transfer on each communicator, one byte each way, is posted as soon as they
  // are ready. NCCL connects two ranks at their first send and receive, and connecting needs both
  // sides at once; a post waiting for that could wait on a peer that only posts once the post's
  // call reaches it. So each side warms its communicators up once, and Send / Receive refuse
  // before.
  absl::Status PollReady();
  // Queues sends of `buffers` (receives into them), in order, on this direction's stream, after
  // the work `wait_event` (a cudaEvent_t; null: none) stands for now (the caller may record it
  // again at once) and, for Send with `zero`, after filling them with zeros. FailedPrecondition
  // before the communicators are warm or after an abort; a failure of the post itself shows in
  // the completion (and fails the pair).
  absl::StatusOr<std::unique_ptr<StreamCompletion>> Send(absl::Span<const NcclBuffer> buffers,
                                                         void* wait_event, bool zero);
  absl::StatusOr<std::unique_ptr<StreamCompletion>> Receive(absl::Span<const NcclBuffer> buffers,
                                                            void* wait_event);
  // ncclCommAbort on both, at once: transfers in flight end (their buffers then hold anything).
  void Abort();

 private:
  // One post waiting for its direction's poster thread.
  struct Job {
    std::vector<NcclBuffer> buffers;
    void* after = nullptr;  // cudaEvent_t of the caller's dependency, owned; null: none
    bool zero = false;
    std::shared_ptr<StreamCompletion::State> state;
  };
  // A communicator, its stream, and the thread that posts on it.
  struct Direction {
    explicit Direction(bool s) : send(s) {}
    const bool send;
    void* comm = nullptr;    // ncclComm_t
    void* stream = nullptr;  // cudaStream_t
    std::mutex nccl_mu;      // every NCCL call on comm; taken before mu_
    std::mutex queue_mu;
    std::condition_variable queue_cv;
    std::deque<Job> jobs;  // guarded by queue_mu
    bool stop = false;     // guarded by queue_mu
    std::thread poster;
  };

  NcclPair() = default;
  absl::StatusOr<std::unique_ptr<StreamCompletion>> Post(Direction& d,
                                                         absl::Span<const NcclBuffer> buffers,
                                                         void* wait_event, bool zero);
  void PosterLoop(Direction& d);
  // The post itself, on the poster thread: the cudaEvent_t recorded after the transfers.
  absl::StatusOr<void*> PostNow(Direction& d, Job& job);
  // PollReady's steps: the communicators' state; the warm-up's post (once; later calls do
  // nothing) and its completion.
  absl::Status Poll();
  absl::Status StartWarmUp();
  absl::Status PollWarmUp();
  // Polls a communicator whose last call answered "in progress" until it is not.
  absl::Status Settle(void* comm);

  int device_ = -1;
  int peer_ = 0;
  Direction send_{true};
  Direction recv_{false};
  std::mutex capture_mu_;          // capture_stream_
  void* capture_stream_ = nullptr;  // cudaStream_t: turns a caller's event into a Job's own
  std::mutex mu_;                   // the state below, and the comms' lifetime against Poll
  bool ready_ = false;
  void* warm_buffer_ = nullptr;  // two bytes of device memory: one sent, one received
  bool warm_started_ = false;
  bool warm_ = false;
  void* warm_events_[2] = {nullptr, nullptr};  // cudaEvent_t after each warm-up transfer
  absl::Status failed_;  // sticky
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_NCCL_PAIR_H_
