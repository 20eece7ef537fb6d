// Tensors by reference (moe.proto TensorRef) on the wire: a request that names its tensors and
// destinations in registered regions decodes, over any split into slices, to exactly what
// protobuf's parser reads; the by-reference encoding of one is what protobuf parses; and
// ReadReferences reads each reference and refuses every malformed one naming its field.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "moe/v1/moe.pb.h"
#include "tests/wire/buffers.h"
#include "wire/raw_message.h"

namespace moe::wire {
namespace {

const std::vector<int> kForwardTensors = {v1::ForwardRequest::kXFieldNumber,
                                          v1::ForwardRequest::kExpertIdsFieldNumber,
                                          v1::ForwardRequest::kWeightsFieldNumber};
const std::vector<int> kBackwardTensors = {v1::BackwardRequest::kDoutFieldNumber};

// x [3, 8] bf16 by reference, expert_ids [3, 2] int32 inline, out written to a region.
v1::ForwardRequest ReferencingForward() {
  v1::ForwardRequest r;
  r.set_layer("moe.layer-0");
  r.set_context_id(0xabcdef0123ull);
  r.set_training(true);
  r.set_last_chunk(true);
  SetTensorRef(DType::kBFloat16, {3, 8}, 0x8000000000000001ull, 4096, r.mutable_x());
  r.mutable_expert_ids()->set_dtype(v1::DTYPE_INT32);
  r.mutable_expert_ids()->add_shape(3);
  r.mutable_expert_ids()->add_shape(2);
  r.mutable_expert_ids()->set_data(std::string(24, '\x01'));
  r.mutable_out_ref()->set_region_id(77);
  r.mutable_out_ref()->set_offset(1 << 20);
  r.set_event_id(5);
  return r;
}

template <typename Msg>
absl::StatusOr<MessageReferences> Read(const Msg& msg, const std::vector<int>& fields,
                                       bool first = true) {
  grpc::ByteBuffer buffer = Split(msg.SerializeAsString(), {});
  IncomingMessage in;
  Msg got;
  absl::Status st = in.Decode(&buffer, fields, &got, "msg");
  if (!st.ok()) return st;
  return ReadReferences(got, in, first);
}

#define EXPECT_REFUSED(expr, field)                                               \
  do {                                                                            \
    const absl::Status st_ = (expr).status();                                     \
    EXPECT_EQ(st_.code(), absl::StatusCode::kInvalidArgument) << st_;             \
    EXPECT_TRUE(absl::StartsWith(st_.message(), field)) << st_ << " / " << field; \
  } while (0)

TEST(ReferencesTest, DecodeOverAnySplitReadsWhatProtobufReads) {
  const v1::ForwardRequest want = ReferencingForward();
  const std::string bytes = want.SerializeAsString();
  std::mt19937 rng(3);
  for (size_t trial = 0; trial < bytes.size() + 100; ++trial) {
    grpc::ByteBuffer buffer = Split(bytes, TrialCuts(trial, bytes.size(), rng));
    IncomingMessage in;
    v1::ForwardRequest got;
    ASSERT_TRUE(in.Decode(&buffer, kForwardTensors, &got, "ForwardRequest").ok()) << trial;
    v1::ForwardRequest small = want;
    small.mutable_expert_ids()->clear_data();
    ASSERT_EQ(got.SerializeAsString(), small.SerializeAsString()) << "trial " << trial;
    EXPECT_TRUE(in.payload(v1::ForwardRequest::kXFieldNumber).empty());

    absl::StatusOr<MessageReferences> refs = ReadReferences(got, in, /*first_message=*/true);
    ASSERT_TRUE(refs.ok()) << refs.status();
    ASSERT_TRUE(refs->any());
    ASSERT_EQ(refs->tensors.size(), 3u);
    ASSERT_TRUE(refs->tensors[0].has_value());
    const ResolvedTensor& x = *refs->tensors[0];
    EXPECT_EQ(x.field, "x.ref");
    EXPECT_EQ(x.region_id, 0x8000000000000001ull);
    EXPECT_EQ(x.offset, 4096);
    EXPECT_EQ(x.dtype, DType::kBFloat16);
    EXPECT_EQ(x.shape, (std::vector<int64_t>{3, 8}));
    EXPECT_EQ(x.byte_size, 48);
    EXPECT_FALSE(refs->tensors[1].has_value());  // inline
    EXPECT_FALSE(refs->tensors[2].has_value());  // absent
    ASSERT_EQ(refs->destinations.size(), 1u);
    ASSERT_TRUE(refs->destinations[0].has_value());
    EXPECT_EQ(refs->destinations[0]->region_id(), 77u);
    EXPECT_EQ(refs->destinations[0]->offset(), 1 << 20);
    EXPECT_EQ(refs->event_id, 5u);
  }
}

TEST(ReferencesTest, ByReferenceEncodingParsesAsProtobufWithTheReferences) {
  const v1::ForwardRequest want = ReferencingForward();
  v1::ForwardRequest header = want;
  const std::string ids = header.expert_ids().data();
  header.mutable_expert_ids()->clear_data();
  grpc::ByteBuffer buffer = EncodeMessage(
      header, {{v1::ForwardRequest::kExpertIdsFieldNumber, ids.data(), ids.size()}}, nullptr);
  v1::ForwardRequest got;
  ASSERT_TRUE(got.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  EXPECT_TRUE(got.x().has_ref());
  EXPECT_TRUE(got.x().data().empty());
}

TEST(ReferencesTest, BackwardDestinationsAndAMessageWithoutReferences) {
  v1::BackwardRequest r;
  r.set_layer("l");
  r.set_context_id(3);
  r.set_last_chunk(true);
  SetTensorRef(DType::kFloat32, {4, 16}, 9, 0, r.mutable_dout());
  r.mutable_dweights_ref()->set_region_id(9);
  r.mutable_dweights_ref()->set_offset(256);
  absl::StatusOr<MessageReferences> refs = Read(r, kBackwardTensors);
  ASSERT_TRUE(refs.ok()) << refs.status();
  ASSERT_TRUE(refs->tensors[0].has_value());
  EXPECT_EQ(refs->tensors[0]->field, "dout.ref");
  EXPECT_EQ(refs->tensors[0]->byte_size, 256);
  ASSERT_EQ(refs->destinations.size(), 2u);
  EXPECT_FALSE(refs->destinations[0].has_value());  // dx comes back in the response
  ASSERT_TRUE(refs->destinations[1].has_value());
  EXPECT_EQ(refs->destinations[1]->offset(), 256);

  // Chunked, inline tensors only: nothing to read, whatever the message's place.
  v1::BackwardRequest plain;
  plain.set_layer("l");
  plain.mutable_dout()->set_dtype(v1::DTYPE_FLOAT32);
  plain.mutable_dout()->add_shape(4);
  plain.mutable_dout()->set_data(std::string(8, 'd'));
  for (bool first : {true, false}) {
    absl::StatusOr<MessageReferences> none = Read(plain, kBackwardTensors, first);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_FALSE(none->any());
    EXPECT_EQ(none->tensors.size(), 1u);
    EXPECT_EQ(none->destinations.size(), 2u);
  }
}

TEST(ReferencesTest, EveryMalformedReferenceNamesItsField) {
  v1::ForwardRequest r = ReferencingForward();
  r.mutable_x()->set_data("xx");  // bytes as well as a reference
  EXPECT_REFUSED(Read(r, kForwardTensors), "x.data");
  // The same bytes left in protobuf's own field (a decoder not lifting x) are refused too.
  EXPECT_REFUSED(Read(r, {v1::ForwardRequest::kExpertIdsFieldNumber}), "x.data");

  r = ReferencingForward();
  r.mutable_x()->set_offset(8);
  EXPECT_REFUSED(Read(r, kForwardTensors), "x.offset");
  r = ReferencingForward();
  r.mutable_x()->mutable_ref()->set_region_id(0);
  EXPECT_REFUSED(Read(r, kForwardTensors), "x.ref.region_id");
  r = ReferencingForward();
  r.mutable_x()->mutable_ref()->set_offset(-1);
  EXPECT_REFUSED(Read(r, kForwardTensors), "x.ref.offset");
  r = ReferencingForward();
  r.mutable_x()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_REFUSED(Read(r, kForwardTensors), "x");
  r = ReferencingForward();
  r.mutable_x()->set_shape(0, int64_t{1} << 62);
  EXPECT_REFUSED(Read(r, kForwardTensors), "x");
  r = ReferencingForward();
  r.mutable_expert_ids()->clear_data();
  r.mutable_expert_ids()->mutable_ref();  // present, but names no region
  EXPECT_REFUSED(Read(r, kForwardTensors), "expert_ids.ref.region_id");
  r = ReferencingForward();
  r.mutable_out_ref()->set_region_id(0);
  EXPECT_REFUSED(Read(r, kForwardTensors), "out_ref.region_id");
  r = ReferencingForward();
  r.mutable_out_ref()->set_offset(std::numeric_limits<int64_t>::min());
  EXPECT_REFUSED(Read(r, kForwardTensors), "out_ref.offset");

  // A micro-batch with references is one message.
  r = ReferencingForward();
  r.set_last_chunk(false);
  EXPECT_REFUSED(Read(r, kForwardTensors), "last_chunk");
  EXPECT_REFUSED(Read(ReferencingForward(), kForwardTensors, /*first=*/false), "x.ref");
  r = ReferencingForward();
  r.mutable_stripe()->set_count(2);
  EXPECT_REFUSED(Read(r, kForwardTensors), "stripe");
  // Only a destination: still one message.
  r = ReferencingForward();
  r.mutable_x()->clear_ref();
  r.mutable_x()->set_data(std::string(48, 'x'));
  r.set_last_chunk(false);
  EXPECT_REFUSED(Read(r, kForwardTensors), "last_chunk");
  // An event pair with nothing in a region to order.
  r.set_last_chunk(true);
  r.clear_out_ref();
  EXPECT_REFUSED(Read(r, kForwardTensors), "event_id");
  r.set_event_id(0);
  EXPECT_TRUE(Read(r, kForwardTensors).ok());

  v1::BackwardRequest b;
  b.set_last_chunk(true);
  b.mutable_dx_ref()->set_offset(16);
  EXPECT_REFUSED(Read(b, kBackwardTensors), "dx_ref.region_id");
}

TEST(ReferencesTest, DestinationsTakeTheServersShapeThroughTheSameChecks) {
  v1::TensorRef ref;
  ref.set_region_id(4);
  ref.set_offset(64);
  absl::StatusOr<ResolvedTensor> out = DestinationTensor(ref, DType::kFloat32, {5, 7}, "out_ref");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->field, "out_ref");
  EXPECT_EQ(out->region_id, 4u);
  EXPECT_EQ(out->offset, 64);
  EXPECT_EQ(out->byte_size, 140);
  EXPECT_REFUSED(DestinationTensor(ref, DType::kFloat32, {-1, 7}, "out_ref"), "out_ref");
  ref.set_offset(-64);
  EXPECT_REFUSED(DestinationTensor(ref, DType::kFloat32, {5, 7}, "dx_ref"), "dx_ref.offset");
}

}  // namespace
}  // namespace moe::wire
