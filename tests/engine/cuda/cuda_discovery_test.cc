// CUDA engine discovery, on any machine: CudaDeviceCount never fails, and CreateCudaEngine
// answers Unavailable without a GPU and InvalidArgument (naming the device) for a bad ordinal.
// Not labelled "gpu": CI runs it, and it must pass there with no GPU or driver.
#include <gtest/gtest.h>

#include <string>

#include "engine/cuda/cuda_engine.h"

namespace moe {
namespace {

TEST(CudaDiscoveryTest, CountNeverFailsAndCreateAnswersClearly) {
  const int n = CudaDeviceCount();
  ASSERT_GE(n, 0);
  absl::StatusOr<std::unique_ptr<Engine>> bad = CreateCudaEngine(n + 3);
  if (n == 0) {
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnavailable) << bad.status();
    EXPECT_EQ(CreateCudaEngine(0).status().code(), absl::StatusCode::kUnavailable);
  } else {
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
    EXPECT_NE(bad.status().message().find("cuda:"), std::string::npos) << bad.status();
    EXPECT_TRUE(CreateCudaEngine(0).ok());
  }
  EXPECT_EQ(CreateCudaEngine(-1).status().code(),
            n == 0 ? absl::StatusCode::kUnavailable : absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe
