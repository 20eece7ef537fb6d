// NcclPair (see nccl_pair.h): the two communicators, their streams, and the polling that keeps
// every wait bounded.
#include "engine/cuda/nccl_pair.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
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

StreamCompletion::~StreamCompletion() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

absl::Status StreamCompletion::Query() const {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorNotReady) return absl::UnavailableError("transfer in progress");
  return CudaError(e, "transfer");
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
  for (void** s : {&p->send_stream_, &p->recv_stream_}) {
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
  for (auto [slot, id] : {std::pair{&p->send_comm_, &*send}, std::pair{&p->recv_comm_, &*recv}}) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, *id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, "ncclCommInitRankConfig");
    *slot = comm;
  }
  return p;
}

NcclPair::~NcclPair() {
  Abort();
  DeviceScope scope(device_);
  for (void* s : {send_stream_, recv_stream_}) {
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
  ncclResult_t r = ncclSend(bytes, 1, ncclUint8, peer_, Comm(send_comm_), Stream(send_stream_));
  if (r == ncclSuccess || r == ncclInProgress) {
    r = ncclRecv(bytes + 1, 1, ncclUint8, peer_, Comm(recv_comm_), Stream(recv_stream_));
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
  void* comms[2] = {send_comm_, recv_comm_};
  void* streams[2] = {send_stream_, recv_stream_};
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
  for (void* c : {send_comm_, recv_comm_}) {
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(Comm(c), &state); r != ncclSuccess) state = r;
    if (state == ncclInProgress) {
      in_progress = true;
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
  return Post(/*send=*/true, buffers, wait_event, zero);
}

absl::StatusOr<std::unique_ptr<StreamCompletion>> NcclPair::Receive(
    absl::Span<const NcclBuffer> buffers, void* wait_event) {
  return Post(/*send=*/false, buffers, wait_event, /*zero=*/false);
}

absl::StatusOr<std::unique_ptr<StreamCompletion>> NcclPair::Post(
    bool send, absl::Span<const NcclBuffer> buffers, void* wait_event, bool zero) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.ok()) return absl::FailedPreconditionError(failed_.message());
  if (!warm_) return absl::FailedPreconditionError("nccl: communicators not warmed up");
  DeviceScope scope(device_);
  if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
  void* comm = send ? send_comm_ : recv_comm_;
  cudaStream_t stream = Stream(send ? send_stream_ : recv_stream_);
  if (wait_event != nullptr) {
    if (cudaError_t e = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(wait_event), 0);
        e != cudaSuccess) {
      return CudaError(e, "cudaStreamWaitEvent");
    }
  }
  if (zero) {
    for (const NcclBuffer& b : buffers) {
      if (b.bytes == 0) continue;
      if (cudaError_t e = cudaMemsetAsync(b.data, 0, static_cast<size_t>(b.bytes), stream);
          e != cudaSuccess) {
        return CudaError(e, "cudaMemsetAsync");
      }
    }
  }
  // One group: the call's transfers go as one launch, in this order on the peer's side too.
  ncclResult_t r = ncclGroupStart();
  for (const NcclBuffer& b : buffers) {
    if (r != ncclSuccess || b.bytes == 0) continue;
    r = send ? ncclSend(b.data, static_cast<size_t>(b.bytes), ncclUint8, peer_, Comm(comm), stream)
             : ncclRecv(b.data, static_cast<size_t>(b.bytes), ncclUint8, peer_, Comm(comm), stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess) r = end;
  absl::Status st;
  if (r == ncclInProgress) {
    st = Settle(comm);
  } else if (r != ncclSuccess) {
    st = NcclError(r, send ? "ncclSend" : "ncclRecv");
  }
  if (!st.ok()) {
    failed_ = st;  // a half-posted group leaves the communicator out of step with its peer
    return st;
  }
  std::unique_ptr<StreamCompletion> done(new StreamCompletion());
  cudaEvent_t event = nullptr;
  if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); e != cudaSuccess) {
    failed_ = CudaError(e, "cudaEventCreateWithFlags");
    return failed_;
  }
  done->event_ = event;
  if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) {
    failed_ = CudaError(e, "cudaEventRecord");
    return failed_;
  }
  return done;
}

void NcclPair::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.ok()) failed_ = absl::UnavailableError("nccl: the channel was aborted");
  // Both at once, each on a thread that makes no CUDA call first: an abort raises its kernels'
  // stop flag, then frees memory, which waits for the device to go idle. One after the other,
  // the first would wait for the second's kernel (a receive from a dead peer) forever
  // (decision 0018, "Aborts run at once").
  std::vector<std::thread> aborts;
  for (void** c : {&send_comm_, &recv_comm_}) {
    if (*c == nullptr) continue;
    aborts.emplace_back([comm = Comm(*c)] { ncclCommAbort(comm); });
    *c = nullptr;
  }
  for (std::thread& t : aborts) t.join();
}

}  // namespace moe::cuda
