// A small reader and writer for the safetensors format
// (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of
// JSON header, then the raw tensor bytes. The header maps each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end]} (offsets relative to the byte after the header) and may hold
// "__metadata__", a string -> string map.
//
// Our own code rather than a dependency: the format is tiny and the server needs only the four
// dtypes the engine has (F32, BF16, I32, I64). Tensors are laid out in name order, contiguous,
// and the header is padded with spaces to a multiple of 8 bytes, as the reference writer does,
// so the Python `safetensors` package reads our files (tests/server check that).
#ifndef MOE_SERVER_SAFETENSORS_H_
#define MOE_SERVER_SAFETENSORS_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tensor.h"

namespace moe::server {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// The whole file's bytes.
absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file);
// DataLoss naming the problem for anything malformed (bad header, offsets out of range or
// overlapping, unknown dtype, byte count not matching the shape).
absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes);

}  // namespace moe::server

#endif  // MOE_SERVER_SAFETENSORS_H_
