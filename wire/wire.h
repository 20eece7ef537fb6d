// Conversions between the wire messages (moe/v1/moe.proto) and the engine's types, and the
// tensor chunking both ends of a stream must agree on.
//
// Chunking: a micro-batch is a set of named tensors. The sender cuts each tensor's bytes into
// pieces so that no message carries more than `max_chunk_bytes` of tensor payload, and fills the
// pieces into consecutive messages in a fixed tensor order (every message repeats each tensor's
// dtype and shape, and the byte offset of its piece). The receiver appends the pieces per tensor
// (`TensorAssembler`): a piece must start where the previous one ended, and the bytes may never
// exceed what the shape holds; that they fill it exactly is checked once the micro-batch is
// complete. Every error names the tensor's field, never just "chunking".
//
// Shapes come from the peer: every product of their extents goes through CheckedByteSize
// (common/tensor.h) before anything is reserved or compared, so no shape can overflow int64 or
// claim more than kMaxTensorBytes.
#ifndef MOE_WIRE_WIRE_H_
#define MOE_WIRE_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/layer_config.h"
#include "common/tensor.h"
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

// Collects one tensor's chunks. The first chunk fixes dtype and shape, which must be known and
// within CheckedByteSize's bounds; later chunks must repeat them, each chunk's `offset` must equal
// the bytes collected so far, and no chunk may bring the total past what the shape holds
// (InvalidArgument naming `field` otherwise). A refused chunk changes nothing.
//
// How the buffer is sized (a 144 MiB tensor took 230 ms to assemble into a doubling buffer on
// the H100 machine, 93-103 ms into one reserved up front; docs/SERVICE_PERFORMANCE.md):
//   kGrow: as the bytes come (doubling).
//   kClaimedAtOnce: the first chunk reserves the size its shape claims. For a receiver that
//     trusts its peer: the client, whose server answers for the shapes it asked for.
//   kClaimedOnceAnEighthArrived: the claimed size is reserved once an eighth of it has arrived.
//     For the server, whose peer could otherwise make one small message allocate any amount:
//     what it reserves is at most 8x what the client has actually sent.
// Claims above 4 GiB are never reserved up front: they grow as the bytes come.
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
  std::string field_;
  Sizing sizing_ = Sizing::kGrow;
  bool seen_ = false;
  int64_t expected_ = -1;  // the bytes the shape holds; -1 before the first accepted chunk
  size_t claimed_ = 0;     // what the shape claims, once to be reserved; 0 after reserving
  int dtype_ = 0;
  std::vector<int64_t> shape_;
  TensorBytes bytes_;  // Tensor's own byte type, so Finish() can move it out
};

// Streams one striped micro-batch may use (moe.proto `Stripe.count`): the server refuses more,
// and the client never splits into more.
inline constexpr uint32_t kMaxStripes = 64;

// How far the row ranges (row_begin, rows) tile [0, n) from row 0, each row once: the first row
// that no range starting where the previous ended covers. Equal to the total only when the
// ranges tile [0, total) exactly (a striped micro-batch's streams must).
int64_t TiledRows(std::vector<std::pair<int64_t, int64_t>> ranges);

// One tensor of a striped micro-batch (moe.proto `Stripe`): each stream carries a contiguous range
// of its rows, and they are assembled in place into one buffer of all `total_rows` rows, so no
// stream's rows are copied a second time to join them. Streams call Add from their own threads;
// Finish runs once every stream is done adding (the caller orders the two).
//
// Sizing, as TensorAssembler's: kClaimedAtOnce allocates the whole tensor on the first chunk of
// any stream (the client, whose server answers for shapes it asked for); with
// kClaimedOnceAnEighthArrived each stream keeps its bytes until an eighth of the whole has
// arrived on all streams together, then they move into place and later bytes go straight there
// (the server: at most 8x what its peers have sent is ever reserved). kGrow is not supported.
class StripedAssembler {
 public:
  using Sizing = TensorAssembler::Sizing;
  StripedAssembler(std::string field, Sizing sizing, int64_t total_rows)
      : field_(std::move(field)), sizing_(sizing), total_rows_(total_rows) {}

  // A chunk of stream `stream`'s rows [row_begin, row_begin + chunk.shape[0]): `chunk` gives
  // dtype, shape and the offset of its bytes within the stream's rows, its bytes are `pieces`.
  // InvalidArgument naming the field when the dtype is unknown, the shape or the whole tensor
  // leaves CheckedByteSize's bounds, the dtype or the extents past the first differ from another
  // stream's, the rows leave [0, total_rows) or overlap another stream's, the offset is not the
  // bytes this stream has sent so far, or the stream sends more bytes than its rows hold. A
  // refused chunk changes nothing.
  absl::Status Add(uint32_t stream, int64_t row_begin, const v1::Tensor& chunk,
                   absl::Span<const absl::string_view> pieces);
  // Whether any stream carried this tensor.
  bool seen() const;
  // The whole tensor, [total_rows, ...]. Checks that some stream carried it, exactly `streams`
  // streams, each all its rows' bytes, and that their rows tile [0, total_rows) (InvalidArgument
  // naming the field). Afterwards the assembler holds no bytes.
  absl::StatusOr<Tensor> Finish(uint32_t streams);

 private:
  struct Stream {
    int64_t row_begin = 0;
    int64_t rows = 0;
    size_t received = 0;
    TensorBytes pending;  // bytes held until the whole tensor is allocated
  };
  // Allocates the whole tensor and moves the pending bytes into place. Under mu_.
  void AllocateLocked();
  std::string field_;
  Sizing sizing_;
  int64_t total_rows_;
  mutable std::mutex mu_;
  bool seen_ = false;
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;  // of the first chunk seen; [0] is that stream's rows
  size_t row_bytes_ = 0;
  size_t arrived_ = 0;
  bool allocated_ = false;
  TensorBytes whole_;
  std::map<uint32_t, Stream> streams_;
};

// A piece of a tensor to put into one message.
struct Piece {
  int tensor = 0;  // index into the tensors' sizes
  size_t offset = 0;
  size_t size = 0;
};

// How tensors of the given byte sizes are cut into messages of at most `max_chunk_bytes` payload
// each (0 counts as 1): message m carries bytes [m * max_chunk_bytes, (m + 1) * max_chunk_bytes)
// of the tensors laid end to end in order, and there is at least one message, even when every
// tensor is empty. Worked out per message, so a tiny chunk size a peer asks for costs no memory
// up front.
class ChunkPlan {
 public:
  ChunkPlan() = default;  // no messages
  ChunkPlan(std::vector<size_t> sizes, size_t max_chunk_bytes);
  size_t size() const { return messages_; }
  // The pieces of message m, in tensor order.
  std::vector<Piece> Pieces(size_t m) const;
  // The bytes of tensor `tensor` in the messages before m: its `offset` in message m.
  size_t Offset(int tensor, size_t m) const;

 private:
  std::vector<size_t> sizes_;
  std::vector<size_t> starts_;  // of each tensor, laid end to end
  size_t chunk_ = 1;
  size_t messages_ = 0;  // none in a default-made plan
};

// Every message's pieces at once (ChunkPlan's Pieces for each m): result[m] lists message m's.
std::vector<std::vector<Piece>> PlanChunks(const std::vector<size_t>& sizes,
                                           size_t max_chunk_bytes);

}  // namespace moe::wire

#endif  // MOE_WIRE_WIRE_H_
