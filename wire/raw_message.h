// Forward and Backward messages on the wire without copying their tensors' bytes.
//
// Why: on the H100 a sonic-7b-shaped micro-batch's tensors are 75 MB each, and every copy of one
// on the host costs about 10 ms, against 3.6 ms for the whole layer on the GPU. Through protobuf
// each tensor was copied twice on the way out (into the message, then by gRPC's serializer) and
// twice on the way in (by the parser, then into the assembled tensor). Here a message is
// encoded as its small fields, serialized by protobuf, followed by each tensor's bytes as a
// grpc::Slice over the sender's own buffer; and a received message is split into its small
// fields (parsed by protobuf) and the pieces of gRPC's receive buffers that hold each tensor's
// bytes, which the receiver copies once, straight into the assembled tensor.
//
// The encoding is plain protobuf: a tensor field appears twice, first with its dtype and shape
// (inside the serialized small fields) and then with only its `data`; every protobuf parser
// merges the two occurrences into one Tensor. So any client or server that speaks moe.proto
// (Python's grpcio, grpcurl) reads and writes these messages unchanged, and the decoder here
// accepts any valid encoding, including protobuf's own.
//
// A tensor may also travel by reference (moe.proto TensorRef: bytes the client registered on the
// server's host); ReadReferences below reads and checks a message's references.
#ifndef MOE_WIRE_RAW_MESSAGE_H_
#define MOE_WIRE_RAW_MESSAGE_H_

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "moe/v1/moe.pb.h"
#include "wire/wire.h"

namespace moe::wire {

// One tensor's bytes to send by reference: the `data` of the moe.v1.Tensor in top-level field
// `field` of the message.
struct OutgoingPayload {
  int field = 0;
  const void* data = nullptr;
  size_t size = 0;
};

// `header` serialized, then each non-empty payload as a second occurrence of its tensor field
// holding only `data` (header's own tensors carry dtype and shape and no data). The payloads'
// bytes are not copied: the buffer's slices hold a reference to `owner`, which must keep them
// alive and unchanged, until gRPC has sent them and released the slices.
grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& header,
                               absl::Span<const OutgoingPayload> payloads,
                               std::shared_ptr<const void> owner);

// A received message, split into its small fields and the pieces of the receive buffer that hold
// the `data` of its tensor fields (no copy of those bytes is made).
class IncomingMessage {
 public:
  // Takes `buffer`'s slices. Every field except the `data` of the moe.v1.Tensor fields listed
  // in `tensor_fields` (top-level field numbers) is parsed into `header`; each such tensor's data
  // stays in the slices, as payload(field). Protobuf's merge rules hold: a tensor field that
  // appears more than once is one tensor, and its last `data` wins. A buffer protobuf could not
  // parse gives InvalidArgument naming `what` (the message type).
  absl::Status Decode(grpc::ByteBuffer* buffer, absl::Span<const int> tensor_fields,
                      google::protobuf::MessageLite* header, absl::string_view what);
  // The data of tensor field `field`, in order; empty when it carried none. Valid until the
  // next Decode or this object's destruction.
  absl::Span<const absl::string_view> payload(int field) const;
  // Bytes of the whole message on the wire.
  size_t wire_bytes() const { return wire_bytes_; }

 private:
  struct Payload {
    int field;
    std::vector<absl::string_view> pieces;
  };
  std::vector<grpc::Slice> slices_;
  std::vector<Payload> payloads_;
  std::string small_fields_;
  size_t wire_bytes_ = 0;
};

// A micro-batch's tensors cut into messages of at most `chunk` payload bytes (ChunkPlan), each
// encoded only when it is about to be written, by reference to the tensors, which this object
// shares with the encoded messages' slices. Every message gives each present tensor's `offset`:
// the bytes of it the earlier messages carried. `header` prepares an empty message (its small
// fields) and returns the proto tensors of the present tensors in the order of `fields` (nullptr
// for an absent one; an empty tensor is absent on the wire).
template <typename Msg>
class ChunkedMessages {
 public:
  using Header = std::function<std::vector<v1::Tensor*>(Msg*)>;

  ChunkedMessages() = default;
  // All of each tensor.
  ChunkedMessages(std::vector<Tensor> tensors, std::vector<int> fields, int64_t chunk,
                  Header header)
      : ChunkedMessages(std::make_shared<const std::vector<Tensor>>(std::move(tensors)),
                        /*row_begin=*/0, /*row_end=*/-1, std::move(fields), chunk,
                        std::move(header)) {}
  // Rows [row_begin, row_end) of every non-empty tensor, each of which is [T, ...] with
  // T >= row_end (row_end -1: all rows); each is sent with shape [row_end - row_begin, ...]. A
  // striped micro-batch's response (moe.proto, Stripe): each stream gets its rows of the results.
  ChunkedMessages(std::shared_ptr<const std::vector<Tensor>> tensors, int64_t row_begin,
                  int64_t row_end, std::vector<int> fields, int64_t chunk, Header header)
      : tensors_(std::move(tensors)), fields_(std::move(fields)), header_(std::move(header)) {
    std::vector<size_t> sizes;
    for (const Tensor& t : *tensors_) {
      Slice s{0, t.bytes.size(), t.shape};
      if (row_end >= 0 && !t.empty() && !t.shape.empty() && t.shape[0] > 0) {
        const size_t row_bytes = t.bytes.size() / static_cast<size_t>(t.shape[0]);
        s.offset = static_cast<size_t>(row_begin) * row_bytes;
        s.size = static_cast<size_t>(row_end - row_begin) * row_bytes;
        s.shape[0] = row_end - row_begin;
      }
      sizes.push_back(s.size);
      slices_.push_back(std::move(s));
    }
    plan_ = ChunkPlan(std::move(sizes), static_cast<size_t>(std::max<int64_t>(chunk, 1)));
  }

  size_t size() const { return plan_.size(); }

  // Message m of size(); it sets last_chunk on the last one.
  grpc::ByteBuffer Build(size_t m) const {
    Msg msg;
    std::vector<v1::Tensor*> protos = header_(&msg);
    for (size_t i = 0; i < tensors_->size(); ++i) {
      const Tensor& t = (*tensors_)[i];
      if (t.empty() || !protos[i]) continue;
      SetTensorHeader(t.dtype, slices_[i].shape, protos[i]);
      protos[i]->set_offset(static_cast<int64_t>(plan_.Offset(static_cast<int>(i), m)));
    }
    msg.set_last_chunk(m + 1 == plan_.size());
    std::vector<OutgoingPayload> payloads;
    for (const Piece& p : plan_.Pieces(m)) {
      if (!protos[p.tensor]) continue;
      payloads.push_back({fields_[p.tensor],
                          (*tensors_)[p.tensor].bytes.data() + slices_[p.tensor].offset + p.offset,
                          p.size});
    }
    return EncodeMessage(msg, payloads, tensors_);
  }

 private:
  struct Slice {
    size_t offset;  // of the first byte sent
    size_t size;
    std::vector<int64_t> shape;  // as sent
  };
  std::shared_ptr<const std::vector<Tensor>> tensors_;
  std::vector<Slice> slices_;
  std::vector<int> fields_;
  Header header_;
  ChunkPlan plan_;
};

// --- Tensors by reference (moe.proto TensorRef; docs/PROTOCOL.md, "Registered memory regions") -
// A client on the server's host names a tensor's bytes by (region, offset) in memory it
// registered, instead of sending them. These read and check the references of a decoded
// Forward or Backward message; server/region_registry.h resolves them to memory.

// A tensor by reference: where its bytes are (region, offset) and what they are (dtype, shape,
// and the bytes that shape holds). `field` is the reference's field, which errors about it name
// ("x.ref", "out_ref": "x.ref.offset: ...").
struct ResolvedTensor {
  std::string field;
  uint64_t region_id = 0;
  int64_t offset = 0;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  int64_t byte_size = 0;  // CheckedByteSize(shape, dtype)
};

// A request tensor `field` ("x") that carries `ref`. InvalidArgument naming the field when it
// carries bytes as well (`data` in the message, or `payload`: its data left in the receive buffer),
// a nonzero `offset`, an unknown dtype, a shape CheckedByteSize refuses, region_id 0 or a negative
// ref.offset.
absl::StatusOr<ResolvedTensor> ReferencedTensor(const v1::Tensor& tensor,
                                                absl::Span<const absl::string_view> payload,
                                                absl::string_view field);
// Where a result of `dtype` and `shape` (known to the server, not the client) is to be written,
// `ref` being the destination field `field` ("out_ref"): the same checks of the reference and
// of the shape.
absl::StatusOr<ResolvedTensor> DestinationTensor(const v1::TensorRef& ref, DType dtype,
                                                 std::vector<int64_t> shape,
                                                 absl::string_view field);

// What one Forward or Backward message references.
struct MessageReferences {
  // Per request tensor (Forward: x, expert_ids, weights; Backward: dout): its reference, or
  // nullopt when it is sent inline or absent.
  std::vector<std::optional<ResolvedTensor>> tensors;
  // Per destination (Forward: out; Backward: dx, dweights): where the client wants it written,
  // or nullopt to receive it in the response.
  std::vector<std::optional<v1::TensorRef>> destinations;
  uint64_t event_id = 0;
  // Whether the micro-batch uses any reference (and so is one message).
  bool any() const;
};

// The references of a decoded message (`in` holds its tensors' payloads), checked: each as
// ReferencedTensor, and a micro-batch with any reference is one message (its first and only:
// `first_message`, last_chunk set, no stripe); an event_id needs a reference. InvalidArgument
// naming the field otherwise ("x.ref: ...", "last_chunk: ...", "stripe: ...", "event_id: ...").
absl::StatusOr<MessageReferences> ReadReferences(const v1::ForwardRequest& msg,
                                                 const IncomingMessage& in, bool first_message);
absl::StatusOr<MessageReferences> ReadReferences(const v1::BackwardRequest& msg,
                                                 const IncomingMessage& in, bool first_message);

// For encoders: `proto` becomes a tensor of `dtype` and `shape` by reference, with no bytes.
void SetTensorRef(DType dtype, const std::vector<int64_t>& shape, uint64_t region_id,
                  int64_t offset, v1::Tensor* proto);

}  // namespace moe::wire

#endif  // MOE_WIRE_RAW_MESSAGE_H_
