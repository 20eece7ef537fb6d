// server/executor.h: the serial executor runs tasks in order, and GuardAllocation turns an engine
// call that runs out of host memory into ResourceExhausted instead of terminating the server.
#include "server/executor.h"

#include <gtest/gtest.h>

#include <future>
#include <new>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::server {
namespace {

TEST(SerialExecutorTest, RunsTasksInSubmissionOrder) {
  std::vector<int> order;
  std::promise<void> done;
  {
    SerialExecutor executor;
    for (int i = 0; i < 5; ++i) executor.Submit([&order, i](double) { order.push_back(i); });
    executor.Submit([&done](double) { done.set_value(); });
    done.get_future().wait();
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(GuardAllocationTest, AnAllocationFailureBecomesResourceExhaustedNamingTheCall) {
  absl::Status st = GuardAllocation("Forward", []() -> absl::Status { throw std::bad_alloc(); });
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("Forward: the server ran out of host memory"),
            absl::string_view::npos)
      << st;
  absl::StatusOr<int> value = GuardAllocation("Step", []() -> absl::StatusOr<int> {
    throw std::bad_alloc();
  });
  EXPECT_EQ(value.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*GuardAllocation("Step", []() -> absl::StatusOr<int> { return 7; }), 7);
}

}  // namespace
}  // namespace moe::server
