// wire::StripedAssembler: a tensor whose rows arrive on several streams is assembled in place,
// bit for bit, whatever the order and the threads; a peer's claim is reserved only once an
// eighth of it has arrived (server sizing); and every way the streams can disagree is an
// InvalidArgument naming the field. wire::TensorAssembler and StripedAssembler: a chunk's offset
// must be the bytes already received (per stream when striped), and shapes that cannot exist are
// refused on the first chunk; a byte count short of the shape names the field at Finish; the
// reserving sizings assemble and check as the default does. wire::ChunkPlan and PlanChunks:
// messages worked out one at a time, every byte once within the limit.
#include "wire/wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace moe::wire {
namespace {

using Sizing = TensorAssembler::Sizing;

// A [rows, 3] float tensor with distinct values.
Tensor Table(int64_t rows) {
  Tensor t = Tensor::Zeros(DType::kFloat32, {rows, 3});
  for (int64_t i = 0; i < rows * 3; ++i) t.as<float>()[i] = static_cast<float>(i) + 0.5f;
  return t;
}

v1::Tensor Header(DType dtype, std::vector<int64_t> shape) {
  v1::Tensor h;
  SetTensorHeader(dtype, shape, &h);
  return h;
}

// Stream `s` sends rows [begin, end) of `t` in `pieces_per_chunk`-piece chunks of `chunk` bytes.
absl::Status SendRows(StripedAssembler& a, uint32_t s, const Tensor& t, int64_t begin, int64_t end,
                      size_t chunk) {
  const size_t row = t.bytes.size() / static_cast<size_t>(t.shape[0]);
  const char* data = reinterpret_cast<const char*>(t.bytes.data()) + begin * row;
  const size_t n = static_cast<size_t>(end - begin) * row;
  v1::Tensor h = Header(t.dtype, {end - begin, t.shape[1]});
  for (size_t off = 0; off < n; off += chunk) {
    h.set_offset(static_cast<int64_t>(off));
    const size_t take = std::min(chunk, n - off);
    // Two pieces per chunk, as a message split over gRPC slices.
    std::vector<absl::string_view> pieces = {
        absl::string_view(data + off, take / 2),
        absl::string_view(data + off + take / 2, take - take / 2)};
    absl::Status st = a.Add(s, begin, h, pieces);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

void ExpectInvalidNaming(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << "should name " << field << ": " << st;
}

TEST(StripedAssemblerTest, RowsFromEveryStreamLandInPlace) {
  const Tensor t = Table(29);
  for (Sizing sizing : {Sizing::kClaimedAtOnce, Sizing::kClaimedOnceAnEighthArrived}) {
    StripedAssembler a("x", sizing, 29);
    EXPECT_FALSE(a.seen());
    // Streams in an order that is not their rows', chunks interleaved.
    ASSERT_TRUE(SendRows(a, 2, t, 20, 29, 20).ok());
    ASSERT_TRUE(SendRows(a, 0, t, 0, 3, 7).ok());
    ASSERT_TRUE(SendRows(a, 1, t, 3, 20, 40).ok());
    EXPECT_TRUE(a.seen());
    absl::StatusOr<Tensor> got = a.Finish(3);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->dtype, DType::kFloat32);
    EXPECT_EQ(got->shape, (std::vector<int64_t>{29, 3}));
    EXPECT_TRUE(got->bytes == t.bytes);
  }
}

TEST(StripedAssemblerTest, StreamsOnTheirOwnThreadsGiveTheSameBits) {
  const Tensor t = Table(4000);
  StripedAssembler a("out", Sizing::kClaimedOnceAnEighthArrived, 4000);
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(8);
  for (uint32_t s = 0; s < 8; ++s) {
    threads.emplace_back([&, s] { status[s] = SendRows(a, s, t, s * 500, (s + 1) * 500, 333); });
  }
  for (std::thread& th : threads) th.join();
  for (const absl::Status& st : status) ASSERT_TRUE(st.ok()) << st;
  absl::StatusOr<Tensor> got = a.Finish(8);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->bytes == t.bytes);
}

TEST(StripedAssemblerTest, APeersClaimIsReservedOnlyOnceAnEighthHasArrived) {
  // 2^35 rows of 12 bytes claim 384 GiB: reserving it on one small message would fail here.
  const int64_t total = int64_t{1} << 35;
  StripedAssembler a("x", Sizing::kClaimedOnceAnEighthArrived, total);
  const Tensor small = Table(16);
  const v1::Tensor h = Header(DType::kFloat32, {16, 3});
  const absl::string_view bytes(reinterpret_cast<const char*>(small.bytes.data()),
                                small.bytes.size());
  EXPECT_TRUE(a.Add(0, 0, h, {bytes}).ok());
  ExpectInvalidNaming(a.Finish(1).status(), "x");  // and it is not a whole tensor
}

TEST(StripedAssemblerTest, EveryDisagreementNamesTheField) {
  const Tensor t = Table(10);
  auto fresh = [] { return StripedAssembler("x", Sizing::kClaimedAtOnce, 10); };
  {  // another stream with another dtype, another width
    StripedAssembler a = fresh();
    ASSERT_TRUE(SendRows(a, 0, t, 0, 5, 64).ok());
    ExpectInvalidNaming(a.Add(1, 5, Header(DType::kBFloat16, {5, 3}), {}), "x");
    ExpectInvalidNaming(a.Add(1, 5, Header(DType::kFloat32, {5, 4}), {}), "x");
  }
  {  // rows past the end, overlapping another stream's, or no row dimension at all
    StripedAssembler a = fresh();
    ExpectInvalidNaming(a.Add(0, 8, Header(DType::kFloat32, {3, 3}), {}), "stripe.row_begin");
    ASSERT_TRUE(SendRows(a, 0, t, 0, 5, 64).ok());
    ExpectInvalidNaming(a.Add(1, 4, Header(DType::kFloat32, {6, 3}), {}), "stripe.row_begin");
    ExpectInvalidNaming(a.Add(1, 5, Header(DType::kFloat32, {}), {}), "x");
  }
  {  // a stream that changes its shape, or sends more than its rows hold
    StripedAssembler a = fresh();
    ASSERT_TRUE(SendRows(a, 0, t, 0, 5, 64).ok());
    ExpectInvalidNaming(a.Add(0, 0, Header(DType::kFloat32, {4, 3}), {}), "x");
    std::string extra(4, '\0');
    v1::Tensor h = Header(DType::kFloat32, {5, 3});
    h.set_offset(60);
    ExpectInvalidNaming(a.Add(0, 0, h, {extra}), "x");
  }
  {  // at the end: a stream short of bytes, a stream missing, rows that leave a gap
    StripedAssembler a = fresh();
    ASSERT_TRUE(SendRows(a, 0, t, 0, 5, 64).ok());
    ASSERT_TRUE(SendRows(a, 1, t, 5, 9, 64).ok());
    ExpectInvalidNaming(a.Finish(3).status(), "x");                 // 2 of 3 streams
    ExpectInvalidNaming(a.Finish(2).status(), "stripe.row_begin");  // row 9 is nobody's
    StripedAssembler b = fresh();
    ASSERT_TRUE(SendRows(b, 0, t, 0, 5, 64).ok());
    const Tensor half = Table(5);
    ASSERT_TRUE(b.Add(1, 5, Header(DType::kFloat32, {5, 3}),
                      {absl::string_view(reinterpret_cast<const char*>(half.bytes.data()), 8)})
                    .ok());
    ExpectInvalidNaming(b.Finish(2).status(), "x");
  }
}

v1::Tensor Chunk(DType dtype, std::vector<int64_t> shape, std::string data, int64_t offset) {
  v1::Tensor c = Header(dtype, std::move(shape));
  c.set_data(std::move(data));
  c.set_offset(offset);
  return c;
}

TEST(TensorAssemblerTest, EachChunkMustStartWhereTheLastEnded) {
  for (Sizing sizing :
       {Sizing::kGrow, Sizing::kClaimedAtOnce, Sizing::kClaimedOnceAnEighthArrived}) {
    SCOPED_TRACE(static_cast<int>(sizing));
    {  // in order: the bytes in order
      TensorAssembler a("x", sizing);
      ASSERT_TRUE(a.Add(Chunk(DType::kInt32, {2, 2}, "abcdefgh", 0)).ok());
      ASSERT_TRUE(a.Add(Chunk(DType::kInt32, {2, 2}, "", 8)).ok());  // an empty piece
      ASSERT_TRUE(a.Add(Chunk(DType::kInt32, {2, 2}, "ijklmnop", 8)).ok());
      absl::StatusOr<Tensor> t = a.Finish();
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(t->bytes.data()), t->bytes.size()),
                "abcdefghijklmnop");
    }
    {  // the second chunk first
      TensorAssembler a("x", sizing);
      ExpectInvalidNaming(a.Add(Chunk(DType::kInt32, {2, 2}, "ijklmnop", 8)),
                          "x: chunk at byte offset 8");
    }
    {  // a chunk repeated, a chunk lost
      TensorAssembler a("expert_ids", sizing);
      ASSERT_TRUE(a.Add(Chunk(DType::kInt32, {2, 2}, "abcd", 0)).ok());
      ExpectInvalidNaming(a.Add(Chunk(DType::kInt32, {2, 2}, "abcd", 0)),
                          "expert_ids: chunk at byte offset 0");
      ExpectInvalidNaming(a.Add(Chunk(DType::kInt32, {2, 2}, "ijkl", 8)),
                          "expert_ids: chunk at byte offset 8");
      ASSERT_TRUE(a.Add(Chunk(DType::kInt32, {2, 2}, "efgh", 4)).ok());
    }
    {  // more bytes than the shape holds, at once or over chunks
      TensorAssembler a("dout", sizing);
      ExpectInvalidNaming(a.Add(Chunk(DType::kInt32, {1, 2}, "abcdefghi", 0)),
                          "dout: 9 bytes, more than its shape holds (8)");
      TensorAssembler b("dout", sizing);
      ASSERT_TRUE(b.Add(Chunk(DType::kInt32, {1, 2}, "abcdef", 0)).ok());
      ExpectInvalidNaming(b.Add(Chunk(DType::kInt32, {1, 2}, "ghi", 6)), "dout");
    }
    {  // shapes that cannot exist, an unknown dtype: refused on the first chunk, and after
      for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
               {int64_t{1} << 62, 4}, {-1, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 9}}) {
        TensorAssembler a("x", sizing);
        ExpectInvalidNaming(a.Add(Chunk(DType::kFloat32, shape, "", 0)), "x: ");
        ExpectInvalidNaming(a.Add(Chunk(DType::kFloat32, shape, "", 0)), "x: ");
        ExpectInvalidNaming(a.Finish().status(), "x: ");
      }
      TensorAssembler a("weights", sizing);
      v1::Tensor c = Chunk(DType::kFloat32, {1}, "abcd", 0);
      c.set_dtype(static_cast<v1::DType>(42));
      ExpectInvalidNaming(a.Add(c), "weights: unknown dtype");
    }
  }
}

TEST(StripedAssemblerTest, EachStreamsOffsetsCountItsOwnRows) {
  const Tensor t = Table(6);
  const char* bytes = reinterpret_cast<const char*>(t.bytes.data());
  auto rows = [&](int64_t begin, int64_t end) {
    return std::string(bytes + begin * 12, static_cast<size_t>(end - begin) * 12);
  };
  StripedAssembler a("x", Sizing::kClaimedAtOnce, 6);
  // Stream 1 (rows [3, 6)) and stream 0 (rows [0, 3)) interleaved, each from its own offset 0.
  const std::string s0 = rows(0, 3), s1 = rows(3, 6);
  auto add = [&](uint32_t s, int64_t begin, const std::string& all, size_t off, size_t n) {
    const absl::string_view piece(all.data() + off, n);
    return a.Add(s, begin, Chunk(DType::kFloat32, {3, 3}, "", static_cast<int64_t>(off)), {piece});
  };
  ASSERT_TRUE(add(1, 3, s1, 0, 20).ok());
  ASSERT_TRUE(add(0, 0, s0, 0, 12).ok());
  ExpectInvalidNaming(add(1, 3, s1, 0, 16), "x: stream 1 sent a chunk at byte offset 0");
  ExpectInvalidNaming(add(0, 0, s0, 20, 16), "x: stream 0 sent a chunk at byte offset 20");
  ASSERT_TRUE(add(1, 3, s1, 20, 16).ok());
  ASSERT_TRUE(add(0, 0, s0, 12, 24).ok());
  absl::StatusOr<Tensor> got = a.Finish(2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->bytes == t.bytes);
  // A stream's first chunk must start at 0.
  StripedAssembler b("x", Sizing::kClaimedAtOnce, 6);
  ExpectInvalidNaming(b.Add(0, 0, Chunk(DType::kFloat32, {3, 3}, "", 12), {}),
                      "x: stream 0's first chunk at byte offset 12");
}

TEST(StripedAssemblerTest, ShapesThatCannotExistAreRefusedOnTheFirstChunk) {
  {  // a row whose size overflows; a whole tensor past the bound
    StripedAssembler a("x", Sizing::kClaimedOnceAnEighthArrived, 4);
    ExpectInvalidNaming(a.Add(0, 0, Header(DType::kFloat32, {2, int64_t{1} << 62}), {}), "x: ");
    StripedAssembler b("x", Sizing::kClaimedOnceAnEighthArrived, int64_t{1} << 40);
    ExpectInvalidNaming(b.Add(0, 0, Header(DType::kFloat32, {2, 4}), {}), "stripe.total_rows");
  }
  {  // rows that overflow row_begin + rows
    StripedAssembler a("x", Sizing::kClaimedOnceAnEighthArrived, 4);
    ExpectInvalidNaming(
        a.Add(0, std::numeric_limits<int64_t>::max() - 1, Header(DType::kFloat32, {4, 4}), {}),
        "stripe.row_begin");
    ExpectInvalidNaming(a.Add(0, 0, Header(DType::kFloat32, {-4, 4}), {}), "x: ");
  }
}

TEST(ChunkPlanTest, MessagesAreWorkedOutOneAtATime) {
  for (size_t limit : {1u, 7u, 8u, 64u}) {
    const std::vector<size_t> sizes = {10, 0, 25, 3};
    const ChunkPlan plan(sizes, limit);
    std::vector<size_t> next(sizes.size(), 0);
    for (size_t m = 0; m < plan.size(); ++m) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_EQ(plan.Offset(static_cast<int>(i), m), next[i]) << "limit " << limit;
      }
      size_t total = 0;
      for (const Piece& p : plan.Pieces(m)) {
        EXPECT_EQ(p.offset, next[p.tensor]);
        next[p.tensor] += p.size;
        total += p.size;
      }
      EXPECT_LE(total, limit);
      EXPECT_TRUE(total == limit || m + 1 == plan.size());
    }
    EXPECT_EQ(next, sizes);
  }
  // A terabyte in one-byte chunks: 2^40 messages, planned in no memory.
  const ChunkPlan huge({size_t{1} << 40}, 1);
  EXPECT_EQ(huge.size(), size_t{1} << 40);
  EXPECT_EQ(huge.Offset(0, 12345), 12345u);
  EXPECT_EQ(ChunkPlan({0, 0}, 16).size(), 1u);  // an empty micro-batch is one message
  EXPECT_EQ(ChunkPlan().size(), 0u);
}

TEST(WireTest, PlanChunksCoversEveryByteOnceWithinTheLimit) {
  for (size_t limit : {1u, 7u, 8u, 64u}) {
    const std::vector<size_t> sizes = {10, 0, 25, 3};
    auto plan = PlanChunks(sizes, limit);
    std::vector<size_t> next(sizes.size(), 0);
    for (const auto& message : plan) {
      size_t total = 0;
      for (const auto& p : message) {
        EXPECT_EQ(p.offset, next[p.tensor]) << "limit " << limit;
        next[p.tensor] += p.size;
        total += p.size;
      }
      EXPECT_LE(total, limit);
    }
    EXPECT_EQ(next, sizes) << "limit " << limit;
  }
  EXPECT_EQ(PlanChunks({0, 0}, 16).size(), 1u);  // an empty micro-batch is one message
}

TEST(WireTest, AssemblerNamesTheFieldOnAByteMismatch) {
  TensorAssembler a("dout");
  v1::Tensor chunk;
  SetTensorHeader(DType::kFloat32, {2, 3}, &chunk);
  chunk.set_data(std::string(20, 'x'));
  ASSERT_TRUE(a.Add(chunk).ok());
  absl::Status st = a.Finish().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("dout"), std::string::npos) << st;
  chunk.set_data(std::string(4, 'x'));
  chunk.set_offset(20);
  ASSERT_TRUE(a.Add(chunk).ok());
  EXPECT_TRUE(a.Finish().ok());
  v1::Tensor other;
  SetTensorHeader(DType::kFloat32, {3, 3}, &other);
  EXPECT_EQ(a.Add(other).code(), absl::StatusCode::kInvalidArgument);
}

// kClaimedAtOnce (the client's receivers) and kClaimedOnceAnEighthArrived (the server's) reserve
// the claimed size; the result and every check stay those of the default assembler. A claim past
// the 4 GiB cap is not reserved (the tensor is then short at Finish); an overflowing or negative
// one is refused on its first chunk. Neither throws nor allocates.
TEST(WireTest, ReservingAssemblersAssembleAndCheckLikeTheDefault) {
  using Sizing = TensorAssembler::Sizing;
  for (Sizing sizing :
       {Sizing::kGrow, Sizing::kClaimedAtOnce, Sizing::kClaimedOnceAnEighthArrived}) {
    SCOPED_TRACE(static_cast<int>(sizing));
    // 2048 bytes in chunks of 100 (the last one 48): the eighth arrives mid-stream.
    TensorAssembler a("out", sizing);
    v1::Tensor chunk;
    SetTensorHeader(DType::kFloat32, {16, 32}, &chunk);
    std::string all;
    for (int i = 0; all.size() < 2048; ++i) {
      chunk.set_data(std::string(std::min<size_t>(100, 2048 - all.size()), static_cast<char>(i)));
      chunk.set_offset(static_cast<int64_t>(all.size()));
      all += chunk.data();
      ASSERT_TRUE(a.Add(chunk).ok());
    }
    absl::StatusOr<Tensor> t = a.Finish();
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->bytes.size(), all.size());
    EXPECT_EQ(std::memcmp(t->bytes.data(), all.data(), all.size()), 0);

    for (const std::vector<int64_t>& claim :
         std::vector<std::vector<int64_t>>{{int64_t{1} << 40, int64_t{1} << 30},  // overflows
                                           {int64_t{1} << 30, 8},                 // 32 GiB
                                           {-4, 2}}) {
      TensorAssembler b("dx", sizing);
      v1::Tensor c;
      SetTensorHeader(DType::kFloat32, claim, &c);
      c.set_data(std::string(4, 'x'));
      absl::Status st = b.Add(c);
      if (st.ok()) st = b.Finish().status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("dx"), std::string::npos) << st;
    }
  }
}

}  // namespace
}  // namespace moe::wire
