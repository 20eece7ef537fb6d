// The executor thread (see executor.h).
#include "server/executor.h"

#include <utility>

namespace moe::server {

SerialExecutor::SerialExecutor() : thread_([this] { Run(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void SerialExecutor::Submit(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({std::move(task), std::chrono::steady_clock::now()});
  }
  cv_.notify_one();
}

void SerialExecutor::Run() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    const double queued =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - item.enqueued).count();
    item.task(queued);
  }
}

}  // namespace moe::server
