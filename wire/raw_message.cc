// Encoding and decoding of tensor-carrying messages by reference (see raw_message.h). The
// decoder walks protobuf's wire format itself, over gRPC's slices, only far enough to lift the
// tensors' `data` out; everything else (a tensor's `ref` included) is re-emitted in canonical
// form and left to protobuf. The references a decoded request makes are checked here too.
#include "wire/raw_message.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe::wire {
namespace {

// Wire types of the protobuf encoding.
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kStartGroup = 3;
constexpr int kEndGroup = 4;
constexpr int kFixed32 = 5;
// Protobuf's own limit on nested groups and messages.
constexpr int kMaxDepth = 100;
// moe.v1.Tensor's `data`.
constexpr int kTensorDataField = v1::Tensor::kDataFieldNumber;

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void AppendTag(int field, int wire_type, std::string* out) {
  AppendVarint((static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type), out);
}

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

// Reads protobuf's wire format across a sequence of slices. Every read fails (returns false)
// rather than running past the end.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { Skip(); }

  bool at_end() const { return index_ == slices_.size(); }
  size_t position() const { return position_; }

  // A varint of at most `max_bytes` bytes (ten: any 64-bit value).
  bool ReadVarint(uint64_t* value, int max_bytes = 10) {
    *value = 0;
    for (int i = 0; i < max_bytes; ++i) {
      if (at_end()) return false;
      const uint8_t byte = slices_[index_].begin()[offset_];
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7F) << (7 * i);
      if (!(byte & 0x80)) return true;
    }
    return false;  // longer: not a varint protobuf reads here
  }
  // A field tag as protobuf's parser reads one: at most five bytes, the value taken mod 2^32.
  bool ReadTag(uint64_t* tag) {
    if (!ReadVarint(tag, 5)) return false;
    *tag &= 0xFFFFFFFFu;
    return true;
  }
  // A length as protobuf's parser reads one: at most five bytes, below 2^31 - 16 (protobuf keeps
  // that much room so its limits cannot overflow an int).
  bool ReadSize(uint64_t* size) { return ReadVarint(size, 5) && *size <= uint64_t{INT32_MAX} - 16; }

  // The next n bytes as views into the slices, appended to *pieces.
  bool Take(size_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      if (at_end()) return false;
      const size_t take = std::min(n, slices_[index_].size() - offset_);
      pieces->emplace_back(reinterpret_cast<const char*>(slices_[index_].begin()) + offset_, take);
      Advance(take);
      n -= take;
    }
    return true;
  }

  bool CopyTo(size_t n, std::string* out) {
    std::vector<absl::string_view> pieces;
    if (!Take(n, &pieces)) return false;
    for (absl::string_view p : pieces) out->append(p.data(), p.size());
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    position_ += n;
    Skip();
  }
  // Moves past exhausted (or empty) slices, so a non-end reader always has a byte at offset_.
  void Skip() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  size_t position_ = 0;
};

// Copies one field's value (its tag already read) in canonical form into *out. A group (not
// part of proto3, but protobuf's parser keeps one under an unknown field) is copied up to its
// matching end; a stray end of group fails, as it does in protobuf.
bool CopyField(SliceReader& in, uint64_t tag, std::string* out, int depth = 0) {
  const int wire_type = static_cast<int>(tag & 7);
  AppendVarint(tag, out);
  switch (wire_type) {
    case kStartGroup: {
      if (depth >= kMaxDepth) return false;
      for (;;) {
        uint64_t inner;
        if (!in.ReadTag(&inner) || (inner >> 3) == 0) return false;
        if ((inner & 7) == kEndGroup) {
          AppendVarint(inner, out);
          return (inner >> 3) == (tag >> 3);
        }
        if (!CopyField(in, inner, out, depth + 1)) return false;
      }
    }
    case kVarint: {
      uint64_t v;
      if (!in.ReadVarint(&v)) return false;
      AppendVarint(v, out);
      return true;
    }
    case kFixed64:
      return in.CopyTo(8, out);
    case kLengthDelimited: {
      uint64_t n;
      if (!in.ReadSize(&n)) return false;
      AppendVarint(n, out);
      return in.CopyTo(n, out);
    }
    case kFixed32:
      return in.CopyTo(4, out);
    default:
      return false;
  }
}

}  // namespace

grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& header,
                               absl::Span<const OutgoingPayload> payloads,
                               std::shared_ptr<const void> owner) {
  std::vector<grpc::Slice> slices;
  std::string pending = header.SerializeAsString();
  for (const OutgoingPayload& p : payloads) {
    if (p.size == 0) continue;
    // field { data: <bytes> }: the tag and length of the field, then those of data.
    const size_t inner =
        VarintSize((kTensorDataField << 3) | kLengthDelimited) + VarintSize(p.size) + p.size;
    AppendTag(p.field, kLengthDelimited, &pending);
    AppendVarint(inner, &pending);
    AppendTag(kTensorDataField, kLengthDelimited, &pending);
    AppendVarint(p.size, &pending);
    slices.emplace_back(pending);
    pending.clear();
    // The slice refers to the payload and holds a reference to its owner until gRPC drops it.
    auto* hold = new std::shared_ptr<const void>(owner);
    slices.emplace_back(
        const_cast<void*>(p.data), p.size,
        [](void* h) { delete static_cast<std::shared_ptr<const void>*>(h); }, hold);
  }
  if (!pending.empty()) slices.emplace_back(pending);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status IncomingMessage::Decode(grpc::ByteBuffer* buffer, absl::Span<const int> tensor_fields,
                                     google::protobuf::MessageLite* header,
                                     absl::string_view what) {
  slices_.clear();
  payloads_.clear();
  small_fields_.clear();
  wire_bytes_ = buffer->Length();
  auto malformed = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a valid message (", why, "; ", wire_bytes_, " bytes)"));
  };
  if (buffer->Valid() && !buffer->Dump(&slices_).ok()) return malformed("unreadable buffer");
  buffer->Clear();
  SliceReader in(slices_);
  while (!in.at_end()) {
    uint64_t tag;
    if (!in.ReadTag(&tag) || (tag >> 3) == 0) return malformed("bad field tag");
    const int field = static_cast<int>(std::min<uint64_t>(tag >> 3, INT32_MAX));
    const bool is_tensor =
        (tag & 7) == kLengthDelimited &&
        std::find(tensor_fields.begin(), tensor_fields.end(), field) != tensor_fields.end();
    if (!is_tensor) {
      if (!CopyField(in, tag, &small_fields_)) return malformed("truncated or unknown field");
      continue;
    }
    // A tensor: its fields but `data` go to the small fields, re-framed with their new length.
    uint64_t length;
    if (!in.ReadSize(&length)) return malformed("truncated tensor length");
    const size_t end = in.position() + length;
    std::string tensor_fields_bytes;
    while (in.position() < end) {
      uint64_t inner_tag;
      if (!in.ReadTag(&inner_tag) || (inner_tag >> 3) == 0) return malformed("bad tensor tag");
      if (inner_tag == ((kTensorDataField << 3) | kLengthDelimited)) {
        uint64_t n;
        if (!in.ReadSize(&n)) return malformed("truncated tensor data length");
        auto it = std::find_if(payloads_.begin(), payloads_.end(),
                               [&](const Payload& p) { return p.field == field; });
        if (it == payloads_.end()) it = payloads_.insert(payloads_.end(), Payload{field, {}});
        it->pieces.clear();  // the last `data` wins, as when protobuf merges
        if (!in.Take(n, &it->pieces)) return malformed("truncated tensor data");
      } else if (!CopyField(in, inner_tag, &tensor_fields_bytes)) {
        return malformed("truncated or unknown tensor field");
      }
    }
    if (in.position() != end) return malformed("tensor overruns its length");
    AppendTag(field, kLengthDelimited, &small_fields_);
    AppendVarint(tensor_fields_bytes.size(), &small_fields_);
    small_fields_ += tensor_fields_bytes;
  }
  if (!header->ParseFromString(small_fields_)) return malformed("bad small fields");
  return absl::OkStatus();
}

absl::Span<const absl::string_view> IncomingMessage::payload(int field) const {
  for (const Payload& p : payloads_) {
    if (p.field == field) return p.pieces;
  }
  return {};
}

// --- Tensors by reference ----------------------------------------------------------------
namespace {

// `ref` at `field` ("x.ref", "out_ref") names a region and an offset that can exist.
absl::Status CheckRef(const v1::TensorRef& ref, absl::string_view field) {
  if (ref.region_id() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".region_id: 0 names no region (RegisterRegion returns a region's id)"));
  }
  if (ref.offset() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".offset: ", ref.offset(), " is negative"));
  }
  return absl::OkStatus();
}

struct RequestTensor {
  const char* name;
  int field;
  bool present;
  const v1::Tensor* tensor;
};
struct Destination {
  const char* name;  // the TensorRef's field
  bool present;
  const v1::TensorRef* ref;
};

absl::StatusOr<MessageReferences> ReadMessageReferences(absl::Span<const RequestTensor> tensors,
                                                        absl::Span<const Destination> destinations,
                                                        uint64_t event_id, bool last_chunk,
                                                        bool striped, const IncomingMessage& in,
                                                        bool first_message) {
  MessageReferences refs;
  refs.event_id = event_id;
  std::string first_ref;  // the field of the first reference, for the errors below
  for (const RequestTensor& t : tensors) {
    if (!t.present || !t.tensor->has_ref()) {
      refs.tensors.emplace_back();
      continue;
    }
    MOE_ASSIGN_OR_RETURN(ResolvedTensor r,
                         ReferencedTensor(*t.tensor, in.payload(t.field), t.name));
    if (first_ref.empty()) first_ref = r.field;
    refs.tensors.emplace_back(std::move(r));
  }
  for (const Destination& d : destinations) {
    if (!d.present) {
      refs.destinations.emplace_back();
      continue;
    }
    MOE_RETURN_IF_ERROR(CheckRef(*d.ref, d.name));
    if (first_ref.empty()) first_ref = d.name;
    refs.destinations.emplace_back(*d.ref);
  }
  if (!refs.any()) {
    if (event_id != 0) {
      return absl::InvalidArgumentError(
          "event_id: an event pair orders accesses to regions, and this micro-batch references "
          "none");
    }
    return refs;
  }
  if (!first_message) {
    return absl::InvalidArgumentError(
        absl::StrCat(first_ref,
                     ": a micro-batch with references is one message, and this one began in an "
                     "earlier message"));
  }
  if (!last_chunk) {
    return absl::InvalidArgumentError(
        absl::StrCat("last_chunk: a micro-batch with references is one message and must set it (",
                     first_ref, ")"));
  }
  if (striped) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe: a micro-batch with references is not striped (", first_ref, ")"));
  }
  return refs;
}

}  // namespace

bool MessageReferences::any() const {
  for (const auto& t : tensors) {
    if (t.has_value()) return true;
  }
  for (const auto& d : destinations) {
    if (d.has_value()) return true;
  }
  return false;
}

absl::StatusOr<ResolvedTensor> ReferencedTensor(const v1::Tensor& tensor,
                                                absl::Span<const absl::string_view> payload,
                                                absl::string_view field) {
  size_t bytes = tensor.data().size();
  for (absl::string_view p : payload) bytes += p.size();
  if (bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data: a tensor given by reference carries no bytes, this one ", bytes));
  }
  if (tensor.offset() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".offset: must be 0 for a tensor given by reference, got ", tensor.offset()));
  }
  MOE_ASSIGN_OR_RETURN(const DType dtype, DTypeFromProto(tensor.dtype(), field));
  std::vector<int64_t> shape(tensor.shape().begin(), tensor.shape().end());
  MOE_ASSIGN_OR_RETURN(const int64_t size, CheckedByteSize(shape, dtype, field));
  const std::string ref_field = absl::StrCat(field, ".ref");
  MOE_RETURN_IF_ERROR(CheckRef(tensor.ref(), ref_field));
  return ResolvedTensor{ref_field, tensor.ref().region_id(), tensor.ref().offset(),
                        dtype,     std::move(shape),         size};
}

absl::StatusOr<ResolvedTensor> DestinationTensor(const v1::TensorRef& ref, DType dtype,
                                                 std::vector<int64_t> shape,
                                                 absl::string_view field) {
  MOE_RETURN_IF_ERROR(CheckRef(ref, field));
  MOE_ASSIGN_OR_RETURN(const int64_t size, CheckedByteSize(shape, dtype, field));
  return ResolvedTensor{
      std::string(field), ref.region_id(), ref.offset(), dtype, std::move(shape), size};
}

absl::StatusOr<MessageReferences> ReadReferences(const v1::ForwardRequest& msg,
                                                 const IncomingMessage& in, bool first_message) {
  const RequestTensor tensors[] = {
      {"x", v1::ForwardRequest::kXFieldNumber, msg.has_x(), &msg.x()},
      {"expert_ids", v1::ForwardRequest::kExpertIdsFieldNumber, msg.has_expert_ids(),
       &msg.expert_ids()},
      {"weights", v1::ForwardRequest::kWeightsFieldNumber, msg.has_weights(), &msg.weights()}};
  const Destination destinations[] = {{"out_ref", msg.has_out_ref(), &msg.out_ref()}};
  return ReadMessageReferences(tensors, destinations, msg.event_id(), msg.last_chunk(),
                               msg.stripe().count() != 0, in, first_message);
}

absl::StatusOr<MessageReferences> ReadReferences(const v1::BackwardRequest& msg,
                                                 const IncomingMessage& in, bool first_message) {
  const RequestTensor tensors[] = {
      {"dout", v1::BackwardRequest::kDoutFieldNumber, msg.has_dout(), &msg.dout()}};
  const Destination destinations[] = {
      {"dx_ref", msg.has_dx_ref(), &msg.dx_ref()},
      {"dweights_ref", msg.has_dweights_ref(), &msg.dweights_ref()}};
  return ReadMessageReferences(tensors, destinations, msg.event_id(), msg.last_chunk(),
                               msg.stripe().count() != 0, in, first_message);
}

void SetTensorRef(DType dtype, const std::vector<int64_t>& shape, uint64_t region_id,
                  int64_t offset, v1::Tensor* proto) {
  SetTensorHeader(dtype, shape, proto);
  proto->clear_data();
  proto->set_offset(0);
  proto->mutable_ref()->set_region_id(region_id);
  proto->mutable_ref()->set_offset(offset);
}

}  // namespace moe::wire
