// Hostile checkpoint paths and files through a real moe-server on loopback: symbolic links out of
// the checkpoint directory, /etc/passwd and /dev/zero behind links, a FIFO, a directory, a long
// path, a huge header length, a \uZZZZ escape, partial, padded and mis-shaped states, a file
// above the size bound. Each gets its status code and a message naming the problem; after each
// the server still serves (a Forward right after), a reference layer keeps its weights and
// optimizer state bit for bit, no layer appears and nothing outside the directory changes. And a
// restart removes the temporary files an interrupted Save left, keeping the checkpoints.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "server/checkpoint.h"
#include "server/server.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

using client::Connection;

std::string ReadRaw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

server::ServerOptions Options(const std::string& checkpoint_dir) {
  server::ServerOptions o = LoopbackOptions();
  o.checkpoint_dir = checkpoint_dir;
  return o;
}

Loopback Start(const server::ServerOptions& options) {
  client::ClientOptions copts = LoopbackClientOptions();
  // Short: a call that stalls shows as DEADLINE_EXCEEDED instead of its expected status.
  copts.timeout = std::chrono::seconds(10);
  return StartLoopback(options, copts);
}

LayerConfig RefConfig() {
  LayerConfig c;
  c.num_experts = 4;
  c.top_k = 2;
  c.d_model = 16;
  c.d_hidden = 24;
  c.activation = Activation::kSwiGLU;  // gated: the layer has a w3
  c.routing = RoutingMode::kServer;
  c.seed = 3;
  c.optimizer.learning_rate = 1e-2;
  return c;
}

// One training step, so the optimizer state is not all zeros.
void TrainOnce(Connection& c, const std::string& layer, std::mt19937& rng) {
  Tensor x = RandomFloat(rng, {10, RefConfig().d_model});
  const uint64_t id = c.NextContextId();
  auto f = c.Forward(layer, id, true, x.view(), {}, {}).get();
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(c.Backward(layer, id, x.view()).get().ok());
  ASSERT_TRUE(c.Step(layer).ok());
}

std::string Encode(const std::string& name, const LayerConfig& config,
                   const std::map<std::string, Tensor>& state) {
  auto bytes = server::EncodeCheckpoint(name, config, state);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : "";
}

TEST(HostileCheckpointTest, EveryHostileInputGetsItsStatusAndChangesNothing) {
  const std::string dir = TempDir("ckpt");
  const std::string outside = TempDir("outside");
  server::ServerOptions options = Options(dir);
  options.max_checkpoint_bytes = 1 << 20;
  Loopback lb = Start(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  std::mt19937 rng(8);
  ASSERT_TRUE(c.CreateLayer("ref", RefConfig()).ok());
  TrainOnce(c, "ref", rng);
  ASSERT_TRUE(c.SaveCheckpoint("ref", "good.safetensors").ok());
  TrainOnce(c, "ref", rng);  // the reference now differs from good.safetensors
  LayerConfig other_config = RefConfig();
  other_config.d_hidden = 12;
  ASSERT_TRUE(c.CreateLayer("other", other_config).ok());
  ASSERT_TRUE(c.SaveCheckpoint("other", "other.safetensors").ok());
  ASSERT_TRUE(c.DeleteLayer("other").ok());

  // The hostile files.
  auto good = server::DecodeCheckpoint(ReadRaw(dir + "/good.safetensors"));
  ASSERT_TRUE(good.ok()) << good.status();
  auto edited = [&](const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    std::map<std::string, Tensor> state = good->state;
    edit(state);
    return Encode("ref", good->config, state);
  };
  WriteRaw(dir + "/missing_w3.safetensors", edited([](auto& s) { s.erase("w3"); }));
  WriteRaw(dir + "/missing_moment.safetensors", edited([](auto& s) { s.erase("w2.exp_avg_sq"); }));
  WriteRaw(dir + "/extra.safetensors",
           edited([](auto& s) { s["bogus"] = Tensor::Zeros(DType::kFloat32, {2}); }));
  WriteRaw(dir + "/misshaped.safetensors", edited([](auto& s) {
             s["w1"] = Tensor::Zeros(DType::kFloat32, {4, 16, 24});
           }));
  WriteRaw(dir + "/nan.safetensors",
           edited([](auto& s) { s["w2"].template as<float>()[5] = std::nanf(""); }));
  const std::string header = R"({"\uZZZZ":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string unicode(8, '\0');
  unicode[0] = static_cast<char>(header.size());
  WriteRaw(dir + "/unicode.safetensors", unicode + header + std::string(4, '\0'));
  WriteRaw(dir + "/huge_header.safetensors", std::string(8, '\xff') + "{}");
  WriteRaw(dir + "/big.safetensors", std::string((1 << 20) + 1, '\0'));
  ASSERT_EQ(::symlink(outside.c_str(), (dir + "/sub").c_str()), 0);
  ASSERT_EQ(::symlink("/etc/passwd", (dir + "/passwd").c_str()), 0);
  ASSERT_EQ(::symlink("/dev/zero", (dir + "/zero").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  ASSERT_EQ(::mkdir((dir + "/adir").c_str(), 0755), 0);
  const std::string long_path(5000, 'p');

  auto before = c.ExportWeights("ref", /*include_optimizer=*/true);
  ASSERT_TRUE(before.ok()) << before.status();
  const std::set<std::string> dir_before = [&] {
    std::set<std::string> s;
    for (const char* n : {"good.safetensors", "other.safetensors"})
      s.insert(ReadRaw(dir + "/" + n));
    return s;
  }();

  enum Op { kSave, kLoad };
  struct Case {
    const char* what;
    Op op;
    std::string layer;
    std::string path;
    absl::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"save through a symlinked directory", kSave, "ref", "sub/x.safetensors",
       absl::StatusCode::kFailedPrecondition, "symbolic link"},
      {"load through a symlinked directory", kLoad, "ref", "sub/x.safetensors",
       absl::StatusCode::kFailedPrecondition, "symbolic link"},
      {"symlink to /etc/passwd", kLoad, "ref", "passwd", absl::StatusCode::kFailedPrecondition,
       "symbolic link"},
      {"symlink to /etc/passwd, new layer", kLoad, "fresh", "passwd",
       absl::StatusCode::kFailedPrecondition, "symbolic link"},
      {"save over a symlink", kSave, "ref", "passwd", absl::StatusCode::kFailedPrecondition,
       "symbolic link"},
      {"huge header length", kLoad, "ref", "huge_header.safetensors", absl::StatusCode::kDataLoss,
       "header length"},
      {"missing w3", kLoad, "ref", "missing_w3.safetensors", absl::StatusCode::kDataLoss,
       "\"w3\" is missing"},
      {"missing w3, new layer", kLoad, "fresh", "missing_w3.safetensors",
       absl::StatusCode::kDataLoss, "\"w3\" is missing"},
      {"missing optimizer state", kLoad, "ref", "missing_moment.safetensors",
       absl::StatusCode::kDataLoss, "\"w2.exp_avg_sq\" is missing"},
      {"extra tensor", kLoad, "ref", "extra.safetensors", absl::StatusCode::kDataLoss, "\"bogus\""},
      {"mis-shaped tensor", kLoad, "ref", "misshaped.safetensors", absl::StatusCode::kDataLoss,
       "\"w1\""},
      {"checkpoint of another layer shape", kLoad, "ref", "other.safetensors",
       absl::StatusCode::kInvalidArgument, "state[\"w1\"]"},
      {"non-finite weight", kLoad, "ref", "nan.safetensors", absl::StatusCode::kInvalidArgument,
       "state[\"w2\"]"},
      {"non-finite weight, new layer", kLoad, "fresh", "nan.safetensors",
       absl::StatusCode::kInvalidArgument, "state[\"w2\"]"},
      {"5000-character path, load", kLoad, "ref", long_path, absl::StatusCode::kInvalidArgument,
       "path: 5000 characters"},
      {"5000-character path, save", kSave, "ref", long_path, absl::StatusCode::kInvalidArgument,
       "path: 5000 characters"},
      {"load a directory", kLoad, "ref", "adir", absl::StatusCode::kFailedPrecondition,
       "is a directory"},
      {"save onto a directory", kSave, "ref", "adir", absl::StatusCode::kFailedPrecondition,
       "is a directory"},
      {"save below a file", kSave, "ref", "good.safetensors/x",
       absl::StatusCode::kFailedPrecondition, "not a directory"},
      {"file above --max_checkpoint_bytes", kLoad, "ref", "big.safetensors",
       absl::StatusCode::kResourceExhausted, "max_checkpoint_bytes"},
      {"missing file", kLoad, "fresh", "absent.safetensors", absl::StatusCode::kNotFound,
       "does not exist"},
      // Last, the inputs that crash, exhaust or stall a server that reads blindly, so that such
      // a regression still shows every other case's result.
      {"\\uZZZZ in the header", kLoad, "ref", "unicode.safetensors", absl::StatusCode::kDataLoss,
       "not valid JSON"},
      {"symlink to /dev/zero", kLoad, "ref", "zero", absl::StatusCode::kFailedPrecondition,
       "symbolic link"},
      {"FIFO", kLoad, "ref", "fifo", absl::StatusCode::kFailedPrecondition, "not a regular file"},
  };
  for (const Case& cs : cases) {
    const absl::Status st = cs.op == kSave ? c.SaveCheckpoint(cs.layer, cs.path).status()
                                           : c.LoadCheckpoint(cs.layer, cs.path).status();
    EXPECT_EQ(st.code(), cs.code) << cs.what << ": " << st;
    EXPECT_NE(st.message().find(cs.message), std::string::npos) << cs.what << ": " << st;
    EXPECT_EQ(st.message().find("root:"), std::string::npos) << cs.what << ": " << st;
    EXPECT_EQ(st.message().find(dir), std::string::npos) << cs.what << ": " << st;

    // The server still serves, the reference layer is untouched and no layer appeared. What a
    // case did change is undone, so that each case is judged on its own.
    Tensor x = RandomFloat(rng, {5, RefConfig().d_model});
    auto f = c.Forward("ref", 0, false, x.view(), {}, {}).get();
    EXPECT_TRUE(f.ok()) << cs.what << ": " << f.status();
    auto after = c.ExportWeights("ref", true);
    ASSERT_TRUE(after.ok()) << cs.what << ": " << after.status();
    bool unchanged = after->size() == before->size();
    for (const auto& [name, t] : *before) {
      if (after->count(name) == 0 || after->at(name).bytes != t.bytes) {
        ADD_FAILURE() << cs.what << ": " << name << " of the reference layer changed";
        unchanged = false;
      }
    }
    if (!unchanged) ASSERT_TRUE(c.ImportWeights("ref", *before).ok());
    auto layers = c.ListLayers();
    ASSERT_TRUE(layers.ok()) << layers.status();
    for (const v1::LayerInfo& info : *layers) {
      if (info.name() == "ref") continue;
      ADD_FAILURE() << cs.what << ": layer \"" << info.name() << "\" appeared";
      ASSERT_TRUE(c.DeleteLayer(info.name()).ok());
    }
  }
  // Nothing outside the directory, nothing new or changed inside it.
  struct stat s;
  EXPECT_NE(::stat((outside + "/x.safetensors").c_str(), &s), 0);
  EXPECT_EQ(::lstat((dir + "/adir/x").c_str(), &s), -1);
  std::set<std::string> dir_after;
  for (const char* n : {"good.safetensors", "other.safetensors"}) {
    dir_after.insert(ReadRaw(dir + "/" + n));
  }
  EXPECT_EQ(dir_after, dir_before);

  // The good checkpoint still loads, whole.
  ASSERT_TRUE(c.LoadCheckpoint("ref", "good.safetensors").ok());
  auto loaded = c.ExportWeights("ref", true);
  ASSERT_TRUE(loaded.ok());
  for (const auto& [name, t] : good->state) EXPECT_EQ(loaded->at(name).bytes, t.bytes) << name;

  // Should a reader have blocked on the FIFO, release it so the server can shut down.
  const int fd = ::open((dir + "/fifo").c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
}

TEST(HostileCheckpointTest, StartRemovesDebrisOfInterruptedSavesAndKeepsCheckpoints) {
  const std::string dir = TempDir("debris");
  std::map<std::string, Tensor> saved;
  {
    Loopback lb = Start(Options(dir));
    ASSERT_TRUE(lb.conn);
    ASSERT_TRUE(lb.conn->CreateLayer("ref", RefConfig()).ok());
    std::mt19937 rng(4);
    TrainOnce(*lb.conn, "ref", rng);
    ASSERT_TRUE(lb.conn->SaveCheckpoint("ref", "run1/ref.safetensors").ok());
    auto w = lb.conn->ExportWeights("ref", true);
    ASSERT_TRUE(w.ok());
    saved = *w;
  }
  // What a server killed during Save leaves: a partial file named <path>.tmp.<pid>.<random>,
  // here of writers that no longer exist (pids beyond any pid_max).
  const std::string partial = ReadRaw(dir + "/run1/ref.safetensors").substr(0, 100);
  WriteRaw(dir + "/run1/ref.safetensors.tmp.999999991.1234", partial);
  WriteRaw(dir + "/other.safetensors.tmp.999999992.99", partial);
  Loopback lb = Start(Options(dir));
  ASSERT_TRUE(lb.conn);
  EXPECT_EQ(lb.server->checkpoint_debris().removed, 2);
  EXPECT_EQ(lb.server->checkpoint_debris().removed_bytes, 200);
  struct stat s;
  EXPECT_NE(::lstat((dir + "/run1/ref.safetensors.tmp.999999991.1234").c_str(), &s), 0);
  EXPECT_NE(::lstat((dir + "/other.safetensors.tmp.999999992.99").c_str(), &s), 0);
  ASSERT_TRUE(lb.conn->LoadCheckpoint("ref", "run1/ref.safetensors").ok());
  auto w = lb.conn->ExportWeights("ref", true);
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->size(), saved.size());
  for (const auto& [name, t] : saved) EXPECT_EQ(w->at(name).bytes, t.bytes) << name;
}

TEST(HostileCheckpointTest, AnUnusableCheckpointDirectoryIsAStartError) {
  server::ServerOptions o = Options(TempDir("root") + "/absent");
  auto s = server::Server::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_NE(s.status().message().find("checkpoint_dir"), std::string::npos) << s.status();
  o = Options(TempDir("root2"));
  o.max_checkpoint_bytes = 0;
  EXPECT_EQ(server::Server::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::server_test
