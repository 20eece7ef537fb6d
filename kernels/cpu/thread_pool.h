// A small fixed thread pool for the CPU reference ops and the CPU engine.
//
// ParallelFor hands out indices through one atomic counter, and the calling thread works too,
// so a pool of hardware_concurrency()-1 workers keeps every core busy. Work split this way is
// deterministic as long as each index writes its own outputs (every caller here does: GEMM
// tiles own their C block, so results never depend on the thread count). A ParallelFor issued
// from inside a task runs inline, which rules out nested-pool deadlocks.
#ifndef MOE_KERNELS_CPU_THREAD_POOL_H_
#define MOE_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::kernels {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means everything runs inline.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) for every i in [0, n), spread over the pool; returns when all are done.
  // Calls from different threads are serialised.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

  // The process-wide pool, one thread per hardware thread (hardware_concurrency()). A caller
  // that wants another count makes its own pool.
  static ThreadPool& Default();

 private:
  void WorkerLoop();
  void RunTasks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t next_ = 0;  // guarded by mu_
  int64_t generation_ = 0;
  int active_ = 0;  // workers still inside the current generation
  bool stop_ = false;
};

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CPU_THREAD_POOL_H_
