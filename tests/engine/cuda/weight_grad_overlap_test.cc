// The backward's weight gradients on the side lane (PipelineOptions::overlap_weight_grads, the
// default) against the same layer with them on the layer's stream: every tensor of a training
// sequence must be the same bits. GPU only (label "gpu").
//
// The lane only moves work between streams; each GEMM and its accumulation order stay as they
// are, so any difference is an ordering bug: the lane reading dH or pA before they are written,
// or the layer's stream going on (freeing buffers the lane reads, stepping with gradients the
// lane has not finished) without waiting for it. Left to chance these show only when the GPU
// runs far enough behind the host, so the test makes the GPU wait (gpu_delay.h) at the two
// points PipelineOptions::lane_delay names: the layer's stream before dA, and the lane before its
// first GEMM. A build whose lane does not wait for the layer's stream fails all six cases, one
// whose layer stream does not wait for the lane five, all but the one-chunk hybrid
// (docs/decisions/0010-weight-grad-side-stream.md). Several dispatch chunks make one
// chunk's lane meet the next chunk's dA; each backward path is forced in turn, since they hand
// the lane different buffers (gathered dout reused for x in the unfused path, a fresh gathered
// x in the hybrid, none in the fused ones).
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include "common/tensor.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/device.h"
#include "engine/cuda/expert_pipeline.h"
#include "engine/cuda/pipeline_options.h"
#include "engine/layer.h"
#include "tests/engine/cuda/engine_test_util.h"
#include "tests/engine/cuda/gpu_delay.h"

namespace moe {
namespace {

using testing::NormErr;
using testing::RandomRounds;
using testing::Round;
using testing::RunSequence;
using testing::Trace;

// Each longer than any of these cases' kernels take, and the layer's longer than the lane's:
// a lane that does not wait for the layer's stream then runs its GEMMs while dA has not even
// started, and a layer stream that does not wait for the lane finishes the backward (and the
// step) before the lane's GEMMs have run.
int64_t DelayMicroseconds(cuda::LaneTestPoint point) {
  return point == cuda::LaneTestPoint::kLayerBeforeDA ? 10000 : 4000;
}

void DelayAtLanePoint(cuda::LaneTestPoint point, cudaStream_t stream) {
  const cudaError_t err = testing::EnqueueGpuDelay(stream, DelayMicroseconds(point));
  if (err != cudaSuccess) ADD_FAILURE() << "EnqueueGpuDelay: " << cudaGetErrorString(err);
}

struct OCase {
  int64_t tokens, experts, top_k, d, h;
  DType dtype;
  cuda::BackwardKernels backward;
  int64_t chunk_rows = 0;  // > 0: force dispatch chunks of this many rows
};

class WeightGradOverlapTest : public ::testing::TestWithParam<OCase> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(WeightGradOverlapTest, SameBitsAsOnTheLayersStream) {
  const OCase& c = GetParam();
  const uint64_t seed = std::random_device{}();
  std::ostringstream describe;
  describe << "T=" << c.tokens << " E=" << c.experts << " K=" << c.top_k << " d=" << c.d
           << " h=" << c.h << " dtype=" << DTypeName(c.dtype)
           << " backward=" << cuda::BackwardKernelsName(c.backward)
           << " chunk_rows=" << c.chunk_rows << " seed=" << seed;
  const std::string what = describe.str();
  std::mt19937_64 rng(seed);
  cuda::PipelineOptions pipeline;
  pipeline.max_chunk_rows = c.chunk_rows;
  pipeline.backward = c.backward;
  pipeline.poison_allocations = true;
  pipeline.lane_delay = &DelayAtLanePoint;

  LayerConfig config;
  config.num_experts = c.experts;
  config.top_k = c.top_k;
  config.d_model = c.d;
  config.d_hidden = c.h;
  config.activation = Activation::kSwiGLU;
  config.dtype = c.dtype;
  config.routing = RoutingMode::kClient;
  config.seed = rng();
  config.optimizer.learning_rate = 1e-2;
  const std::vector<Round> rounds =
      RandomRounds(2, c.dtype, c.tokens, c.d, c.top_k, c.experts, rng);

  Trace traces[2];  // overlapped, serial
  for (int i = 0; i < 2; ++i) {
    pipeline.overlap_weight_grads = i == 0;
    absl::StatusOr<std::unique_ptr<Engine>> gpu = CreateCudaEngine(0, EngineOptions{}, pipeline);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    absl::StatusOr<std::unique_ptr<Layer>> layer = (*gpu)->CreateLayer(config);
    ASSERT_TRUE(layer.ok()) << layer.status() << " " << what;
    RunSequence(**layer, rounds, what, &traces[i]);
    if (HasFatalFailure()) return;
  }
  const Trace &overlapped = traces[0], &serial = traces[1];
  ASSERT_EQ(overlapped.tensors.size(), serial.tensors.size()) << what;
  ASSERT_GT(overlapped.routed, 0) << what;
  std::printf("[case] %s\n", what.c_str());
  for (size_t i = 0; i < serial.tensors.size(); ++i) {
    const std::string& name = serial.tensors[i].first;
    const Tensor& got = overlapped.tensors[i].second;
    const Tensor& want = serial.tensors[i].second;
    ASSERT_EQ(overlapped.tensors[i].first, name);
    const bool same = got.bytes == want.bytes;
    EXPECT_TRUE(same) << name << " differs from the serial backward's (err " << NormErr(got, want)
                      << "); " << what;
    std::printf("  %-24s %s\n", name.c_str(), same ? "same bits" : "DIFFERS");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Paths, WeightGradOverlapTest,
    ::testing::Values(
        // Each backward path (the fused ones need sm_90 and fall back to unfused elsewhere),
        // bf16, several chunks, widths the sm90 kernels take.
        OCase{600, 8, 2, 64, 32, DType::kBFloat16, cuda::BackwardKernels::kUnfused, 300},
        OCase{600, 8, 2, 64, 32, DType::kBFloat16, cuda::BackwardKernels::kFused, 300},
        OCase{600, 8, 2, 64, 32, DType::kBFloat16, cuda::BackwardKernels::kHybrid, 300},
        // One chunk, more experts and rows.
        OCase{2048, 16, 4, 256, 128, DType::kBFloat16, cuda::BackwardKernels::kFused, 0},
        OCase{2048, 16, 4, 256, 128, DType::kBFloat16, cuda::BackwardKernels::kHybrid, 0},
        // fp32 (unfused only), odd widths, several chunks.
        OCase{300, 7, 3, 37, 19, DType::kFloat32, cuda::BackwardKernels::kAuto, 61}));

}  // namespace
}  // namespace moe
