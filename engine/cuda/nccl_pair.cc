// NcclPair (see nccl_pair.h): the two communicators, their streams and poster threads, and the
// polling that keeps every wait bounded.
#include "engine/cuda/nccl_pair.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/ipc_export.h"

namespace moe::cuda {
namespace {

// How long a post NCCL answered "in progress" may take to be enqueued: it waits for no peer,
// only for NCCL's own bookkeeping, so anything longer means the communicator is stuck.
constexpr std::chrono::seconds kSettleDeadline{10};
// How long WaitPosted waits: a post queues only behind its direction's earlier posts, each
// bounded by kSettleDeadline, and after an abort they fail at once.
constexpr std::chrono::seconds kPostedDeadline{30};

ncclComm_t Comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

absl::Status NcclError(ncclResult_t r, absl::string_view what) {
  return absl::UnavailableError(
      absl::StrCat("nccl: ", what, ": ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr),
                   ")"));
}

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

absl::StatusOr<ncclUniqueId> IdFrom(absl::string_view bytes, absl::string_view field) {
  ncclUniqueId id;
  if (bytes.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes.size(),
                                                   " bytes, an ncclUniqueId has ",
                                                   sizeof(id.internal)));
  }
  std::memcpy(id.internal, bytes.data(), bytes.size());
  return id;
}

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError(r, "ncclGetUniqueId");
  }
  return std::string(id.internal, sizeof(id.internal));
}

// A post's outcome, shared by its completion and the poster thread that runs it.
struct StreamCompletion::State {
  ~State() {
    if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
  std::mutex mu;
  std::condition_variable cv;
  bool posted = false;   // the post ran: `status` and `event` are final
  absl::Status status;   // its error
  void* event = nullptr;  // cudaEvent_t recorded after the transfers
};

StreamCompletion::~StreamCompletion() = default;

absl::Status StreamCompletion::Query() const {
  void* event = nullptr;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->posted) return absl::UnavailableError("transfer waiting to be posted");
    if (!state_->status.ok()) return state_->status;
    event = state_->event;
  }
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorNotReady) return absl::UnavailableError("transfer in progress");
  return CudaError(e, "transfer");
}

absl::StatusOr<void*> StreamCompletion::WaitPosted() const {
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_for(lock, kPostedDeadline, [&] { return state_->posted; })) {
    return absl::DeadlineExceededError("nccl: transfers were not posted in 30 s");
  }
  if (!state_->status.ok()) return state_->status;
  return state_->event;
}

absl::StatusOr<std::unique_ptr<NcclPair>> NcclPair::Start(int device, int rank,
                                                          absl::string_view send_id,
                                                          absl::string_view recv_id) {
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", rank, ", a pair has ranks 0 and 1"));
  }
  absl::StatusOr<ncclUniqueId> send = IdFrom(send_id, "send_id");
  if (!send.ok()) return send.status();
  absl::StatusOr<ncclUniqueId> recv = IdFrom(recv_id, "recv_id");
  if (!recv.ok()) return recv.status();
  DeviceScope scope(device);
  if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
  std::unique_ptr<NcclPair> p(new NcclPair());
  p->device_ = device;
  p->peer_ = 1 - rank;
  for (void** s : {&p->send_.stream, &p->recv_.stream, &p->capture_stream_}) {
    cudaStream_t stream = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError(e, "cudaStreamCreateWithFlags");
    }
    *s = stream;
  }
  // Rank 0's send communicator is rank 1's receive one: the client sends on to_server, the
  // server receives on it. Both start without blocking, so the order the peer starts them in
  // does not matter.
  for (auto [slot, id] : {std::pair{&p->send_.comm, &*send}, std::pair{&p->recv_.comm, &*recv}}) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, *id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, "ncclCommInitRankConfig");
    *slot = comm;
  }
  for (Direction* d : {&p->send_, &p->recv_}) {
    d->poster = std::thread([pair = p.get(), d] { pair->PosterLoop(*d); });
  }
  return p;
}

NcclPair::~NcclPair() {
  Abort();  // posts still queued now fail at once
  for (Direction* d : {&send_, &recv_}) {
    {
      std::lock_guard<std::mutex> lock(d->queue_mu);
      d->stop = true;
    }
    d->queue_cv.notify_all();
    if (d->poster.joinable()) d->poster.join();
  }
  DeviceScope scope(device_);
  for (void* s : {send_.stream, recv_.stream, capture_stream_}) {
    if (s != nullptr) cudaStreamDestroy(Stream(s));
  }
  for (void* e : warm_events_) {
    if (e != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
  if (warm_buffer_ != nullptr) cudaFree(warm_buffer_);
}

absl::Status NcclPair::PollReady() {
  if (absl::Status st = Poll(); !st.ok()) return st;
  if (absl::Status st = StartWarmUp(); !st.ok()) return st;
  return PollWarmUp();
}

absl::Status NcclPair::StartWarmUp() {
  std::lock_guard<std::mutex> send_lock(send_.nccl_mu);
  std::lock_guard<std::mutex> recv_lock(recv_.nccl_mu);
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.ok()) return failed_;
  if (!ready_) return absl::FailedPreconditionError("nccl: communicators not ready");
  if (warm_started_) return absl::OkStatus();
  DeviceScope scope(device_);
  if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
  if (cudaError_t e = cudaMalloc(&warm_buffer_, 2); e != cudaSuccess) {
    failed_ = CudaError(e, "cudaMalloc");
    return failed_;
  }
  // One operation per communicator, each its own implicit group; neither waits here.
  char* bytes = static_cast<char*>(warm_buffer_);
  ncclResult_t r = ncclSend(bytes, 1, ncclUint8, peer_, Comm(send_.comm), Stream(send_.stream));
  if (r == ncclSuccess || r == ncclInProgress) {
    r = ncclRecv(bytes + 1, 1, ncclUint8, peer_, Comm(recv_.comm), Stream(recv_.stream));
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    failed_ = NcclError(r, "warming up");
    return failed_;
  }
  warm_started_ = true;
  return absl::OkStatus();
}

absl::Status NcclPair::PollWarmUp() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.ok()) return failed_;
  if (!warm_started_) return absl::FailedPreconditionError("nccl: warm-up not started");
  if (warm_) return absl::OkStatus();
  bool pending = false;
  void* comms[2] = {send_.comm, recv_.comm};
  void* streams[2] = {send_.stream, recv_.stream};
  for (int i = 0; i < 2; ++i) {
    if (warm_events_[i] == nullptr) {
      // Enqueued on the stream once the communicator is no longer "in progress".
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(Comm(comms[i]), &state); r != ncclSuccess) {
        state = r;
      }
      if (state == ncclInProgress) {
        pending = true;
        continue;
      }
      if (state != ncclSuccess) {
        failed_ = NcclError(state, "warming up");
        return failed_;
      }
      DeviceScope scope(device_);
      cudaEvent_t event = nullptr;
      if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
          e != cudaSuccess) {
        failed_ = CudaError(e, "cudaEventCreateWithFlags");
        return failed_;
      }
      warm_events_[i] = event;
      if (cudaError_t e = cudaEventRecord(event, Stream(streams[i])); e != cudaSuccess) {
        failed_ = CudaError(e, "cudaEventRecord");
        return failed_;
      }
    }
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(warm_events_[i]));
    if (q == cudaErrorNotReady) {
      pending = true;
    } else if (q != cudaSuccess) {
      failed_ = CudaError(q, "warming up");
      return failed_;
    }
  }
  if (pending) return absl::UnavailableError("nccl: warming up");
  warm_ = true;
  return absl::OkStatus();
}

absl::Status NcclPair::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.ok()) return failed_;
  bool in_progress = false;
  // ncclCommGetAsyncError may run beside a post on the same communicator (it is how a post in
  // progress is polled); mu_ only keeps an abort from freeing the communicators meanwhile.
  for (void* c : {send_.comm, recv_.comm}) {
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(Comm(c), &state); r != ncclSuccess) state = r;
    if (state == ncclInProgress) {
      // Once ready, "in progress" is a poster thread's post being enqueued, not a bootstrap.
      in_progress = in_progress || !ready_;
    } else if (state != ncclSuccess) {
      failed_ = NcclError(state, "communicator");
      return failed_;
    }
  }
  if (in_progress) return absl::UnavailableError("nccl: communicators still bootstrapping");
  ready_ = true;
  return absl::OkStatus();
}

absl::Status NcclPair::Settle(void* comm) {
  const auto deadline = std::chrono::steady_clock::now() + kSettleDeadline;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(Comm(comm), &state); r != ncclSuccess) state = r;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclError(state, "posting transfers");
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError("nccl: posting transfers did not finish in 10 s");
    }
    std::this_thread::yield();
  }
}

absl::StatusOr<std::unique_ptr<StreamCompletion>> NcclPair::Send(
    absl::Span<const NcclBuffer> buffers, void* wait_event, bool zero) {
  return Post(send_, buffers, wait_event, zero);
}

absl::StatusOr<std::unique_ptr<StreamCompletion>> NcclPair::Receive(
    absl::Span<const NcclBuffer> buffers, void* wait_event) {
  return Post(recv_, buffers, wait_event, /*zero=*/false);
}

absl::StatusOr<std::unique_ptr<StreamCompletion>> NcclPair::Post(
    Direction& d, absl::Span<const NcclBuffer> buffers, void* wait_event, bool zero) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) return absl::FailedPreconditionError(failed_.message());
    if (!warm_) return absl::FailedPreconditionError("nccl: communicators not warmed up");
  }
  Job job;
  job.buffers.assign(buffers.begin(), buffers.end());
  job.zero = zero;
  job.state = std::make_shared<StreamCompletion::State>();
  if (wait_event != nullptr) {
    // The caller's event is captured as it stands now in an event of the job's own: the caller
    // may record it again (the next call's work) before the poster gets to this job.
    DeviceScope scope(device_);
    if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
    cudaEvent_t after = nullptr;
    if (cudaError_t e = cudaEventCreateWithFlags(&after, cudaEventDisableTiming);
        e != cudaSuccess) {
      return CudaError(e, "cudaEventCreateWithFlags");
    }
    job.after = after;
    std::lock_guard<std::mutex> lock(capture_mu_);
    cudaError_t e = cudaStreamWaitEvent(Stream(capture_stream_),
                                        static_cast<cudaEvent_t>(wait_event), 0);
    if (e == cudaSuccess) e = cudaEventRecord(after, Stream(capture_stream_));
    if (e != cudaSuccess) {
      cudaEventDestroy(after);
      return CudaError(e, "capturing the caller's event");
    }
  }
  std::unique_ptr<StreamCompletion> done(new StreamCompletion(job.state));
  {
    std::lock_guard<std::mutex> lock(d.queue_mu);
    d.jobs.push_back(std::move(job));
  }
  d.queue_cv.notify_one();
  return done;
}

void NcclPair::PosterLoop(Direction& d) {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(d.queue_mu);
      d.queue_cv.wait(lock, [&] { return d.stop || !d.jobs.empty(); });
      if (d.jobs.empty()) return;  // stopping, and nothing is left to fail
      job = std::move(d.jobs.front());
      d.jobs.pop_front();
    }
    absl::StatusOr<void*> event = PostNow(d, job);
    if (job.after != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(job.after));
    std::lock_guard<std::mutex> lock(job.state->mu);
    job.state->posted = true;
    if (event.ok()) {
      job.state->event = *event;
    } else {
      job.state->status = event.status();
    }
    job.state->cv.notify_all();
  }
}

absl::StatusOr<void*> NcclPair::PostNow(Direction& d, Job& job) {
  // Held through the post: an abort waits for it rather than free the communicator under it.
  std::lock_guard<std::mutex> nccl_lock(d.nccl_mu);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) return absl::FailedPreconditionError(failed_.message());
  }
  auto fail = [&](absl::Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.ok()) failed_ = st;  // a half-posted group leaves the pair out of step
    return st;
  };
  DeviceScope scope(device_);
  if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
  cudaStream_t stream = Stream(d.stream);
  if (job.after != nullptr) {
    if (cudaError_t e = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(job.after), 0);
        e != cudaSuccess) {
      return fail(CudaError(e, "cudaStreamWaitEvent"));
    }
  }
  if (job.zero) {
    for (const NcclBuffer& b : job.buffers) {
      if (b.bytes == 0) continue;
      if (cudaError_t e = cudaMemsetAsync(b.data, 0, static_cast<size_t>(b.bytes), stream);
          e != cudaSuccess) {
        return fail(CudaError(e, "cudaMemsetAsync"));
      }
    }
  }
  // One group: the call's transfers go as one launch, in this order on the peer's side too.
  ncclResult_t r = ncclGroupStart();
  for (const NcclBuffer& b : job.buffers) {
    if (r != ncclSuccess || b.bytes == 0) continue;
    r = d.send ? ncclSend(b.data, static_cast<size_t>(b.bytes), ncclUint8, peer_, Comm(d.comm),
                          stream)
               : ncclRecv(b.data, static_cast<size_t>(b.bytes), ncclUint8, peer_, Comm(d.comm),
                          stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess) r = end;
  if (r == ncclInProgress) {
    if (absl::Status st = Settle(d.comm); !st.ok()) return fail(st);
  } else if (r != ncclSuccess) {
    return fail(NcclError(r, d.send ? "ncclSend" : "ncclRecv"));
  }
  cudaEvent_t event = nullptr;
  if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); e != cudaSuccess) {
    return fail(CudaError(e, "cudaEventCreateWithFlags"));
  }
  if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) {
    cudaEventDestroy(event);
    return fail(CudaError(e, "cudaEventRecord"));
  }
  return static_cast<void*>(event);
}

void NcclPair::Abort() {
  // A post in progress ends first (bounded by kSettleDeadline); later ones see failed_.
  std::lock_guard<std::mutex> send_lock(send_.nccl_mu);
  std::lock_guard<std::mutex> recv_lock(recv_.nccl_mu);
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.ok()) failed_ = absl::UnavailableError("nccl: the channel was aborted");
  // Both at once, each on a thread that makes no CUDA call first: an abort raises its kernels'
  // stop flag, then frees memory, which waits for the device to go idle. One after the other,
  // the first would wait for the second's kernel (a receive from a dead peer) forever
  // (decision 0018, "Aborts run at once").
  std::vector<std::thread> aborts;
  for (void** c : {&send_.comm, &recv_.comm}) {
    if (*c == nullptr) continue;
    aborts.emplace_back([comm = Comm(*c)] { ncclCommAbort(comm); });
    *c = nullptr;
  }
  for (std::thread& t : aborts) t.join();
}

}  // namespace moe::cuda
