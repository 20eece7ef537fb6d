// SaveCheckpoint and LoadCheckpoint through a real moe-server on loopback: a trained layer's
// checkpoint loads bit for bit into a new layer and over an existing one, and the real Python
// safetensors package reads the same values (tests/server/read_safetensors.py).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "engine/layer.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

using client::Connection;
using client::RemoteLayer;

TEST(ServiceTest, CheckpointRoundTripIsExactAndPythonReadsIt) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  auto layer = RemoteLayer::Create(lb.conn, "ck", config);
  ASSERT_TRUE(layer.ok());
  std::mt19937 rng(12);
  for (int s = 0; s < 2; ++s) {  // optimizer state and step are non-trivial
    Tensor x = RandomFloat(rng, {12, config.d_model});
    auto f = (*layer)->Forward(x.view()).get();
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*layer)->Backward(f->context_id, x.view()).get().ok());
    ASSERT_TRUE((*layer)->Step().ok());
  }
  auto saved = (*layer)->SaveCheckpoint("run/ck.safetensors");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step(), 2);
  auto original = (*layer)->ExportWeights(true);
  ASSERT_TRUE(original.ok());

  // Into a new layer created from the checkpoint, and into an existing differently-seeded one.
  auto loaded = c.LoadCheckpoint("ck2", "run/ck.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step(), 2);
  LayerConfig other = config;
  other.seed = 99;
  ASSERT_TRUE(c.CreateLayer("ck3", other).ok());
  ASSERT_TRUE(c.LoadCheckpoint("ck3", "run/ck.safetensors").ok());
  for (const char* name : {"ck2", "ck3"}) {
    auto state = c.ExportWeights(name, true);
    ASSERT_TRUE(state.ok());
    ASSERT_EQ(state->size(), original->size()) << name;
    for (const auto& [n, t] : *original) {
      EXPECT_EQ(state->at(n).bytes, t.bytes) << name << " " << n;
    }
  }
  Tensor x = RandomFloat(rng, {9, config.d_model});
  auto a = c.Forward("ck", 0, false, x.view(), {}, {}).get();
  auto b = c.Forward("ck3", 0, false, x.view(), {}, {}).get();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->out.bytes, b->out.bytes);
  EXPECT_EQ(c.LoadCheckpoint("ck4", "run/missing.safetensors").status().code(),
            absl::StatusCode::kNotFound);

  // The real Python safetensors package reads the same values.
  const std::string expected = TempDir("expected");
  std::ofstream manifest(expected + "/manifest.json");
  manifest << "{";
  bool first = true;
  for (const auto& [n, t] : *original) {
    std::ofstream(expected + "/" + n + ".bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    manifest << (first ? "" : ",") << "\"" << n << "\": [\"" << DTypeName(t.dtype) << "\", [";
    for (size_t i = 0; i < t.shape.size(); ++i) manifest << (i ? "," : "") << t.shape[i];
    manifest << "]]";
    first = false;
  }
  manifest << "}";
  manifest.close();
  const std::string cmd =
      absl::StrCat("python3 ", MOE_READ_SAFETENSORS_PY, " ", saved->path(), " ", expected, " 2>&1");
  auto run = [&](std::string* out) {
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[512];
    while (p && std::fgets(buf, sizeof(buf), p)) *out += buf;
    int rc = p ? ::pclose(p) : -1;
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  };
  std::string out;
  int rc = run(&out);
  if (rc == 77) {  // not installed: try PyPI once, as scripts/install-deps would
    std::system(
        "python3 -m pip install -q safetensors numpy >/dev/null 2>&1 || "
        "python3 -m pip install -q --break-system-packages safetensors numpy >/dev/null 2>&1");
    out.clear();
    rc = run(&out);
  }
  if (rc == 77) GTEST_SKIP() << "Python safetensors could not be installed: " << out;
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok:"), std::string::npos) << out;
}

}  // namespace
}  // namespace moe::server_test
