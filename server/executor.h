// One executor per device: a single thread that runs every engine call for that device, in
// submission order. Reactions never block: they Submit() work and return; the task itself
// continues the RPC (starts the write or finishes the call) when the engine is done. A single
// thread is also what makes the engine's thread-compatible Layer safe to share among streams.
#ifndef MOE_SERVER_EXECUTOR_H_
#define MOE_SERVER_EXECUTOR_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace moe::server {

class DeviceExecutor {
 public:
  // `queued_seconds`: how long the task waited before it started (the "queue" latency stage).
  using Task = std::function<void(double queued_seconds)>;

  DeviceExecutor();
  ~DeviceExecutor();  // runs what is queued, then joins
  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

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

}  // namespace moe::server

#endif  // MOE_SERVER_EXECUTOR_H_
