// The wire decoder (wire/raw_message.h) on any bytes, split into gRPC slices anywhere: it must
// accept exactly what protobuf's parser accepts and then read the same message (small fields
// and each tensor's data); its tensors must go through the server's assembler without harm; a
// request's references into registered regions (ReadReferences) are refused with
// INVALID_ARGUMENT or are exactly the message's own, in a one-message micro-batch; and what it
// read, encoded again by reference, must decode to the same.
//
// Input: byte 0 picks the message type, byte 1 the number of slice cuts (mod 8), the next that
// many bytes where each cut falls (as a fraction of the message), the rest is the message.
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/tensor.h"
#include "google/protobuf/stubs/logging.h"
#include "moe/v1/moe.pb.h"
#include "wire/raw_message.h"
#include "wire/wire.h"

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// Protobuf logs every string field that is not UTF-8; a fuzzer makes millions.
[[maybe_unused]] const bool kProtobufQuiet = (google::protobuf::SetLogHandler(nullptr), true);

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

std::string Joined(absl::Span<const absl::string_view> pieces) {
  std::string out;
  for (absl::string_view p : pieces) out.append(p.data(), p.size());
  return out;
}

// The tensor field `number` of `m`, or null when unset.
const moe::v1::Tensor* TensorOf(const Message& m, int number) {
  const FieldDescriptor* f = m.GetDescriptor()->FindFieldByNumber(number);
  if (f == nullptr || !m.GetReflection()->HasField(m, f)) return nullptr;
  return static_cast<const moe::v1::Tensor*>(&m.GetReflection()->GetMessage(m, f));
}

void ClearData(Message* m, const std::vector<int>& fields) {
  for (int number : fields) {
    const FieldDescriptor* f = m->GetDescriptor()->FindFieldByNumber(number);
    if (!m->GetReflection()->HasField(*m, f)) continue;
    static_cast<moe::v1::Tensor*>(m->GetReflection()->MutableMessage(m, f))->clear_data();
  }
}

std::vector<const moe::v1::TensorRef*> DestinationsOf(const moe::v1::ForwardRequest& r) {
  return {r.has_out_ref() ? &r.out_ref() : nullptr};
}
std::vector<const moe::v1::TensorRef*> DestinationsOf(const moe::v1::BackwardRequest& r) {
  return {r.has_dx_ref() ? &r.dx_ref() : nullptr,
          r.has_dweights_ref() ? &r.dweights_ref() : nullptr};
}

// ReadReferences on a decoded request, as the message's first and as a later message of its
// micro-batch.
template <typename Msg>
void CheckReferences(const Msg& got, const moe::wire::IncomingMessage& in,
                     const std::vector<int>& tensor_fields) {
  for (bool first : {true, false}) {
    absl::StatusOr<moe::wire::MessageReferences> refs = moe::wire::ReadReferences(got, in, first);
    if (!refs.ok()) {
      Check(refs.status().code() == absl::StatusCode::kInvalidArgument);
      continue;
    }
    Check(refs->tensors.size() == tensor_fields.size());
    for (size_t i = 0; i < tensor_fields.size(); ++i) {
      const moe::v1::Tensor* t = TensorOf(got, tensor_fields[i]);
      const bool by_ref = t != nullptr && t->has_ref();
      Check(refs->tensors[i].has_value() == by_ref);
      if (!by_ref) continue;
      const moe::wire::ResolvedTensor& r = *refs->tensors[i];
      Check(r.region_id == t->ref().region_id() && r.region_id != 0);
      Check(r.offset == t->ref().offset() && r.offset >= 0);
      Check(t->data().empty() && in.payload(tensor_fields[i]).empty() && t->offset() == 0);
      Check(r.shape == std::vector<int64_t>(t->shape().begin(), t->shape().end()));
      absl::StatusOr<int64_t> size = moe::CheckedByteSize(r.shape, r.dtype, "t");
      Check(size.ok() && *size == r.byte_size);
    }
    const std::vector<const moe::v1::TensorRef*> destinations = DestinationsOf(got);
    Check(refs->destinations.size() == destinations.size());
    for (size_t i = 0; i < destinations.size(); ++i) {
      Check(refs->destinations[i].has_value() == (destinations[i] != nullptr));
      if (destinations[i] == nullptr) continue;
      Check(refs->destinations[i]->region_id() == destinations[i]->region_id() &&
            destinations[i]->region_id() != 0 && destinations[i]->offset() >= 0);
    }
    Check(refs->event_id == got.event_id());
    if (refs->any()) {
      Check(first && got.last_chunk() && got.stripe().count() == 0);
    } else {
      Check(got.event_id() == 0);
    }
  }
}

grpc::ByteBuffer Split(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  std::sort(cuts.begin(), cuts.end());
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + from, cut - from);
    from = cut;
  }
  slices.emplace_back(bytes.data() + from, bytes.size() - from);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

template <typename Msg>
void Run(const std::string& bytes, const std::vector<size_t>& cuts,
         const std::vector<int>& tensor_fields) {
  Msg want;
  const bool protobuf_ok = want.ParseFromString(bytes);
  grpc::ByteBuffer buffer = Split(bytes, cuts);
  moe::wire::IncomingMessage in;
  Msg got;
  const absl::Status st = in.Decode(&buffer, tensor_fields, &got, "msg");
  Check(st.ok() == protobuf_ok);
  if (!st.ok()) {
    Check(st.code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  Check(in.wire_bytes() == bytes.size());
  for (int f : tensor_fields) {
    const moe::v1::Tensor* t = TensorOf(want, f);
    Check(Joined(in.payload(f)) == (t ? t->data() : std::string()));
  }
  Msg small = want;
  ClearData(&small, tensor_fields);
  Check(got.SerializeAsString() == small.SerializeAsString());
  if constexpr (std::is_same_v<Msg, moe::v1::ForwardRequest> ||
                std::is_same_v<Msg, moe::v1::BackwardRequest>) {
    CheckReferences(got, in, tensor_fields);
  }

  // The server's assembly of what was decoded: a refusal names the field, a tensor it accepts
  // holds exactly what its shape claims.
  for (int f : tensor_fields) {
    const moe::v1::Tensor* t = TensorOf(got, f);
    if (t == nullptr) continue;
    moe::wire::TensorAssembler a("t",
                                 moe::wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived);
    if (!a.Add(*t, in.payload(f)).ok()) continue;
    absl::StatusOr<moe::Tensor> tensor = a.Finish();
    if (!tensor.ok()) continue;
    absl::StatusOr<int64_t> size = moe::CheckedByteSize(tensor->shape, tensor->dtype, "t");
    Check(size.ok() && static_cast<size_t>(*size) == tensor->bytes.size());
  }

  // Encoded again by reference (the header's tensors without data, each payload apart), it reads
  // the same.
  auto owner = std::make_shared<std::vector<std::string>>();
  for (int f : tensor_fields) owner->push_back(Joined(in.payload(f)));
  std::vector<moe::wire::OutgoingPayload> payloads;
  for (size_t i = 0; i < tensor_fields.size(); ++i) {
    payloads.push_back({tensor_fields[i], (*owner)[i].data(), (*owner)[i].size()});
  }
  grpc::ByteBuffer again = moe::wire::EncodeMessage(got, payloads, owner);
  moe::wire::IncomingMessage in2;
  Msg got2;
  Check(in2.Decode(&again, tensor_fields, &got2, "msg").ok());
  for (size_t i = 0; i < tensor_fields.size(); ++i) {
    const int f = tensor_fields[i];
    Check(Joined(in2.payload(f)) == (*owner)[i]);
    // A tensor with data had its header; one without keeps whatever presence it had.
    Check((TensorOf(got2, f) == nullptr) == (TensorOf(got, f) == nullptr));
  }
  Msg got2_small = got2, got_small = got;
  ClearData(&got2_small, tensor_fields);
  ClearData(&got_small, tensor_fields);
  Check(got2_small.SerializeAsString() == got_small.SerializeAsString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int kind = data[0] % 4;
  const size_t ncuts = data[1] % 8;
  if (size < 2 + ncuts) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 2 + ncuts, size - 2 - ncuts);
  std::vector<size_t> cuts;
  for (size_t i = 0; i < ncuts; ++i) cuts.push_back(bytes.size() * data[2 + i] / 256);
  switch (kind) {
    case 0:
      Run<moe::v1::ForwardRequest>(bytes, cuts, {4, 5, 6});
      break;
    case 1:
      Run<moe::v1::BackwardRequest>(bytes, cuts, {3});
      break;
    case 2:
      Run<moe::v1::ForwardResponse>(bytes, cuts, {2, 3, 4});
      break;
    default:
      Run<moe::v1::BackwardResponse>(bytes, cuts, {2, 3});
      break;
  }
  return 0;
}
