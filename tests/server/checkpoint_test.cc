// Checkpoint files: paths resolved only inside the checkpoint directory (no symbolic link, FIFO,
// device or directory is read or written, long paths refused), size bounds applied before
// reading, atomic writes that a stopped call leaves undone, start-up removal of the temporary
// files an interrupted write leaves, and a checkpoint accepted only whole.
#include "server/checkpoint.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/state.h"
#include "server/safetensors.h"

namespace moe::server {
namespace {

constexpr int64_t kNoBound = int64_t{1} << 40;

Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  std::mt19937 rng(seed);
  for (auto& b : t.bytes) b = static_cast<std::byte>(rng() & 0xFF);
  return t;
}

std::string FreshDir(const std::string& name) {
  static int counter = 0;
  std::string dir =
      absl::StrCat(::testing::TempDir(), "/moe_ckpt_", name, "_", ::getpid(), "_", counter++);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string ReadRaw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.insert(n);
  }
  ::closedir(d);
  return out;
}

// A valid safetensors file of `n` float32 values.
std::string SmallFile(int64_t n = 4) {
  SafetensorsFile f;
  f.tensors["w"] = RandomTensor(DType::kFloat32, {n}, 7);
  return *SerializeSafetensors(f);
}

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& substring,
                  const std::string& what) {
  EXPECT_EQ(s.code(), code) << what << ": " << s;
  EXPECT_NE(s.message().find(substring), std::string::npos) << what << ": " << s;
}

// --- Paths ---------------------------------------------------------------------------------
TEST(CheckpointPathTest, OnlyPlainRelativePathsOfBoundedLength) {
  struct Case {
    std::string path;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"", "empty"},
      {"/", "relative"},
      {"//", "relative"},
      {"/etc/passwd", "relative"},
      {"a/../../x", "'..'"},
      {"./x", "'.'"},
      {std::string("a\0b", 3), "NUL"},
      {std::string(5000, 'a'), "5000 characters"},
      {std::string(201, 'a'), "component of 201 characters"},
      {[] {
         std::string p;
         for (int i = 0; i < 40; ++i) p += "d/";
         return p + "x";
       }(),
       "components"},
  };
  for (const Case& c : cases) {
    auto parts = SplitCheckpointPath(c.path);
    ExpectStatus(parts.status(), absl::StatusCode::kInvalidArgument, "path:", c.path.substr(0, 40));
    ExpectStatus(parts.status(), absl::StatusCode::kInvalidArgument, c.message,
                 c.path.substr(0, 40));
    // The file operations apply the same rules before touching the directory.
    const std::string dir = FreshDir("split");
    EXPECT_EQ(ReadCheckpointFile(dir, c.path, kNoBound).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(WriteCheckpointFile(dir, c.path, "x", kNoBound).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  auto ok = SplitCheckpointPath("run1//layer0.safetensors/");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, (std::vector<std::string>{"run1", "layer0.safetensors"}));
}

TEST(CheckpointFileTest, WritesAtomicallyUnderTheRootAndReadsBack) {
  const std::string dir = FreshDir("atomic");
  const std::string first = SmallFile(4), second = SmallFile(9);
  auto path = WriteCheckpointFile(dir, "run1/deep/a.safetensors", first, kNoBound);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, dir + "/run1/deep/a.safetensors");
  ASSERT_TRUE(WriteCheckpointFile(dir, "run1/deep/a.safetensors", second, kNoBound).ok());
  auto back = ReadCheckpointFile(dir, "run1/deep/a.safetensors", kNoBound);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, second);
  EXPECT_EQ(Entries(dir + "/run1/deep"), std::set<std::string>{"a.safetensors"});
  ExpectStatus(ReadCheckpointFile(dir, "run1/missing", kNoBound).status(),
               absl::StatusCode::kNotFound, "does not exist", "missing file");
  ExpectStatus(ReadCheckpointFile(dir, "nowhere/x", kNoBound).status(), absl::StatusCode::kNotFound,
               "does not exist", "missing directory");
  ExpectStatus(ReadCheckpointFile("", "x", kNoBound).status(),
               absl::StatusCode::kFailedPrecondition, "--checkpoint_dir", "no root");
  ExpectStatus(WriteCheckpointFile(dir + "/absent", "x", "y", kNoBound).status(),
               absl::StatusCode::kFailedPrecondition, "checkpoint directory", "missing root");
}

// Every hostile entry a client's path can meet, for a read and for a write.
TEST(CheckpointFileTest, RefusesLinksAndWhatIsNotARegularFile) {
  const std::string dir = FreshDir("hostile");
  const std::string outside = FreshDir("outside");
  WriteRaw(outside + "/victim.safetensors", SmallFile());
  ASSERT_EQ(::symlink(outside.c_str(), (dir + "/linkdir").c_str()), 0);
  ASSERT_EQ(::symlink("/etc/passwd", (dir + "/passwd").c_str()), 0);
  ASSERT_EQ(::symlink("/dev/zero", (dir + "/zero").c_str()), 0);
  ASSERT_EQ(::symlink((outside + "/victim.safetensors").c_str(), (dir + "/link.st").c_str()), 0);
  ASSERT_EQ(::symlink("/nonexistent/target", (dir + "/dangling").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  ASSERT_EQ(::mkdir((dir + "/adir").c_str(), 0755), 0);
  WriteRaw(dir + "/plain", SmallFile());
  struct Case {
    std::string path;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"linkdir/victim.safetensors", "symbolic link"},
      {"linkdir/new/x.safetensors", "symbolic link"},
      {"passwd", "symbolic link"},
      {"zero", "symbolic link"},
      {"link.st", "symbolic link"},
      {"dangling", "symbolic link"},
      {"fifo", "not a regular file"},
      {"adir", "is a directory"},
      {"plain/x", "not a directory"},
  };
  for (const Case& c : cases) {
    // Off the test's thread: an implementation that opens the FIFO blocking would hang here.
    auto read = std::async(std::launch::async,
                           [&] { return ReadCheckpointFile(dir, c.path, kNoBound).status(); });
    if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      WriteRaw(dir + "/fifo", "");  // a writer end releases the blocked reader
      ADD_FAILURE() << c.path << ": the read blocked";
      continue;
    }
    const absl::Status r = read.get();
    ExpectStatus(r, absl::StatusCode::kFailedPrecondition, c.message, "read " + c.path);
    EXPECT_NE(r.message().find("path:"), std::string::npos) << r;
    EXPECT_EQ(r.message().find("root:"), std::string::npos) << r;
    EXPECT_EQ(r.message().find(dir), std::string::npos) << "names the server's directory: " << r;
    const absl::Status w = WriteCheckpointFile(dir, c.path, SmallFile(), kNoBound).status();
    ExpectStatus(w, absl::StatusCode::kFailedPrecondition, c.message, "write " + c.path);
  }
  // Nothing was written through the links, nothing left behind.
  EXPECT_EQ(Entries(outside), std::set<std::string>{"victim.safetensors"});
  EXPECT_EQ(ReadRaw(outside + "/victim.safetensors"), SmallFile());
  EXPECT_EQ(Entries(dir), (std::set<std::string>{"linkdir", "passwd", "zero", "link.st", "dangling",
                                                 "fifo", "adir", "plain"}));
  EXPECT_TRUE(Entries(dir + "/adir").empty());
}

TEST(CheckpointFileTest, SizesAreBoundedBeforeReadingOrWriting) {
  const std::string dir = FreshDir("bounds");
  const std::string file = SmallFile(64);  // > 256 bytes
  WriteRaw(dir + "/big", file);
  ExpectStatus(ReadCheckpointFile(dir, "big", 100).status(), absl::StatusCode::kResourceExhausted,
               "max_checkpoint_bytes", "read above the bound");
  ExpectStatus(WriteCheckpointFile(dir, "new", file, 100).status(),
               absl::StatusCode::kResourceExhausted, "max_checkpoint_bytes",
               "write above the bound");
  EXPECT_EQ(Entries(dir), std::set<std::string>{"big"});
  EXPECT_TRUE(ReadCheckpointFile(dir, "big", static_cast<int64_t>(file.size())).ok());
  // The header length is checked before the rest is read: a huge claimed header is DataLoss
  // whatever the bound.
  std::string lying = file;
  for (int i = 0; i < 8; ++i) lying[i] = '\xff';
  WriteRaw(dir + "/lying", lying);
  ExpectStatus(ReadCheckpointFile(dir, "lying", kNoBound).status(), absl::StatusCode::kDataLoss,
               "header length", "lying header length");
  WriteRaw(dir + "/short", "1234");
  ExpectStatus(ReadCheckpointFile(dir, "short", kNoBound).status(), absl::StatusCode::kDataLoss,
               "shorter than 8 bytes", "short file");
}

TEST(CheckpointFileTest, AStoppedCallLeavesTheOldFileAndNoTemporaryFile) {
  const std::string dir = FreshDir("stopped");
  const std::string old_bytes = SmallFile(4);
  ASSERT_TRUE(WriteCheckpointFile(dir, "a.safetensors", old_bytes, kNoBound).ok());
  // Stopped at every point keep_going is asked, from the first to the last (before the rename).
  for (int stop_at = 1;; ++stop_at) {
    int asked = 0;
    const KeepGoing keep_going = [&]() -> absl::Status {
      return ++asked == stop_at ? absl::DeadlineExceededError("deadline") : absl::OkStatus();
    };
    auto w = WriteCheckpointFile(dir, "a.safetensors", SmallFile(2000), kNoBound, keep_going);
    if (w.ok()) {
      ASSERT_GE(stop_at, 3) << "keep_going was asked only " << stop_at - 1 << " times";
      break;
    }
    EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
    EXPECT_EQ(ReadRaw(dir + "/a.safetensors"), old_bytes) << "stopped at " << stop_at;
    EXPECT_EQ(Entries(dir), std::set<std::string>{"a.safetensors"}) << "stopped at " << stop_at;
  }
  const KeepGoing stop = [] { return absl::CancelledError("cancelled"); };
  EXPECT_EQ(ReadCheckpointFile(dir, "a.safetensors", kNoBound, stop).status().code(),
            absl::StatusCode::kCancelled);
}

// --- Debris --------------------------------------------------------------------------------
TEST(CheckpointDebrisTest, NamesOfTemporaryFiles) {
  EXPECT_TRUE(IsCheckpointDebrisName("a.safetensors.tmp.123.4567"));
  EXPECT_TRUE(IsCheckpointDebrisName("x.tmp.1.2"));
  EXPECT_FALSE(IsCheckpointDebrisName(".tmp.1.2"));
  EXPECT_FALSE(IsCheckpointDebrisName("a.safetensors"));
  EXPECT_FALSE(IsCheckpointDebrisName("notes.tmp.txt"));
  EXPECT_FALSE(IsCheckpointDebrisName("x.tmp.1"));
  EXPECT_FALSE(IsCheckpointDebrisName("x.tmp.1.2.3"));
  EXPECT_FALSE(IsCheckpointDebrisName("x.tmp.1.2a"));
  EXPECT_FALSE(IsCheckpointDebrisName("x.tmp..2"));
}

TEST(CheckpointDebrisTest, RemovesTemporaryFilesOfDeadWritersOnly) {
  const std::string dir = FreshDir("debris");
  const std::string outside = FreshDir("debris_outside");
  ASSERT_EQ(::mkdir((dir + "/run1").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/run1/deep").c_str(), 0755), 0);
  const std::string real = SmallFile();
  WriteRaw(dir + "/a.safetensors", real);
  WriteRaw(dir + "/run1/deep/b.safetensors", real);
  WriteRaw(dir + "/notes.tmp.txt", "keep");
  // Debris: a writer that no longer exists (beyond any pid_max), and one with this process's
  // pid (a restarted server in a fresh pid namespace gets its old pid).
  WriteRaw(dir + "/a.safetensors.tmp.999999999.42", std::string(1000, 'x'));
  WriteRaw(dir + "/run1/deep/b.safetensors.tmp." + std::to_string(::getpid()) + ".7",
           std::string(24, 'x'));
  // Kept: a live writer (the parent process, alive while this test runs), a directory and a
  // symbolic link of debris-like names, and debris behind a symbolic link.
  const std::string live = "/c.safetensors.tmp." + std::to_string(::getppid()) + ".1";
  WriteRaw(dir + live, "live");
  ASSERT_EQ(::mkdir((dir + "/d.tmp.1.2").c_str(), 0755), 0);
  WriteRaw(outside + "/e.tmp.999999999.1", "outside");
  ASSERT_EQ(
      ::symlink((outside + "/e.tmp.999999999.1").c_str(), (dir + "/f.tmp.999999999.1").c_str()), 0);
  ASSERT_EQ(::symlink(outside.c_str(), (dir + "/linked").c_str()), 0);

  auto swept = RemoveCheckpointDebris(dir);
  ASSERT_TRUE(swept.ok()) << swept.status();
  EXPECT_EQ(swept->removed, 2);
  EXPECT_EQ(swept->removed_bytes, 1024);
  EXPECT_EQ(swept->in_use, 1);
  EXPECT_EQ(swept->failed, 0);
  EXPECT_EQ(Entries(dir),
            (std::set<std::string>{"a.safetensors", "run1", "notes.tmp.txt", live.substr(1),
                                   "d.tmp.1.2", "f.tmp.999999999.1", "linked"}));
  EXPECT_EQ(Entries(dir + "/run1/deep"), std::set<std::string>{"b.safetensors"});
  EXPECT_EQ(ReadRaw(dir + "/a.safetensors"), real);
  EXPECT_EQ(ReadRaw(dir + "/run1/deep/b.safetensors"), real);
  EXPECT_EQ(Entries(outside), std::set<std::string>{"e.tmp.999999999.1"});
  EXPECT_EQ(RemoveCheckpointDebris(dir + "/absent").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// --- Encoding and whole-state checks -------------------------------------------------------
LayerConfig ShardedSgdConfig() {
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
  return c;
}

// The full state FullStateSpec describes, with random values.
std::map<std::string, Tensor> FullState(const LayerConfig& c) {
  std::map<std::string, Tensor> state;
  uint32_t seed = 1;
  for (const auto& [name, spec] : FullStateSpec(c, true)) {
    state[name] = name == "step" ? Tensor::Zeros(DType::kInt64, {1})
                                 : RandomTensor(spec.dtype, spec.shape, seed++);
  }
  return state;
}

TEST(CheckpointTest, EncodeDecodeKeepsConfigAndState) {
  const LayerConfig c = ShardedSgdConfig();
  std::map<std::string, Tensor> state = FullState(c);
  state["step"].as<int64_t>()[0] = 12;
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
  ASSERT_EQ(back->state.size(), state.size());
  for (const auto& [name, t] : state) EXPECT_EQ(back->state.at(name).bytes, t.bytes) << name;
  EXPECT_TRUE(CheckCheckpointState(back->config, back->state).ok());
  auto file = ParseSafetensors(*bytes);
  EXPECT_EQ(file->metadata.at(kCheckpointStepKey), "12");
}

TEST(CheckpointTest, DecodeRefusesFilesThatAreNotCheckpoints) {
  SafetensorsFile plain;
  plain.tensors["w"] = RandomTensor(DType::kFloat32, {2}, 1);
  ExpectStatus(DecodeCheckpoint(*SerializeSafetensors(plain)).status(), absl::StatusCode::kDataLoss,
               kCheckpointConfigKey, "no config");
  plain.metadata[kCheckpointConfigKey] = "{\"numExperts\": \"secret-text\"";
  auto st = DecodeCheckpoint(*SerializeSafetensors(plain)).status();
  ExpectStatus(st, absl::StatusCode::kDataLoss, "not a moe.v1.LayerConfig", "bad config JSON");
  EXPECT_EQ(st.message().find("secret"), std::string::npos) << st;
  plain.metadata[kCheckpointConfigKey] = "{\"numExperts\": 0}";
  ExpectStatus(DecodeCheckpoint(*SerializeSafetensors(plain)).status(), absl::StatusCode::kDataLoss,
               "bad layer config", "invalid config");
}

TEST(CheckpointTest, OnlyAWholeStateIsAccepted) {
  const LayerConfig c = ShardedSgdConfig();
  const std::map<std::string, Tensor> full = FullState(c);
  ASSERT_TRUE(CheckCheckpointState(c, full).ok());
  ASSERT_TRUE(CheckCheckpointFitsLayer("x", c, full).ok());
  struct Case {
    const char* what;
    std::function<void(std::map<std::string, Tensor>&)> edit;
    const char* tensor;
  };
  const std::vector<Case> cases = {
      {"missing weight", [](auto& s) { s.erase("w2"); }, "\"w2\""},
      {"missing optimizer state", [](auto& s) { s.erase("router.momentum"); },
       "\"router.momentum\""},
      {"missing step", [](auto& s) { s.erase("step"); }, "\"step\""},
      {"extra tensor", [](auto& s) { s["bogus"] = Tensor::Zeros(DType::kFloat32, {1}); },
       "\"bogus\""},
      {"state of another optimizer",
       [](auto& s) {
         s["w1.exp_avg"] = Tensor::Zeros(DType::kFloat32, {3, 4, 8});
       },
       "\"w1.exp_avg\""},
      {"wrong shape",
       [](auto& s) {
         s["w1"] = Tensor::Zeros(DType::kFloat32, {3, 8, 4});
       },
       "\"w1\""},
      {"wrong dtype", [](auto& s) { s["step"] = Tensor::Zeros(DType::kInt32, {1}); }, "\"step\""},
  };
  for (const Case& cs : cases) {
    std::map<std::string, Tensor> state = full;
    cs.edit(state);
    ExpectStatus(CheckCheckpointState(c, state), absl::StatusCode::kDataLoss, cs.tensor, cs.what);
    ExpectStatus(CheckCheckpointFitsLayer("x", c, state), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("state[", cs.tensor, "]"), cs.what);
  }
  // A whole checkpoint of another layer shape does not fit.
  LayerConfig gated = c;
  gated.activation = Activation::kSwiGLU;
  ExpectStatus(CheckCheckpointFitsLayer("x", gated, full), absl::StatusCode::kInvalidArgument,
               "state[\"w3\"]", "layer needs w3");
}

}  // namespace
}  // namespace moe::server
