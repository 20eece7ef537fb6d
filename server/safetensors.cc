// safetensors serialisation (see safetensors.h). The header is parsed by nlohmann-json with a
// callback that bounds nesting and the number of values, so a hostile header costs at most a
// bounded amount of memory and time; every exception the library can throw becomes DataLoss.
#include "server/safetensors.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::server {
namespace {

using Json = nlohmann::json;

// A header nests at most three levels (the root object, a tensor entry or __metadata__, a shape
// or data_offsets array); one more is allowed, deeper is refused before it is built.
constexpr int kMaxHeaderDepth = 4;
// A tensor entry is about ten values; four million is far beyond any real checkpoint and keeps
// the parsed header within a few hundred MB even for a 100 MB header of tiny values.
constexpr int64_t kMaxHeaderValues = int64_t{1} << 22;
constexpr size_t kMaxShownNameChars = 64;

// Thrown by the parse callback when a bound is passed; caught in ParseHeader.
struct HeaderTooComplex : std::exception {
  explicit HeaderTooComplex(const char* what) : what_(what) {}
  const char* what() const noexcept override { return what_; }
  const char* what_;
};

absl::Status Bad(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("safetensors: ", what));
}

// A name from the file for an error message: escaped (no control or non-ASCII bytes reach the
// client's terminal) and shortened.
std::string Shown(const std::string& name) {
  const bool cut = name.size() > kMaxShownNameChars;
  return absl::StrCat("\"", absl::CHexEscape(cut ? name.substr(0, kMaxShownNameChars) : name),
                      cut ? "...\"" : "\"");
}

const char* SafeDType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kInt32:
      return "I32";
    case DType::kInt64:
      return "I64";
  }
  return "?";
}

bool DTypeFromSafe(const std::string& s, DType* d) {
  if (s == "F32")
    *d = DType::kFloat32;
  else if (s == "BF16")
    *d = DType::kBFloat16;
  else if (s == "I32")
    *d = DType::kInt32;
  else if (s == "I64")
    *d = DType::kInt64;
  else
    return false;
  return true;
}

// A dtype name worth quoting back: short and made of the characters the format's names use.
bool LooksLikeDTypeName(const std::string& s) {
  if (s.empty() || s.size() > 8) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

absl::StatusOr<Json> ParseHeader(const char* begin, const char* end) {
  int64_t values = 0;
  const Json::parser_callback_t bound = [&values](int depth, Json::parse_event_t event, Json&) {
    if (event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) {
      if (depth >= kMaxHeaderDepth) throw HeaderTooComplex("header nests deeper than the format");
    }
    if (event == Json::parse_event_t::value || event == Json::parse_event_t::object_start ||
        event == Json::parse_event_t::array_start) {
      if (++values > kMaxHeaderValues) throw HeaderTooComplex("header holds too many values");
    }
    return true;
  };
  try {
    return Json::parse(begin, end, bound, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const Json::parse_error& e) {
    // e.what() quotes the bytes last read: only the position is reported.
    return Bad(absl::StrCat("header is not valid JSON (error near byte ", e.byte, ")"));
  } catch (const HeaderTooComplex& e) {
    return Bad(e.what());
  } catch (const Json::exception& e) {
    return Bad(absl::StrCat("header is not valid JSON (error ", e.id, ")"));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("safetensors: header too large for memory");
  } catch (const std::exception&) {
    return Bad("header is not valid JSON");
  }
}

// A non-negative integer that fits int64, or false.
bool Extent(const Json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  const uint64_t x = v.get<uint64_t>();
  if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = x;
  return true;
}

struct Entry {
  std::string name;
  Tensor tensor;  // dtype and shape; bytes filled once every entry is valid
  uint64_t begin = 0;
  uint64_t end = 0;
};

absl::StatusOr<Entry> ParseEntry(const std::string& name, const Json& v, uint64_t data_size) {
  auto bad = [&](absl::string_view what) {
    return Bad(absl::StrCat("tensor ", Shown(name), ": ", what));
  };
  if (!v.is_object()) return bad("entry is not an object");
  const auto dtype = v.find("dtype");
  const auto shape = v.find("shape");
  const auto offsets = v.find("data_offsets");
  if (dtype == v.end() || !dtype->is_string()) return bad("missing dtype");
  if (shape == v.end() || !shape->is_array()) return bad("missing shape");
  if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2) {
    return bad("missing data_offsets");
  }
  Entry e;
  e.name = name;
  const std::string& dtype_name = dtype->get_ref<const std::string&>();
  if (!DTypeFromSafe(dtype_name, &e.tensor.dtype)) {
    return bad(LooksLikeDTypeName(dtype_name) ? absl::StrCat("unsupported dtype ", dtype_name)
                                              : std::string("unsupported dtype"));
  }
  uint64_t elements = 1;
  for (const Json& s : *shape) {
    uint64_t extent = 0;
    if (!Extent(s, &extent)) return bad("shape extents must be integers in [0, 2^63)");
    if (__builtin_mul_overflow(elements, extent, &elements)) {
      return bad("shape's element count overflows");
    }
    e.tensor.shape.push_back(static_cast<int64_t>(extent));
  }
  uint64_t size = 0;
  if (__builtin_mul_overflow(elements, DTypeSize(e.tensor.dtype), &size) || size > data_size) {
    return bad(absl::StrCat("shape needs more bytes than the file's ", data_size,
                            " bytes of tensor data"));
  }
  if (!Extent((*offsets)[0], &e.begin) || !Extent((*offsets)[1], &e.end) || e.begin > e.end ||
      e.end > data_size) {
    return bad(absl::StrCat("data_offsets out of range (tensor data is ", data_size, " bytes)"));
  }
  if (e.end - e.begin != size) {
    return bad(absl::StrCat("data_offsets span ", e.end - e.begin, " bytes, shape needs ", size));
  }
  return e;
}

}  // namespace

absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file) {
  // ordered_json keeps the insertion order: __metadata__ first, then tensors in name order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) {
    nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
    for (const auto& [k, v] : file.metadata) metadata[k] = v;
    header["__metadata__"] = std::move(metadata);
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (name == "__metadata__") {
      return absl::InvalidArgumentError("safetensors: a tensor may not be named __metadata__");
    }
    const uint64_t want = static_cast<uint64_t>(t.num_elements()) * DTypeSize(t.dtype);
    if (t.bytes.size() != want) {
      return absl::InternalError(absl::StrCat("safetensors: tensor ", Shown(name), " has ",
                                              t.bytes.size(), " bytes, shape needs ", want));
    }
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = SafeDType(t.dtype);
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + want};
    header[name] = std::move(entry);
    offset += want;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception&) {
    return absl::InvalidArgumentError(
        "safetensors: a tensor name or metadata string is not valid UTF-8");
  }
  while (text.size() % 8 != 0) text.push_back(' ');
  std::string out;
  out.reserve(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  out += text;
  for (const auto& [name, t] : file.tensors) {
    out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  return out;
}

absl::StatusOr<uint64_t> SafetensorsHeaderLength(const std::string& prefix, uint64_t file_size) {
  if (prefix.size() < 8 || file_size < 8) return Bad("file shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  }
  // The length itself is not quoted: for a file that is not safetensors it is the file's first
  // eight bytes.
  if (n > kMaxSafetensorsHeaderBytes) {
    return Bad(absl::StrCat("header length exceeds the format's bound of ",
                            kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (n > file_size - 8) {
    return Bad(absl::StrCat("header length exceeds the file (", file_size, " bytes)"));
  }
  return n;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes) {
  MOE_ASSIGN_OR_RETURN(const uint64_t n, SafetensorsHeaderLength(bytes, bytes.size()));
  const char* header_begin = bytes.data() + 8;
  MOE_ASSIGN_OR_RETURN(const Json json, ParseHeader(header_begin, header_begin + n));
  if (!json.is_object()) return Bad("header is not an object");
  const uint64_t data_size = bytes.size() - 8 - n;
  const char* data = header_begin + n;

  SafetensorsFile file;
  std::vector<Entry> entries;
  for (auto it = json.begin(); it != json.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Bad(absl::StrCat("metadata ", Shown(m.key()), " is not a string"));
        }
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    MOE_ASSIGN_OR_RETURN(Entry entry, ParseEntry(name, v, data_size));
    entries.push_back(std::move(entry));
  }
  // As the reference reader: in offset order the tensors tile the data exactly.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::make_pair(a.begin, a.end) < std::make_pair(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const Entry& e : entries) {
    if (e.begin < covered) {
      return Bad(absl::StrCat("tensor ", Shown(e.name), " overlaps the tensor before it"));
    }
    if (e.begin > covered) {
      return Bad(absl::StrCat("tensor ", Shown(e.name), " leaves a gap of ", e.begin - covered,
                              " bytes before it"));
    }
    covered = e.end;
  }
  if (covered != data_size) {
    return Bad(absl::StrCat(data_size - covered, " bytes after the last tensor"));
  }
  for (Entry& e : entries) {
    const uint64_t size = e.end - e.begin;
    e.tensor.bytes.resize(size);
    if (size) std::memcpy(e.tensor.bytes.data(), data + e.begin, size);
    file.tensors[e.name] = std::move(e.tensor);
  }
  return file;
}

}  // namespace moe::server
