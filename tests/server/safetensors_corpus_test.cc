// Replays the safetensors fuzzer's seed corpus (fuzz/corpus/safetensors) with an ordinary build:
// every file goes through the fuzz target itself (LLVMFuzzerTestOneInput, which aborts on a
// broken property), and each file's name says what the reader must make of it: "ckpt-*" decodes
// to a whole checkpoint, "valid-*" parses, anything else (the malformed seeds, and inputs a
// fuzzer once crashed on, kept as regressions) is DATA_LOSS from the parser or the checkpoint
// checks.
#include <dirent.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "server/checkpoint.h"
#include "server/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace moe::server {
namespace {

std::vector<std::string> CorpusFiles() {
  std::vector<std::string> out;
  DIR* d = ::opendir(MOE_SAFETENSORS_CORPUS_DIR);
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

std::string Read(const std::string& name) {
  std::ifstream in(std::string(MOE_SAFETENSORS_CORPUS_DIR) + "/" + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool StartsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

TEST(SafetensorsCorpusTest, EverySeedGetsTheAnswerItsNameSays) {
  const std::vector<std::string> files = CorpusFiles();
  ASSERT_GE(files.size(), 10u) << "corpus missing at " << MOE_SAFETENSORS_CORPUS_DIR;
  int checkpoints = 0, valid = 0, bad = 0;
  for (const std::string& name : files) {
    const std::string bytes = Read(name);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    auto parsed = ParseSafetensors(bytes);
    auto decoded = DecodeCheckpoint(bytes);
    absl::Status whole = decoded.status();
    if (decoded.ok()) whole = CheckCheckpointState(decoded->config, decoded->state);
    if (StartsWith(name, "ckpt-")) {
      ++checkpoints;
      EXPECT_TRUE(whole.ok()) << name << ": " << whole;
    } else if (StartsWith(name, "valid-")) {
      ++valid;
      EXPECT_TRUE(parsed.ok()) << name << ": " << parsed.status();
    } else {
      ++bad;
      const absl::Status st = parsed.ok() ? whole : parsed.status();
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << name << ": " << st;
    }
  }
  EXPECT_GT(checkpoints, 0);
  EXPECT_GT(valid, 0);
  EXPECT_GT(bad, 0);
}

}  // namespace
}  // namespace moe::server
