// Conversions between the wire messages (moe/v1/moe.proto) and the engine's types, and the
// tensor chunking both ends of a stream must agree on.
//
// Chunking: a micro-batch is a set of named tensors. The sender cuts each tensor's bytes into
// pieces so that no message carries more than `max_chunk_bytes` of tensor payload, and fills the
// pieces into consecutive messages in a fixed tensor order (every message repeats each tensor's
// dtype and shape). The receiver appends the pieces per tensor (`TensorAssembler`) and checks the
// byte count against the shape only when the micro-batch is complete, so a wrong size is always
// reported as the field that is wrong, never as a chunking error.
#ifndef MOE_PROTO_WIRE_H_
#define MOE_PROTO_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/layer.h"
#include "engine/tensor.h"
#include "moe/v1/moe.pb.h"

namespace moe::wire {

// DTYPE_UNSPECIFIED and unknown enum values give InvalidArgument naming `field`.
absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);

// Fills defaults (see moe.proto), maps enums, then ValidateLayerConfig. InvalidArgument names the
// field ("config.top_k", "config.activation", ...).
absl::StatusOr<LayerConfig> LayerConfigFromProto(const v1::LayerConfig& proto);
v1::LayerConfig LayerConfigToProto(const LayerConfig& config);

// Metadata-only copy (dtype + shape, no bytes) into a proto tensor.
void SetTensorHeader(DType dtype, const std::vector<int64_t>& shape, v1::Tensor* proto);

// Collects one tensor's chunks. The first chunk fixes dtype and shape; later chunks must repeat
// them (InvalidArgument naming `field` otherwise).
//
// How the buffer is sized (a 144 MiB tensor took 230 ms to assemble into a doubling buffer on
// the H100 machine, 93-103 ms into one reserved up front; docs/SERVICE_PERFORMANCE.md):
//   kGrow: as the bytes come (doubling).
//   kClaimedAtOnce: the first chunk reserves the size its shape claims. For a receiver that
//     trusts its peer: the client, whose server answers for the shapes it asked for.
//   kClaimedOnceAnEighthArrived: the claimed size is reserved once an eighth of it has arrived.
//     For the server, whose peer could otherwise make one small message allocate any amount:
//     what it reserves is at most 8x what the client has actually sent.
// Claims above 4 GiB, negative or overflowing are never reserved (CheckComplete reports the
// bad ones).
class TensorAssembler {
 public:
  enum class Sizing { kGrow, kClaimedAtOnce, kClaimedOnceAnEighthArrived };
  explicit TensorAssembler(std::string field, Sizing sizing = Sizing::kGrow)
      : field_(std::move(field)), sizing_(sizing) {}
  absl::Status Add(const v1::Tensor& chunk);
  // The same with the chunk's bytes given apart, as pieces in order (a received message's data
  // left in gRPC's buffers; raw_message.h): `chunk` supplies dtype and shape, its data is ignored.
  absl::Status Add(const v1::Tensor& chunk, absl::Span<const absl::string_view> pieces);
  // Room for `bytes` before the first Add, where the receiver knows the size from its own state
  // (the server knows dout's from the saved context), so the bytes land in one buffer.
  void Reserve(size_t bytes) { bytes_.reserve(bytes); }
  bool seen() const { return seen_; }
  // The complete tensor. Checks the dtype is known and the byte count matches the shape.
  // Hands the collected bytes over without copying them (received tensors are the largest
  // buffers on the hot path): afterwards the assembler holds no bytes.
  absl::StatusOr<Tensor> Finish();
  // A view of the bytes collected so far, valid while this object lives (no copy).
  absl::StatusOr<TensorView> FinishView();
  void Reset();

 private:
  absl::Status CheckComplete(DType* dtype);
  size_t ClaimedBytes() const;  // 0 when not to be reserved (see above)
  std::string field_;
  Sizing sizing_ = Sizing::kGrow;
  bool seen_ = false;
  size_t claimed_ = 0;  // what the shape claims, once to be reserved; 0 after reserving
  int dtype_ = 0;
  std::vector<int64_t> shape_;
  TensorBytes bytes_;  // Tensor's own byte type, so Finish() can move it out
};

// A piece of a tensor to put into one message.
struct Piece {
  int tensor = 0;  // index into the tensors passed to PlanChunks
  size_t offset = 0;
  size_t size = 0;
};

// Splits tensors of the given byte sizes into messages of at most `max_chunk_bytes` payload
// each (at least one message, even when every tensor is empty). Result[m] lists the pieces of
// message m.
std::vector<std::vector<Piece>> PlanChunks(const std::vector<size_t>& sizes,
                                           size_t max_chunk_bytes);

}  // namespace moe::wire

#endif  // MOE_PROTO_WIRE_H_
