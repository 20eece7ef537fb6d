// Chunk and stripe assembly (wire::TensorAssembler, wire::StripedAssembler) driven by a sequence
// of chunks decoded from the input, with the server's sizing: any dtype, shape (extents that
// overflow, negative ones, too many), offset, stream and row range. Whatever the sequence, no
// crash and no allocation beyond a small multiple of the bytes sent; every refusal is
// InvalidArgument; and a tensor the assembler hands out is exactly what its shape claims, holding
// the accepted chunks' bytes in order (in row order across streams).
//
// The client's sizing (kClaimedAtOnce) is left out: it reserves what its own server claims, up to
// 4 GiB, which a fuzzer's memory limit would flag.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "fuzz/fuzz_input.h"
#include "moe/v1/moe.pb.h"
#include "wire/wire.h"

namespace {

using moe::fuzz::FuzzInput;
using Sizing = moe::wire::TensorAssembler::Sizing;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void CheckRefusal(const absl::Status& st) {
  Check(st.ok() || st.code() == absl::StatusCode::kInvalidArgument);
}

moe::v1::Tensor ReadHeader(FuzzInput& in) {
  moe::v1::Tensor t;
  t.set_dtype(static_cast<moe::v1::DType>(in.Byte() % 6));  // 0 and 5 are not dtypes
  const uint8_t rank = in.Byte();
  const int n = rank < 250 ? rank % 5 : 9;  // sometimes more dimensions than allowed
  for (int i = 0; i < n; ++i) t.add_shape(in.Extent());
  return t;
}

// The chunk's data cut into up to three pieces, as gRPC's slices may be.
std::vector<absl::string_view> Pieces(const std::string& data, FuzzInput& in) {
  std::vector<absl::string_view> pieces;
  size_t from = 0;
  const int cuts = in.Byte() % 3;
  for (int i = 0; i < cuts; ++i) {
    const size_t to = from + (data.size() - from) * in.Byte() / 256;
    pieces.emplace_back(data.data() + from, to - from);
    from = to;
  }
  pieces.emplace_back(data.data() + from, data.size() - from);
  return pieces;
}

void CheckTensor(const moe::Tensor& t, const std::vector<int64_t>& shape, const std::string& want) {
  absl::StatusOr<int64_t> size = moe::CheckedByteSize(t.shape, t.dtype, "t");
  Check(size.ok() && static_cast<size_t>(*size) == t.bytes.size());
  Check(t.shape == shape);
  Check(t.bytes.size() == want.size() &&
        (want.empty() || std::memcmp(t.bytes.data(), want.data(), want.size()) == 0));
}

// One tensor in chunks; `want` is what the accepted chunks carried.
void Whole(FuzzInput& in) {
  moe::wire::TensorAssembler a("x",
                               in.Bool() ? Sizing::kGrow : Sizing::kClaimedOnceAnEighthArrived);
  std::string want;
  moe::v1::Tensor first;
  bool have_first = false;
  while (!in.empty()) {
    const uint8_t op = in.Byte();
    if (op < 16) {  // finish
      absl::StatusOr<moe::Tensor> t = a.Finish();
      CheckRefusal(t.status());
      if (t.ok()) CheckTensor(*t, {first.shape().begin(), first.shape().end()}, want);
      a.Reset();
      want.clear();
      have_first = false;
      continue;
    }
    // Mostly the first chunk's header again, at the offset the assembler expects.
    moe::v1::Tensor chunk = have_first && op >= 64 ? first : ReadHeader(in);
    chunk.set_offset(in.Byte() < 224 ? static_cast<int64_t>(want.size()) : in.Extent());
    const std::string data = in.Bytes(255);
    const absl::Status st = a.Add(chunk, Pieces(data, in));
    CheckRefusal(st);
    if (!st.ok()) continue;  // a refused chunk changes nothing
    if (!have_first) {
      first = chunk;
      have_first = true;
    }
    want += data;
  }
}

// One tensor striped over up to four streams; per stream, what its accepted chunks carried.
void Striped(FuzzInput& in) {
  const int64_t total_rows = in.Extent();
  moe::wire::StripedAssembler a("x", Sizing::kClaimedOnceAnEighthArrived, total_rows);
  struct Sent {
    int64_t row_begin = 0;
    int64_t rows = 0;
    std::string bytes;
    bool accepted = false;
  };
  std::map<uint32_t, Sent> sent;
  moe::v1::Tensor header = ReadHeader(in);
  while (!in.empty()) {
    const uint8_t op = in.Byte();
    if (op < 16) {  // finish with some number of streams; the assembler is spent afterwards
      absl::StatusOr<moe::Tensor> t = a.Finish(in.Byte() % 6);
      CheckRefusal(t.status());
      if (!t.ok()) return;
      Check(t->shape.size() == header.shape_size() && t->shape[0] == total_rows);
      const size_t row = total_rows > 0 ? t->bytes.size() / static_cast<size_t>(total_rows) : 0;
      for (const auto& [id, s] : sent) {
        if (!s.accepted || s.bytes.empty()) continue;
        Check(static_cast<size_t>(s.row_begin) * row + s.bytes.size() <= t->bytes.size());
        Check(std::memcmp(t->bytes.data() + static_cast<size_t>(s.row_begin) * row, s.bytes.data(),
                          s.bytes.size()) == 0);
      }
      return;
    }
    const uint32_t stream = in.Byte() % 4;
    auto [it, fresh] = sent.try_emplace(stream);
    Sent& s = it->second;
    int64_t row_begin = s.row_begin, rows = s.rows;
    if (fresh || op < 32) {  // a stream's first chunk (or a change of its rows)
      row_begin = in.Byte() < 192 ? (in.Byte() % 8) : in.Extent();
      rows = in.Extent();
    }
    moe::v1::Tensor chunk = op < 48 ? ReadHeader(in) : header;
    if (chunk.shape_size() > 0) chunk.set_shape(0, rows);
    chunk.set_offset(in.Byte() < 224 ? static_cast<int64_t>(s.bytes.size()) : in.Extent());
    const std::string data = in.Bytes(255);
    const absl::Status st = a.Add(stream, row_begin, chunk, Pieces(data, in));
    CheckRefusal(st);
    if (st.ok()) {
      // The assembler holds a stream to the rows of its first accepted chunk.
      Check(!s.accepted || (row_begin == s.row_begin && rows == s.rows));
      s.row_begin = row_begin;
      s.rows = rows;
      s.accepted = true;
      s.bytes += data;
      header = chunk;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  if (in.Bool()) {
    Striped(in);
  } else {
    Whole(in);
  }
  return 0;
}
