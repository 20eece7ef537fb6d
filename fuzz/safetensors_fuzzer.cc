// libFuzzer target for the checkpoint reader: ParseSafetensors and DecodeCheckpoint on any bytes,
// which is what LoadCheckpoint hands them from a file, then the whole-state check on whatever
// decodes. Beyond "no crash, no sanitizer report" it checks two properties and aborts on a
// breach: a failed parse is DATA_LOSS (RESOURCE_EXHAUSTED only when memory runs out), and a file
// that parses serialises and parses back to the same tensors and metadata.
//
// Seeds in fuzz/corpus/safetensors: checkpoints and plain files made by the writer, and
// malformed headers; tests/server/safetensors_corpus_test.cc replays them with g++ builds.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/checkpoint.h"
#include "server/safetensors.h"

namespace {

bool SameFile(const moe::server::SafetensorsFile& a, const moe::server::SafetensorsFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, t] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) return false;
    const moe::Tensor& u = it->second;
    if (u.dtype != t.dtype || u.shape != t.shape || u.bytes != t.bytes) return false;
  }
  return true;
}

bool ExpectedFailure(const absl::Status& s) {
  return s.code() == absl::StatusCode::kDataLoss ||
         s.code() == absl::StatusCode::kResourceExhausted;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto file = moe::server::ParseSafetensors(bytes);
  if (file.ok()) {
    auto again = moe::server::SerializeSafetensors(*file);
    if (!again.ok()) std::abort();
    auto back = moe::server::ParseSafetensors(*again);
    if (!back.ok() || !SameFile(*file, *back)) std::abort();
  } else if (!ExpectedFailure(file.status())) {
    std::abort();
  }
  auto decoded = moe::server::DecodeCheckpoint(bytes);
  if (decoded.ok()) {
    const absl::Status whole = moe::server::CheckCheckpointState(decoded->config, decoded->state);
    if (!whole.ok() && whole.code() != absl::StatusCode::kDataLoss) std::abort();
  } else if (!ExpectedFailure(decoded.status())) {
    std::abort();
  }
  return 0;
}
