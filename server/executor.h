// A single thread that runs tasks in submission order. Reactions never block: they Submit() work
// and return; the task itself continues the RPC (starts the write or finishes the call).
//
// The server has two: one per device, which runs every engine call for that device (a single
// thread is also what makes the engine's thread-compatible Layer safe to share among streams),
// and one for checkpoint file I/O, so a slow disk holds up other file operations but never a
// Forward.
#ifndef MOE_SERVER_EXECUTOR_H_
#define MOE_SERVER_EXECUTOR_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moe::server {

class SerialExecutor {
 public:
  // `queued_seconds`: how long the task waited before it started (the "queue" latency stage).
  using Task = std::function<void(double queued_seconds)>;

  SerialExecutor();
  ~SerialExecutor();  // runs what is queued, then joins
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Submit(Task task);

 private:
  void Run();
  struct Item {
    Task task;
    std::chrono::steady_clock::time_point enqueued;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

// Runs `call`, an engine call returning absl::Status or absl::StatusOr, and turns an allocation
// failure inside it (std::bad_alloc) into ResourceExhausted naming `what`: a server whose host
// memory runs out answers the call that ran out, and keeps every layer, optimizer state and
// context it holds.
template <typename F>
auto GuardAllocation(absl::string_view what, F&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": the server ran out of host memory; retry with a smaller request"));
  }
}

using DeviceExecutor = SerialExecutor;
using FileExecutor = SerialExecutor;

}  // namespace moe::server

#endif  // MOE_SERVER_EXECUTOR_H_
