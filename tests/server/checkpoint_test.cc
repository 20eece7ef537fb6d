// safetensors serialisation and checkpoint files: exact round trip, the byte layout the format
// prescribes, malformed files rejected with DataLoss, atomic writes and safe path resolution.
#include "server/checkpoint.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <random>
#include <string>

#include "server/safetensors.h"

namespace moe::server {
namespace {

Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  std::mt19937 rng(seed);
  for (auto& b : t.bytes) b = static_cast<std::byte>(rng() & 0xFF);
  return t;
}

std::string FreshDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "/moe_ckpt_" + name + "_" + std::to_string(::getpid());
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

TEST(SafetensorsTest, RoundTripIsExact) {
  SafetensorsFile f;
  f.tensors["w1"] = RandomTensor(DType::kFloat32, {3, 5, 7}, 1);
  f.tensors["w2"] = RandomTensor(DType::kBFloat16, {2, 9}, 2);
  f.tensors["ids"] = RandomTensor(DType::kInt32, {4}, 3);
  f.tensors["step"] = RandomTensor(DType::kInt64, {1}, 4);
  f.metadata["k"] = "value with \"quotes\" and \\ and\nnewline";
  auto bytes = SerializeSafetensors(f);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  // Header length prefix, 8-byte aligned JSON header.
  uint64_t n = 0;
  std::memcpy(&n, bytes->data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ((*bytes)[8], '{');
  auto back = ParseSafetensors(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->metadata, f.metadata);
  ASSERT_EQ(back->tensors.size(), f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    const Tensor& u = back->tensors.at(name);
    EXPECT_EQ(u.dtype, t.dtype) << name;
    EXPECT_EQ(u.shape, t.shape) << name;
    EXPECT_EQ(u.bytes, t.bytes) << name;
  }
}

TEST(SafetensorsTest, MalformedFilesAreDataLoss) {
  SafetensorsFile f;
  f.tensors["w"] = RandomTensor(DType::kFloat32, {4}, 5);
  std::string good = *SerializeSafetensors(f);
  EXPECT_EQ(ParseSafetensors("abc").status().code(), absl::StatusCode::kDataLoss);
  std::string truncated = good.substr(0, good.size() - 1);
  EXPECT_EQ(ParseSafetensors(truncated).status().code(), absl::StatusCode::kDataLoss);
  std::string huge_header = good;
  huge_header[7] = '\x7f';
  EXPECT_EQ(ParseSafetensors(huge_header).status().code(), absl::StatusCode::kDataLoss);
  std::string bad_dtype = good;
  bad_dtype.replace(bad_dtype.find("F32"), 3, "F99");
  auto st = ParseSafetensors(bad_dtype).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("F99"), std::string::npos) << st;
}

TEST(CheckpointTest, AtomicWriteReplacesAndLeavesNoTemporaryFile) {
  const std::string dir = FreshDir("atomic");
  const std::string path = dir + "/a.safetensors";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "second, longer").ok());
  EXPECT_EQ(*ReadWholeFile(path), "second, longer");
  DIR* d = ::opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  int entries = 0;
  while (dirent* e = ::readdir(d)) {
    if (std::string(e->d_name) == "." || std::string(e->d_name) == "..") continue;
    ++entries;
    EXPECT_EQ(std::string(e->d_name), "a.safetensors");
  }
  ::closedir(d);
  EXPECT_EQ(entries, 1);
  EXPECT_EQ(WriteFileAtomically(dir + "/missing/x", "y").code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, PathsStayInsideTheCheckpointDirectory) {
  const std::string dir = FreshDir("paths");
  EXPECT_EQ(ResolveCheckpointPath(dir, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveCheckpointPath(dir, "/etc/passwd").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto up = ResolveCheckpointPath(dir, "a/../../x");
  EXPECT_EQ(up.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(up.status().message().find("path"), std::string::npos);
  EXPECT_EQ(ResolveCheckpointPath("", "x").status().code(), absl::StatusCode::kFailedPrecondition);
  auto nested = ResolveCheckpointPath(dir, "run1/layer0.safetensors");
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_EQ(*nested, dir + "/run1/layer0.safetensors");
  struct stat s;
  EXPECT_EQ(::stat((dir + "/run1").c_str(), &s), 0);
}

TEST(CheckpointTest, EncodeDecodeKeepsConfigAndState) {
  LayerConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.d_model = 8;
  c.d_hidden = 4;
  c.activation = Activation::kGeLUTanh;
  c.routing = RoutingMode::kServer;
  c.expert_first = 2;
  c.expert_count = 3;
  c.seed = 77;
  c.aux_loss_coef = 0.01;
  c.optimizer.kind = OptimizerKind::kSgd;
  c.optimizer.learning_rate = 0.5;
  c.optimizer.momentum = 0.9;
  std::map<std::string, Tensor> state;
  state["w1"] = RandomTensor(DType::kFloat32, {3, 4, 8}, 9);
  Tensor step = Tensor::Zeros(DType::kInt64, {1});
  step.as<int64_t>()[0] = 12;
  state["step"] = step;
  auto bytes = EncodeCheckpoint("layer", c, state);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeCheckpoint(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->config.num_experts, 6);
  EXPECT_EQ(back->config.activation, Activation::kGeLUTanh);
  EXPECT_EQ(back->config.routing, RoutingMode::kServer);
  EXPECT_EQ(back->config.expert_first, 2);
  EXPECT_EQ(back->config.expert_count, 3);
  EXPECT_EQ(back->config.seed, 77u);
  EXPECT_EQ(back->config.aux_loss_coef, 0.01);
  EXPECT_EQ(back->config.optimizer.kind, OptimizerKind::kSgd);
  EXPECT_EQ(back->config.optimizer.momentum, 0.9);
  EXPECT_EQ(back->state.at("w1").bytes, state["w1"].bytes);
  EXPECT_EQ(back->state.at("step").as<int64_t>()[0], 12);
  auto file = ParseSafetensors(*bytes);
  EXPECT_EQ(file->metadata.at(kCheckpointStepKey), "12");
}

}  // namespace
}  // namespace moe::server
