// Engine::LayerStateBytes on the CPU engine: for every kind of layer it is exactly what the
// created layer's resident_bytes() reports (the server admits layers on it before allocating);
// an invalid config is InvalidArgument and a state past int64 ResourceExhausted, with nothing
// allocated. DeviceMemory reports host memory.
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cpu_engine.h"
#include "engine/layer.h"

namespace moe {
namespace {

TEST(CpuStateBytesTest, LayerStateBytesIsWhatTheLayerHolds) {
  std::unique_ptr<Engine> engine = CreateCpuEngine(1);
  int cases = 0;
  for (Activation act : {Activation::kSwiGLU, Activation::kReLU}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (OptimizerKind opt : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
        for (RoutingMode routing : {RoutingMode::kClient, RoutingMode::kServer}) {
          for (int64_t count : {int64_t{-1}, int64_t{2}}) {
            LayerConfig c;
            c.num_experts = 5;
            c.top_k = 2;
            c.d_model = 12;
            c.d_hidden = 20;
            c.activation = act;
            c.dtype = dtype;
            c.optimizer.kind = opt;
            c.routing = routing;
            c.expert_first = count < 0 ? 0 : 3;
            c.expert_count = count;
            const std::string what = absl::StrCat(
                "act ", static_cast<int>(act), " dtype ", DTypeName(dtype), " opt ",
                static_cast<int>(opt), " routing ", static_cast<int>(routing), " count ", count);
            absl::StatusOr<int64_t> bytes = engine->LayerStateBytes(c);
            ASSERT_TRUE(bytes.ok()) << what << ": " << bytes.status();
            absl::StatusOr<std::unique_ptr<Layer>> layer = engine->CreateLayer(c);
            ASSERT_TRUE(layer.ok()) << what << ": " << layer.status();
            EXPECT_EQ(*bytes, (*layer)->resident_bytes()) << what;
            EXPECT_GT(*bytes, 0) << what;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 32);
}

TEST(CpuStateBytesTest, ComputedWithoutAllocating) {
  std::unique_ptr<Engine> engine = CreateCpuEngine(1);
  LayerConfig c;  // E = 32, d = h = 2048, fp32, AdamW: 6 GiB, never allocated here
  c.num_experts = 32;
  c.top_k = 2;
  c.d_model = 2048;
  c.d_hidden = 2048;
  absl::StatusOr<int64_t> bytes = engine->LayerStateBytes(c);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, int64_t{6} << 30);
  EXPECT_EQ(engine->memory_in_use_bytes(), 0);
}

TEST(CpuStateBytesTest, InvalidOrUnrepresentableConfigsAreRefused) {
  std::unique_ptr<Engine> engine = CreateCpuEngine(1);
  LayerConfig c;
  c.num_experts = 4;
  c.top_k = 9;
  c.d_model = 8;
  c.d_hidden = 8;
  EXPECT_EQ(engine->LayerStateBytes(c).status().code(), absl::StatusCode::kInvalidArgument);
  // One local expert keeps the expert weights valid; the router, d * E, is near 2^62 elements:
  // ValidateLayerConfig bounds it, so the config itself is refused.
  c.num_experts = (int64_t{1} << 31) - 1;
  c.top_k = 1;
  c.d_model = (int64_t{1} << 31) - 1;
  c.d_hidden = 1;
  c.expert_first = 0;
  c.expert_count = 1;
  c.routing = RoutingMode::kServer;
  absl::StatusOr<int64_t> bytes = engine->LayerStateBytes(c);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument) << bytes.status();
  EXPECT_NE(bytes.status().message().find("router"), absl::string_view::npos) << bytes.status();
}

TEST(CpuStateBytesTest, DeviceMemoryIsHostMemory) {
  absl::StatusOr<DeviceMemoryInfo> info = CreateCpuEngine(1)->DeviceMemory();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->host);
  EXPECT_GT(info->total_bytes, 0);
  EXPECT_GE(info->free_bytes, 0);
  EXPECT_LE(info->free_bytes, info->total_bytes);
}

}  // namespace
}  // namespace moe
