// moe-service-bench's service steps (bench/service/trainers.h) when a call fails: the step must
// not return while the other calls it started are still in flight, since its caller frees the
// trainer's tensors and stream next (by CUDA IPC the server still reads and writes them, and a
// call's completion orders the stream). Fake calls on threads stand in for the service.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "bench/service/trainers.h"

namespace moe::bench {
namespace {

TEST(ServiceStepTest, AFailedRoundReturnsOnlyOnceEveryCallIsDone) {
  constexpr int kCalls = 4;
  auto finished = std::make_shared<std::atomic<int>>(0);
  auto finish_ran = std::make_shared<std::atomic<bool>>(false);
  ServiceTrainer t;
  t.forward = [finished](size_t i, bool) {
    if (i == 0) {  // the first call fails at once
      std::promise<absl::StatusOr<client::ForwardOutput>> p;
      p.set_value(absl::UnavailableError("call 0 failed"));
      return p.get_future();
    }
    // The others end later, well after the failure is known.
    return std::async(std::launch::async,
                      [finished, i]() -> absl::StatusOr<client::ForwardOutput> {
                        std::this_thread::sleep_for(std::chrono::milliseconds(100 * i));
                        finished->fetch_add(1);
                        return client::ForwardOutput{};
                      });
  };
  t.finish = [finish_ran, finished] {
    // The stream is settled after the calls: every call has ended by now.
    EXPECT_EQ(finished->load(), kCalls - 1);
    finish_ran->store(true);
    return absl::OkStatus();
  };
  const std::vector<MicroBatch> mbs(kCalls);
  const absl::Status st = ServiceInferRound(t, mbs, nullptr);
  EXPECT_EQ(st, absl::UnavailableError("call 0 failed"));
  EXPECT_EQ(finished->load(), kCalls - 1);
  EXPECT_TRUE(finish_ran->load());
}

TEST(ServiceStepTest, ASuccessfulRoundFinishesOnce) {
  int finishes = 0;
  ServiceTrainer t;
  t.forward = [](size_t, bool) {
    std::promise<absl::StatusOr<client::ForwardOutput>> p;
    p.set_value(client::ForwardOutput{});
    return p.get_future();
  };
  t.finish = [&finishes] {
    ++finishes;
    return absl::OkStatus();
  };
  const std::vector<MicroBatch> mbs(3);
  EXPECT_TRUE(ServiceInferRound(t, mbs, nullptr).ok());
  EXPECT_EQ(finishes, 1);
}

}  // namespace
}  // namespace moe::bench
