// The safetensors reader and writer: exact round trip, the byte layout the format prescribes,
// and a table of malformed files (bad JSON, hostile escapes, nesting, overflowing shapes,
// offsets out of range, overlapping, leaving gaps or trailing bytes) each rejected with DataLoss
// and a message naming the problem without quoting the file's bytes.
#include "server/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::server {
namespace {

Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  std::mt19937 rng(seed);
  for (auto& b : t.bytes) b = static_cast<std::byte>(rng() & 0xFF);
  return t;
}

// A file from a header (taken as is) and `data_bytes` bytes of tensor data.
std::string File(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + std::string(data_bytes, '\x5a');
}

TEST(SafetensorsTest, RoundTripIsExact) {
  SafetensorsFile f;
  f.tensors["w1"] = RandomTensor(DType::kFloat32, {3, 5, 7}, 1);
  f.tensors["w2"] = RandomTensor(DType::kBFloat16, {2, 9}, 2);
  f.tensors["ids"] = RandomTensor(DType::kInt32, {4}, 3);
  f.tensors["step"] = RandomTensor(DType::kInt64, {1}, 4);
  f.tensors["empty"] = Tensor::Zeros(DType::kFloat32, {0, 3});
  f.metadata["k"] = "value with \"quotes\" and \\ and\nnewline and \x01 and \xc3\xa9";
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

TEST(SafetensorsTest, EmptyFileRoundTrips) {
  auto bytes = SerializeSafetensors({});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = ParseSafetensors(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->tensors.empty());
  EXPECT_TRUE(back->metadata.empty());
}

TEST(SafetensorsTest, WriterRefusesWhatNoReaderCouldRead) {
  SafetensorsFile meta_name;
  meta_name.tensors["__metadata__"] = RandomTensor(DType::kFloat32, {1}, 1);
  EXPECT_EQ(SerializeSafetensors(meta_name).status().code(), absl::StatusCode::kInvalidArgument);
  SafetensorsFile bad_utf8;
  bad_utf8.tensors["w\xff"] = RandomTensor(DType::kFloat32, {1}, 1);
  auto st = SerializeSafetensors(bad_utf8).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("UTF-8"), std::string::npos) << st;
}

TEST(SafetensorsTest, MalformedFilesAreDataLossNamingTheProblem) {
  const std::string t16 = R"("dtype":"F32","shape":[4],"data_offsets")";
  struct Case {
    const char* what;
    std::string bytes;
    const char* message;  // a substring of the status message
  };
  std::string past_file = File("{}", 0);
  past_file[1] = '\x03';  // 770 bytes of header in a 10-byte file
  std::string above_bound = File("{}", 0);
  const uint64_t past = kMaxSafetensorsHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) above_bound[i] = static_cast<char>((past >> (8 * i)) & 0xFF);
  std::string many_values = R"({"w":{"dtype":"F32","shape":[)";
  for (int i = 0; i < (1 << 22) + 8; ++i) many_values += i ? ",1" : "1";
  many_values += R"(],"data_offsets":[0,4]}})";
  const std::vector<Case> cases = {
      {"shorter than the length field", "abc", "shorter than 8 bytes"},
      {"header length past the file", past_file, "exceeds the file"},
      {"header length past the format's bound", above_bound, "bound"},
      {"\\uZZZZ escape", File(R"({"\uZZZZ":{)" + t16 + ":[0,16]}}", 16), "not valid JSON"},
      {"\\u escape cut short", File(R"({"a\u12)", 0), "not valid JSON"},
      {"unterminated object", File(R"({"w":{)", 0), "not valid JSON"},
      {"invalid UTF-8", File("{\"w\xff\":1}", 0), "not valid JSON"},
      {"number beyond double", File(R"({"w":1e400})", 0), "not valid JSON"},
      {"trailing garbage", File("{} x", 0), "not valid JSON"},
      {"nested too deeply", File(R"({"a":{"b":{"c":{"d":{}}}}})", 0), "nests deeper"},
      {"too many values", File(many_values, 4), "too many values"},
      {"header not an object", File("[1,2]", 0), "not an object"},
      {"entry not an object", File(R"({"w":5})", 0), "entry is not an object"},
      {"metadata not an object", File(R"({"__metadata__":[]})", 0), "__metadata__"},
      {"metadata value not a string", File(R"({"__metadata__":{"k":1}})", 0), "not a string"},
      {"no dtype", File(R"({"w":{"shape":[4],"data_offsets":[0,16]}})", 16), "missing dtype"},
      {"no shape", File(R"({"w":{"dtype":"F32","data_offsets":[0,16]}})", 16), "missing shape"},
      {"no offsets", File(R"({"w":{"dtype":"F32","shape":[4]}})", 16), "missing data_offsets"},
      {"three offsets", File(R"({"w":{)" + t16 + ":[0,8,16]}}", 16), "missing data_offsets"},
      {"unknown dtype", File(R"({"w":{"dtype":"F99","shape":[4],"data_offsets":[0,16]}})", 16),
       "unsupported dtype F99"},
      {"dtype not worth quoting",
       File(R"({"w":{"dtype":"\u0001\u0002","shape":[1],"data_offsets":[0,4]}})", 4),
       "unsupported dtype"},
      {"negative extent", File(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       "shape extents"},
      {"fractional extent", File(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4),
       "shape extents"},
      {"extent beyond int64",
       File(R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,4]}})", 4),
       "shape extents"},
      {"element count overflows",
       File(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}})", 4),
       "overflows"},
      {"byte count overflows",
       File(R"({"w":{"dtype":"I64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
       "more bytes than"},
      {"offsets past the data", File(R"({"w":{)" + t16 + ":[0,1000]}}", 16), "out of range"},
      {"offsets reversed", File(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
       "out of range"},
      {"negative offset", File(R"({"w":{)" + t16 + ":[-16,0]}}", 16), "out of range"},
      {"span not the shape's",
       File(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", 16), "span 8 bytes"},
      {"overlapping tensors", File(R"({"a":{)" + t16 + R"(:[0,16]},"b":{)" + t16 + ":[8,24]}}", 24),
       "overlaps"},
      {"gap between tensors",
       File(R"({"a":{)" + t16 + R"(:[0,16]},"b":{)" + t16 + ":[24,40]}}", 40), "gap of 8 bytes"},
      {"duplicate name (the last one wins, leaving a gap)",
       File(R"({"a":{)" + t16 + R"(:[0,16]},"a":{)" + t16 + ":[16,32]}}", 32), "gap"},
      {"bytes after the last tensor", File(R"({"w":{)" + t16 + ":[0,16]}}", 20),
       "4 bytes after the last tensor"},
      {"data with no tensors", File("{}", 3), "3 bytes after the last tensor"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SafetensorsFile> parsed;
    ASSERT_NO_THROW(parsed = ParseSafetensors(c.bytes)) << c.what;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss)
        << c.what << ": " << parsed.status();
    EXPECT_NE(parsed.status().message().find(c.message), std::string::npos)
        << c.what << ": " << parsed.status();
  }
}

TEST(SafetensorsTest, ErrorsDoNotQuoteTheFile) {
  // A text file (the first bytes of /etc/passwd, say): its first eight bytes read as a length.
  const std::string passwd = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin\n";
  auto st = ParseSafetensors(passwd).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message().find("root"), std::string::npos) << st;
  uint64_t as_length = 0;
  std::memcpy(&as_length, passwd.data(), 8);
  EXPECT_EQ(st.message().find(std::to_string(as_length)), std::string::npos) << st;
  // A JSON syntax error reports a position, not the bytes around it.
  st = ParseSafetensors(File(R"({"secret-token-123" 1})", 0)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message().find("secret"), std::string::npos) << st;
  // A tensor's name is quoted escaped and shortened.
  st = ParseSafetensors(
           File(absl::StrCat(R"({")", std::string(500, 'n'),
                             R"(\u0001\n":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})"),
                8))
           .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_LT(st.message().size(), 200u) << st;
  EXPECT_EQ(st.message().find('\x01'), std::string::npos) << st;
  EXPECT_EQ(st.message().find('\n'), std::string::npos) << st;
  st = ParseSafetensors(File(R"({"w\u0001":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", 8))
           .status();
  EXPECT_NE(st.message().find("\"w\\x01\""), std::string::npos) << st;
}

TEST(SafetensorsTest, HeaderLengthIsCheckedAgainstTheFileAndTheBound) {
  const std::string f = File("{}      ", 0);
  auto n = SafetensorsHeaderLength(f, f.size());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 8u);
  EXPECT_EQ(SafetensorsHeaderLength(f, 15).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(SafetensorsHeaderLength("1234567", 100).status().code(), absl::StatusCode::kDataLoss);
  std::string big(8, '\xff');
  EXPECT_EQ(SafetensorsHeaderLength(big, uint64_t{1} << 40).status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace moe::server
