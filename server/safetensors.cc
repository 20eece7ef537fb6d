// safetensors serialisation (see safetensors.h) with a minimal JSON parser for the header: it
// accepts full JSON (objects, arrays, strings with escapes, numbers, literals) but keeps only
// what a safetensors header can hold.
#include "server/safetensors.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::server {
namespace {

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

void AppendJsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

// --- JSON ---------------------------------------------------------------------------------
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  double number = 0;
  int64_t integer = 0;
  bool is_integer = false;
  std::string str;
  std::vector<Json> array;
  std::vector<std::pair<std::string, Json>> object;
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}
  absl::StatusOr<Json> ParseDocument() {
    Json v;
    absl::Status st = Parse(&v, 0);
    if (!st.ok()) return st;
    SkipSpace();
    if (pos_ != s_.size()) return Error("trailing characters");
    return v;
  }

 private:
  absl::Status Error(const std::string& what) {
    return absl::DataLossError(absl::StrCat("safetensors header: ", what, " at byte ", pos_));
  }
  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\t' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  absl::Status Parse(Json* v, int depth) {
    if (depth > 16) return Error("nested too deeply");
    SkipSpace();
    if (pos_ >= s_.size()) return Error("unexpected end");
    char c = s_[pos_];
    if (c == '{') {
      v->kind = Json::kObject;
      ++pos_;
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        return absl::OkStatus();
      }
      for (;;) {
        SkipSpace();
        std::string key;
        absl::Status st = ParseString(&key);
        if (!st.ok()) return st;
        SkipSpace();
        if (pos_ >= s_.size() || s_[pos_] != ':') return Error("expected ':'");
        ++pos_;
        Json child;
        st = Parse(&child, depth + 1);
        if (!st.ok()) return st;
        v->object.emplace_back(std::move(key), std::move(child));
        SkipSpace();
        if (pos_ < s_.size() && s_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < s_.size() && s_[pos_] == '}') {
          ++pos_;
          return absl::OkStatus();
        }
        return Error("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v->kind = Json::kArray;
      ++pos_;
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        return absl::OkStatus();
      }
      for (;;) {
        Json child;
        absl::Status st = Parse(&child, depth + 1);
        if (!st.ok()) return st;
        v->array.push_back(std::move(child));
        SkipSpace();
        if (pos_ < s_.size() && s_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < s_.size() && s_[pos_] == ']') {
          ++pos_;
          return absl::OkStatus();
        }
        return Error("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v->kind = Json::kString;
      return ParseString(&v->str);
    }
    if (s_.compare(pos_, 4, "true") == 0) {
      v->kind = Json::kBool;
      pos_ += 4;
      return absl::OkStatus();
    }
    if (s_.compare(pos_, 5, "false") == 0) {
      v->kind = Json::kBool;
      pos_ += 5;
      return absl::OkStatus();
    }
    if (s_.compare(pos_, 4, "null") == 0) {
      v->kind = Json::kNull;
      pos_ += 4;
      return absl::OkStatus();
    }
    // Number.
    size_t start = pos_;
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    while (pos_ < s_.size() && std::strchr("0123456789.eE+-", s_[pos_]) != nullptr) {
      if (!std::isdigit(static_cast<unsigned char>(s_[pos_]))) integral = false;
      ++pos_;
    }
    if (pos_ == start) return Error("unexpected character");
    std::string text = s_.substr(start, pos_ - start);
    v->kind = Json::kNumber;
    v->number = std::strtod(text.c_str(), nullptr);
    if (integral) {
      v->is_integer = true;
      v->integer = std::strtoll(text.c_str(), nullptr, 10);
    }
    return absl::OkStatus();
  }
  absl::Status ParseString(std::string* out) {
    if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a string");
    ++pos_;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return Error("bad escape");
      char e = s_[pos_++];
      switch (e) {
        case '"':
          out->push_back('"');
          break;
        case '\\':
          out->push_back('\\');
          break;
        case '/':
          out->push_back('/');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          if (pos_ + 4 > s_.size()) return Error("bad \\u escape");
          unsigned cp = std::stoul(s_.substr(pos_, 4), nullptr, 16);
          pos_ += 4;
          // UTF-8 encode (no surrogate pairs: our writer never emits them).
          if (cp < 0x80) {
            out->push_back(static_cast<char>(cp));
          } else if (cp < 0x800) {
            out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
            out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
          } else {
            out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
            out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
            out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
          }
          break;
        }
        default:
          return Error("bad escape");
      }
    }
    if (pos_ >= s_.size()) return Error("unterminated string");
    ++pos_;
    return absl::OkStatus();
  }

  const std::string& s_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file) {
  std::string header = "{";
  bool first = true;
  if (!file.metadata.empty()) {
    header += "\"__metadata__\":{";
    bool mfirst = true;
    for (const auto& [k, v] : file.metadata) {
      if (!mfirst) header += ",";
      mfirst = false;
      AppendJsonString(k, &header);
      header += ":";
      AppendJsonString(v, &header);
    }
    header += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (name == "__metadata__") {
      return absl::InvalidArgumentError("safetensors: a tensor may not be named __metadata__");
    }
    const uint64_t want = static_cast<uint64_t>(t.num_elements()) * DTypeSize(t.dtype);
    if (t.bytes.size() != want) {
      return absl::InternalError(absl::StrCat("safetensors: tensor ", name, " has ", t.bytes.size(),
                                              " bytes, shape needs ", want));
    }
    if (!first) header += ",";
    first = false;
    AppendJsonString(name, &header);
    absl::StrAppend(&header, ":{\"dtype\":\"", SafeDType(t.dtype), "\",\"shape\":[");
    for (size_t i = 0; i < t.shape.size(); ++i) absl::StrAppend(&header, i ? "," : "", t.shape[i]);
    absl::StrAppend(&header, "],\"data_offsets\":[", offset, ",", offset + want, "]}");
    offset += want;
  }
  header += "}";
  while (header.size() % 8 != 0) header.push_back(' ');
  std::string out;
  out.reserve(8 + header.size() + offset);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  out += header;
  for (const auto& [name, t] : file.tensors) {
    out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  return out;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes) {
  if (bytes.size() < 8) return absl::DataLossError("safetensors: file shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > bytes.size() - 8) {
    return absl::DataLossError(absl::StrCat("safetensors: header length ", n, " exceeds the file (",
                                            bytes.size(), " bytes)"));
  }
  std::string header = bytes.substr(8, n);
  auto json = JsonParser(header).ParseDocument();
  if (!json.ok()) return json.status();
  if (json->kind != Json::kObject)
    return absl::DataLossError("safetensors: header is not an object");
  const uint64_t data_size = bytes.size() - 8 - n;
  const char* data = bytes.data() + 8 + n;
  SafetensorsFile file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, v] : json->object) {
    if (name == "__metadata__") {
      if (v.kind != Json::kObject)
        return absl::DataLossError("safetensors: __metadata__ is not an object");
      for (const auto& [k, mv] : v.object) {
        if (mv.kind != Json::kString) {
          return absl::DataLossError(absl::StrCat("safetensors: metadata ", k, " is not a string"));
        }
        file.metadata[k] = mv.str;
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return absl::DataLossError(absl::StrCat("safetensors: tensor ", name, ": ", what));
    };
    if (v.kind != Json::kObject) return bad("entry is not an object");
    const Json* dtype = nullptr;
    const Json* shape = nullptr;
    const Json* offsets = nullptr;
    for (const auto& [k, f] : v.object) {
      if (k == "dtype")
        dtype = &f;
      else if (k == "shape")
        shape = &f;
      else if (k == "data_offsets")
        offsets = &f;
    }
    if (!dtype || dtype->kind != Json::kString) return bad("missing dtype");
    if (!shape || shape->kind != Json::kArray) return bad("missing shape");
    if (!offsets || offsets->kind != Json::kArray || offsets->array.size() != 2) {
      return bad("missing data_offsets");
    }
    Tensor t;
    if (!DTypeFromSafe(dtype->str, &t.dtype))
      return bad(absl::StrCat("unsupported dtype ", dtype->str));
    for (const Json& s : shape->array) {
      if (!s.is_integer || s.integer < 0) return bad("bad shape");
      t.shape.push_back(s.integer);
    }
    const Json& b = offsets->array[0];
    const Json& e = offsets->array[1];
    if (!b.is_integer || !e.is_integer || b.integer < 0 || e.integer < b.integer ||
        static_cast<uint64_t>(e.integer) > data_size) {
      return bad("data_offsets out of range");
    }
    const uint64_t size = e.integer - b.integer;
    if (size != static_cast<uint64_t>(t.num_elements()) * DTypeSize(t.dtype)) {
      return bad("byte count does not match shape");
    }
    ranges.emplace_back(b.integer, e.integer);
    t.bytes.resize(size);
    if (size) std::memcpy(t.bytes.data(), data + b.integer, size);
    file.tensors[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second)
      return absl::DataLossError("safetensors: overlapping tensors");
  }
  return file;
}

}  // namespace moe::server
