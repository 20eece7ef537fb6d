// The CPU thread pool (see thread_pool.h for the scheduling contract).
//
// Indices are claimed in chunks of one under the mutex: tasks here are coarse (a GEMM tile,
// an expert, a block of tokens), so the lock is never the bottleneck and the code stays simple.
#include "kernels/cpu/thread_pool.h"

namespace moe::kernels {
namespace {
thread_local bool in_pool_task = false;
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

ThreadPool& ThreadPool::Default() {
  static ThreadPool* pool = [] {
    const int n = static_cast<int>(std::thread::hardware_concurrency());
    return new ThreadPool(n < 1 ? 1 : n);  // never destroyed: workers outlive static dtors
  }();
  return *pool;
}

void ThreadPool::RunTasks() {
  const bool was = in_pool_task;
  in_pool_task = true;
  for (;;) {
    int64_t i;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= n_) break;
      i = next_++;
    }
    (*fn_)(i);
  }
  in_pool_task = was;
}

void ThreadPool::WorkerLoop() {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunTasks();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (in_pool_task || workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    active_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  RunTasks();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

}  // namespace moe::kernels
