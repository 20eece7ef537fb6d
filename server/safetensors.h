// A reader and writer for the safetensors format
// (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of
// JSON header, then the raw tensor bytes. The header maps each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end]} (offsets relative to the byte after the header) and may hold
// "__metadata__", a string -> string map.
//
// The header is JSON from a file anyone may have written, so it goes through nlohmann-json, a
// maintained parser, with a bound on its size, nesting and number of values; the checks after it
// are those of the reference implementation (the Rust crate's `validate`): tensors cover the data
// exactly, contiguous, without gaps, overlaps or trailing bytes. Only the four dtypes the engine
// has are accepted (F32, BF16, I32, I64). The writer lays tensors out in name order, contiguous,
// and pads the header with spaces to a multiple of 8 bytes, as the reference writer does, so the
// Python `safetensors` package reads our files (tests/server check that).
#ifndef MOE_SERVER_SAFETENSORS_H_
#define MOE_SERVER_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace moe::server {

// The reference implementation's bound on the JSON header (MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// The whole file's bytes. InvalidArgument for a tensor named "__metadata__" or a name or
// metadata string that is not valid UTF-8; Internal for a tensor whose bytes do not match its
// shape.
absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file);

// The header length in the first 8 bytes of `prefix`, checked against the bound above and the
// file's size: DataLoss otherwise. For readers that want to refuse a file before reading it all.
absl::StatusOr<uint64_t> SafetensorsHeaderLength(const std::string& prefix, uint64_t file_size);

// DataLoss naming the problem for anything malformed: a header that is not JSON or not of the
// format's shape, an unknown dtype, a shape whose element count overflows, data_offsets out of
// range, unsorted, overlapping or leaving gaps, a byte count not matching the shape. Messages
// never quote the file's bytes beyond a tensor's (escaped, shortened) name.
absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes);

}  // namespace moe::server

#endif  // MOE_SERVER_SAFETENSORS_H_
