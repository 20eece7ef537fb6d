// wire::StripedAssembler: a tensor whose rows arrive on several streams is assembled in place,
// bit for bit, whatever the order and the threads; a peer's claim is reserved only once an
// eighth of it has arrived (server sizing); and every way the streams can disagree is an
// InvalidArgument naming the field.
#include "proto/wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
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

}  // namespace
}  // namespace moe::wire
