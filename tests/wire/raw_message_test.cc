// wire/raw_message: the by-reference encoding is what protobuf parses, the decoder reads what
// protobuf writes (over any split into slices) and fails exactly where protobuf's parser fails,
// payloads are referenced and not copied, and their owner lives until the last slice is gone.
#include "wire/raw_message.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "moe/v1/moe.pb.h"
#include "tests/wire/buffers.h"

namespace moe::wire {
namespace {

std::string Joined(absl::Span<const absl::string_view> pieces) {
  std::string out;
  for (absl::string_view p : pieces) out.append(p.data(), p.size());
  return out;
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

v1::ForwardRequest Request(const std::string& x, const std::string& ids) {
  v1::ForwardRequest r;
  r.set_layer("moe.layer-0");
  r.set_context_id(0x1234567890ull);
  r.set_training(true);
  r.set_max_response_chunk_bytes(1 << 20);
  r.set_last_chunk(true);
  r.mutable_x()->set_dtype(v1::DTYPE_BFLOAT16);
  r.mutable_x()->add_shape(3);
  r.mutable_x()->add_shape(static_cast<int64_t>(x.size() / 6));
  r.mutable_x()->set_data(x);
  r.mutable_expert_ids()->set_dtype(v1::DTYPE_INT32);
  r.mutable_expert_ids()->add_shape(static_cast<int64_t>(ids.size() / 4));
  r.mutable_expert_ids()->set_data(ids);
  return r;
}

const std::vector<int> kForwardTensors = {v1::ForwardRequest::kXFieldNumber,
                                          v1::ForwardRequest::kExpertIdsFieldNumber,
                                          v1::ForwardRequest::kWeightsFieldNumber};

TEST(RawMessageTest, EncodedMessageParsesAsProtobufWithTheData) {
  const std::string x = RandomBytes(6000, 1), ids = RandomBytes(400, 2);
  const v1::ForwardRequest want = Request(x, ids);
  v1::ForwardRequest header = want;
  header.mutable_x()->clear_data();
  header.mutable_expert_ids()->clear_data();
  // weights present with an empty payload: stays present, with no data.
  header.mutable_weights()->set_dtype(v1::DTYPE_FLOAT32);
  const std::vector<OutgoingPayload> payloads = {
      {v1::ForwardRequest::kXFieldNumber, x.data(), x.size()},
      {v1::ForwardRequest::kExpertIdsFieldNumber, ids.data(), ids.size()},
      {v1::ForwardRequest::kWeightsFieldNumber, nullptr, 0}};
  grpc::ByteBuffer buffer = EncodeMessage(header, payloads, nullptr);
  v1::ForwardRequest got;
  ASSERT_TRUE(got.ParseFromString(Flatten(buffer)));
  v1::ForwardRequest expected = want;
  expected.mutable_weights()->set_dtype(v1::DTYPE_FLOAT32);
  EXPECT_EQ(got.SerializeAsString(), expected.SerializeAsString());
  EXPECT_EQ(got.x().data(), x);
  EXPECT_EQ(got.expert_ids().data(), ids);
  EXPECT_TRUE(got.has_weights());
}

TEST(RawMessageTest, PayloadsAreReferencedAndTheirOwnerOutlivesTheBuffer) {
  auto owner = std::make_shared<std::string>(RandomBytes(4096, 3));
  std::weak_ptr<std::string> watch = owner;
  v1::BackwardRequest header;
  header.set_layer("l");
  header.mutable_dout()->set_dtype(v1::DTYPE_FLOAT32);
  header.mutable_dout()->add_shape(1024);
  auto buffer = std::make_unique<grpc::ByteBuffer>(EncodeMessage(
      header, {{v1::BackwardRequest::kDoutFieldNumber, owner->data(), owner->size()}}, owner));
  const char* data = owner->data();
  owner.reset();
  ASSERT_FALSE(watch.expired()) << "the buffer must hold the payload's owner";

  // Decoding the encoded buffer itself finds the payload where the sender had it: no copy.
  grpc::ByteBuffer copy = *buffer;  // what gRPC does on a write: more references, no bytes
  IncomingMessage in;
  v1::BackwardRequest got;
  ASSERT_TRUE(
      in.Decode(&copy, {v1::BackwardRequest::kDoutFieldNumber}, &got, "BackwardRequest").ok());
  auto pieces = in.payload(v1::BackwardRequest::kDoutFieldNumber);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].data(), data);
  EXPECT_EQ(pieces[0].size(), 4096u);
  EXPECT_EQ(got.layer(), "l");
  EXPECT_EQ(got.dout().shape_size(), 1);
  EXPECT_TRUE(got.dout().data().empty());

  buffer.reset();
  EXPECT_FALSE(watch.expired()) << "the decoded message still refers to the payload";
  in = IncomingMessage();
  EXPECT_TRUE(watch.expired()) << "the last slice is gone: the owner must be released";
}

TEST(RawMessageTest, DecodesProtobufsOwnEncodingOverAnySplit) {
  const std::string x = RandomBytes(300, 4), ids = RandomBytes(40, 5);
  const v1::ForwardRequest want = Request(x, ids);
  const std::string bytes = want.SerializeAsString();
  std::mt19937 rng(6);
  for (int trial = 0; trial < 300; ++trial) {
    grpc::ByteBuffer buffer =
        Split(bytes, TrialCuts(static_cast<size_t>(trial), bytes.size(), rng));
    IncomingMessage in;
    v1::ForwardRequest got;
    ASSERT_TRUE(in.Decode(&buffer, kForwardTensors, &got, "ForwardRequest").ok())
        << "trial " << trial;
    EXPECT_EQ(Joined(in.payload(v1::ForwardRequest::kXFieldNumber)), x) << "trial " << trial;
    EXPECT_EQ(Joined(in.payload(v1::ForwardRequest::kExpertIdsFieldNumber)), ids);
    EXPECT_TRUE(in.payload(v1::ForwardRequest::kWeightsFieldNumber).empty());
    v1::ForwardRequest small = want;
    small.mutable_x()->clear_data();
    small.mutable_expert_ids()->clear_data();
    EXPECT_EQ(got.SerializeAsString(), small.SerializeAsString()) << "trial " << trial;
    EXPECT_EQ(in.wire_bytes(), bytes.size());
  }
}

// Protobuf's merge rules: a message repeated back to back is one message whose repeated fields
// concatenate and whose last `data` wins, whatever the decoder lifts out.
TEST(RawMessageTest, FollowsProtobufsMergeRules) {
  const v1::ForwardRequest a = Request(RandomBytes(60, 7), RandomBytes(8, 8));
  v1::ForwardRequest b;
  b.mutable_x()->set_data(RandomBytes(30, 9));
  b.mutable_x()->add_shape(5);
  const std::string bytes = a.SerializeAsString() + b.SerializeAsString();
  v1::ForwardRequest want;
  ASSERT_TRUE(want.ParseFromString(bytes));
  grpc::ByteBuffer buffer = Split(bytes, {});
  IncomingMessage in;
  v1::ForwardRequest got;
  ASSERT_TRUE(in.Decode(&buffer, kForwardTensors, &got, "ForwardRequest").ok());
  EXPECT_EQ(Joined(in.payload(v1::ForwardRequest::kXFieldNumber)), want.x().data());
  EXPECT_EQ(Joined(in.payload(v1::ForwardRequest::kExpertIdsFieldNumber)),
            want.expert_ids().data());
  want.mutable_x()->clear_data();
  want.mutable_expert_ids()->clear_data();
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  EXPECT_EQ(got.x().shape_size(), 3);
}

// Every prefix of a message and every single corrupted byte: the decoder accepts exactly what
// protobuf's parser accepts, and then reads the same message.
TEST(RawMessageTest, FailsExactlyWhereProtobufFails) {
  const std::string bytes = Request(RandomBytes(36, 10), RandomBytes(8, 11)).SerializeAsString();
  std::vector<std::string> inputs;
  for (size_t n = 0; n < bytes.size(); ++n) inputs.push_back(bytes.substr(0, n));
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (uint8_t v : {0x00, 0x07, 0x7F, 0x80, 0xFF}) {
      std::string s = bytes;
      s[i] = static_cast<char>(v);
      inputs.push_back(s);
    }
  }
  int rejected = 0;
  for (const std::string& input : inputs) {
    v1::ForwardRequest want;
    const bool protobuf_ok = want.ParseFromString(input);
    grpc::ByteBuffer buffer = Split(input, {});
    IncomingMessage in;
    v1::ForwardRequest got;
    absl::Status st = in.Decode(&buffer, kForwardTensors, &got, "ForwardRequest");
    ASSERT_EQ(st.ok(), protobuf_ok) << st << " on " << input.size() << " bytes";
    if (!st.ok()) {
      ++rejected;
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("ForwardRequest"), std::string::npos) << st;
      continue;
    }
    EXPECT_EQ(Joined(in.payload(v1::ForwardRequest::kXFieldNumber)), want.x().data());
    if (want.has_x()) want.mutable_x()->clear_data();
    if (want.has_expert_ids()) want.mutable_expert_ids()->clear_data();
    if (want.has_weights()) want.mutable_weights()->clear_data();
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  }
  EXPECT_GT(rejected, 10);  // the inputs do include broken messages
}

// Protobuf reads a tag in at most five bytes (its value taken mod 2^32) and a length in at most
// five bytes below 2^31 - 16; overlong encodings it refuses, the decoder refuses too, and it reads
// what protobuf reads (a five-byte tag of an unknown field, a padded length).
TEST(RawMessageTest, TagsAndLengthsAreReadAsProtobufReadsThem) {
  const std::vector<std::string> inputs = {
      std::string("\x8a\x8a\x8a\x8a\x8a\x00\x01\x6c", 8),      // a six-byte tag
      std::string("\x8a\x8a\x8a\x8a\x0a\x01\x6c", 7),          // five bytes: unknown field
      std::string("\x8a\x80\x80\x80\x10\x01\x6c", 7),          // five bytes, wraps to field 1
      std::string("\x0a\x81\x80\x80\x80\x80\x00\x6c", 8),      // a six-byte length
      std::string("\x0a\x81\x80\x80\x80\x00\x6c", 7),          // a padded five-byte length
      std::string("\x22\x82\x80\x80\x80\x00\x1a\x00", 8),      // x: a six-byte length
      std::string("\x22\x02\x1a\x80\x80\x80\x80\x80\x00", 9),  // x.data: six-byte length
      std::string("\x22\xff\xff\xff\xff\x07", 6),              // x: a length of 2^31 - 1
  };
  for (const std::string& input : inputs) {
    v1::ForwardRequest want;
    const bool protobuf_ok = want.ParseFromString(input);
    grpc::ByteBuffer buffer = Split(input, {input.size() / 2});
    IncomingMessage in;
    v1::ForwardRequest got;
    absl::Status st = in.Decode(&buffer, kForwardTensors, &got, "ForwardRequest");
    EXPECT_EQ(st.ok(), protobuf_ok) << st << " on " << absl::CEscape(input);
    if (st.ok()) {
      if (want.has_x()) want.mutable_x()->clear_data();
      EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString()) << absl::CEscape(input);
    }
  }
}

TEST(RawMessageTest, ChunkedMessagesCarryEveryByteOnce) {
  Tensor x = Tensor::Uninitialized(DType::kFloat32, {7, 5});
  const std::string xb = RandomBytes(x.bytes.size(), 12);
  std::memcpy(x.bytes.data(), xb.data(), xb.size());
  Tensor ids = Tensor::Uninitialized(DType::kInt32, {7, 2});
  const std::string ib = RandomBytes(ids.bytes.size(), 13);
  std::memcpy(ids.bytes.data(), ib.data(), ib.size());
  std::vector<Tensor> tensors;
  tensors.push_back(std::move(x));
  tensors.push_back(std::move(ids));
  tensors.push_back(Tensor());  // absent
  ChunkedMessages<v1::ForwardResponse> messages(
      std::move(tensors),
      {v1::ForwardResponse::kOutFieldNumber, v1::ForwardResponse::kExpertIdsFieldNumber,
       v1::ForwardResponse::kWeightsFieldNumber},
      /*chunk=*/24, [](v1::ForwardResponse* r) {
        r->set_context_id(9);
        return std::vector<v1::Tensor*>{r->mutable_out(), r->mutable_expert_ids(), nullptr};
      });
  ASSERT_EQ(messages.size(), (140u + 56u + 23u) / 24u);
  std::string out, got_ids;
  for (size_t m = 0; m < messages.size(); ++m) {
    v1::ForwardResponse r;
    ASSERT_TRUE(r.ParseFromString(Flatten(messages.Build(m))));
    EXPECT_EQ(r.context_id(), 9u);
    EXPECT_EQ(r.last_chunk(), m + 1 == messages.size());
    EXPECT_FALSE(r.has_weights());
    EXPECT_EQ(r.out().dtype(), v1::DTYPE_FLOAT32);
    EXPECT_EQ(r.out().shape_size(), 2);
    EXPECT_LE(r.out().data().size() + r.expert_ids().data().size(), 24u);
    // Each tensor's offset is the bytes of it the earlier messages carried.
    EXPECT_EQ(r.out().offset(), static_cast<int64_t>(out.size())) << "message " << m;
    EXPECT_EQ(r.expert_ids().offset(), static_cast<int64_t>(got_ids.size())) << "message " << m;
    out += r.out().data();
    got_ids += r.expert_ids().data();
  }
  EXPECT_EQ(out, xb);
  EXPECT_EQ(got_ids, ib);
}

}  // namespace
}  // namespace moe::wire
