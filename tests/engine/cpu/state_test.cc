// FullStateSpec against what a layer really exports: for every kind of layer (gated or not,
// client or server routing, AdamW or SGD, fp32 or bf16 storage, whole or sharded) the names,
// dtypes and shapes agree exactly, with and without the optimizer state. A checkpoint is checked
// against FullStateSpec before it is imported, so a drift here would refuse good checkpoints or
// let partial ones through.
#include "engine/state.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/engine/cpu/test_util.h"

namespace moe::testing {
namespace {

TEST(FullStateSpecTest, MatchesExportStateOfEveryKindOfLayer) {
  for (Activation act : {Activation::kSwiGLU, Activation::kGeLUTanh}) {
    for (RoutingMode routing : {RoutingMode::kClient, RoutingMode::kServer}) {
      for (OptimizerKind opt : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
        for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          for (bool sharded : {false, true}) {
            LayerConfig c = SmallConfig(act, routing);
            c.optimizer.kind = opt;
            c.dtype = dtype;
            if (sharded) c.expert_first = 1, c.expert_count = 2;
            const std::string what = absl::StrCat(
                "act ", static_cast<int>(act), " routing ", static_cast<int>(routing), " opt ",
                static_cast<int>(opt), " ", DTypeName(dtype), sharded ? " sharded" : "");
            auto layer = MakeLayer(c);
            ASSERT_NE(layer, nullptr) << what;
            for (bool with_optimizer : {true, false}) {
              auto state = layer->ExportState(with_optimizer);
              ASSERT_TRUE(state.ok()) << what << ": " << state.status();
              const auto spec = FullStateSpec(c, with_optimizer);
              ASSERT_EQ(state->size(), spec.size()) << what << " optimizer " << with_optimizer;
              for (const auto& [name, t] : *state) {
                auto it = spec.find(name);
                ASSERT_NE(it, spec.end()) << what << ": " << name << " not in the spec";
                EXPECT_EQ(t.dtype, it->second.dtype) << what << ": " << name;
                EXPECT_EQ(t.shape, it->second.shape) << what << ": " << name;
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe::testing
