// One Forward or Backward stream of the client (internal to the library; client.h does not
// include it): the request messages of requests.h written on a raw bidirectional stream, the
// response tensors assembled as they arrive, the result handed to a callback.
//
// Each stream is a heap-allocated gRPC callback reactor (ClientBidiReactor) that deletes itself
// when the call ends, so the caller's thread never waits unless it asks the future it was given.
// A whole micro-batch goes on a long-lived stream of its connection (StreamLink), which carries
// the connection's micro-batches one after another; a striped one is several streams of its own,
// which share their outputs (striping.cc).
//
// Why long-lived: opening a stream and ending it cost two extra round trips between client and
// server threads per micro-batch; where the tensors go by reference that was most of a call's
// time outside the engine (docs/decisions/0017-long-lived-streams.md).
#ifndef MOE_CLIENT_STREAM_CALL_H_
#define MOE_CLIENT_STREAM_CALL_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/requests.h"
#include "common/tensor.h"
#include "moe/v1/moe.pb.h"
#include "wire/raw_message.h"
#include "wire/wire.h"

namespace moe::client {

// Where one stream's response tensors go: the call's own assemblers (a whole micro-batch), or
// its rows of a striped micro-batch's outputs, which its streams share and assemble in place
// (wire::StripedAssembler), so no stream's rows are copied again to join them.
struct ResponseTensors {
  // A result the server wrote where the call asked (a destination by reference): the response
  // carries its dtype and shape, no bytes.
  struct Written {
    bool seen = false;
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
  };
  std::vector<wire::TensorAssembler> whole;
  std::shared_ptr<std::deque<wire::StripedAssembler>> striped;
  uint32_t stream = 0;
  int64_t row_begin = 0;
  std::vector<std::string> names;  // of a whole micro-batch's tensors, for errors
  // Per tensor of a whole micro-batch: the reference the call named for it (none: its bytes come
  // in the response), and what the server said it wrote there.
  std::vector<std::optional<v1::TensorRef>> by_ref;
  std::vector<Written> written;

  // For a whole micro-batch: the server answers for shapes this call set, so each tensor is
  // reserved on its first chunk. `by_ref[i]` set: tensor i is written there, and the response
  // must say so.
  static std::shared_ptr<ResponseTensors> Whole(
      absl::Span<const char* const> names,
      const std::vector<std::optional<v1::TensorRef>>& by_ref = {});
  // For stream `stream` of a striped micro-batch, whose rows start at `row_begin`.
  static std::shared_ptr<ResponseTensors> Stripe(
      std::shared_ptr<std::deque<wire::StripedAssembler>> outputs, uint32_t stream,
      int64_t row_begin);
  // The outputs a striped micro-batch's streams share.
  static std::shared_ptr<std::deque<wire::StripedAssembler>> Shared(
      absl::Span<const char* const> names, int64_t total_rows);

  // Response tensor `i`, top-level field `field`, if the message carries it.
  absl::Status AddIfPresent(size_t i, bool present, const v1::Tensor& proto, int field,
                            const wire::IncomingMessage& in);
  // Moves whole tensor `i` into `*out` (a striped stream's rows are finished by the merge). A
  // tensor no response carried is an error when `required`, and leaves `*out` empty otherwise;
  // so does one written by reference (`written` says what).
  absl::Status FinishInto(size_t i, bool required, Tensor* out);
};

// The response tensors of a Forward and of a Backward, in the order ResponseTensors indexes
// them.
inline constexpr const char* kForwardResponseTensors[] = {"out", "expert_ids", "weights"};
inline constexpr const char* kBackwardResponseTensors[] = {"dx", "dweights"};

// One of a connection's TCP connections (ClientOptions::connections): the raw-buffer stub of its
// Forward and Backward streams, and the long-lived streams open on it. A stream carries one
// micro-batch at a time (the server answers a stream's micro-batches in order, so a failure
// would also fail those queued behind it). A micro-batch takes an idle stream of any of the
// connection's links (they share one Streams), or opens one on the link it was given: calls one
// after another reuse one stream, and calls in flight together spread over the connections as
// the links are taken in turn. Deadline: a stream is opened with twice ClientOptions::timeout and
// takes no micro-batch after the first timeout, so each micro-batch gets at least the timeout.
// Thread-safe; the streams hold their link.
class StreamLink : public std::enable_shared_from_this<StreamLink> {
 public:
  struct Streams;  // the idle streams of a connection's links (stream_call.cc)
  static std::shared_ptr<Streams> NewStreams();
  StreamLink(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<Streams> streams);
  ~StreamLink();
  StreamLink(const StreamLink&) = delete;
  StreamLink& operator=(const StreamLink&) = delete;

  grpc::GenericStub& stub() { return stub_; }
  // The connection is going away: ends the idle streams at once and each busy one once its
  // micro-batch is answered, waiting up to `wait` for them to go.
  void ShutDown(std::chrono::milliseconds wait);

  Streams& streams() { return *streams_; }
  const std::shared_ptr<Streams>& shared_streams() const { return streams_; }

 private:
  grpc::GenericStub stub_;
  std::shared_ptr<Streams> streams_;
};

// Sees a stream's context before the stream starts (a striped call cancels the other streams
// when one fails).
using TrackContext = std::function<void(grpc::ClientContext*)>;

// Runs a Forward or Backward on `link` with `conn`'s deadline and metadata: it sends `rows` of
// `tensors` by reference to them, puts the response's tensors into `outputs` and reports the
// result to `done`. A whole micro-batch without `track` goes on a long-lived stream; anything
// else on a stream of its own.
void StartForwardStream(const Connection& conn, StreamLink& link, const ForwardCall& call,
                        std::shared_ptr<const std::vector<Tensor>> tensors, const StreamRows& rows,
                        std::shared_ptr<ResponseTensors> outputs,
                        std::function<void(absl::StatusOr<ForwardOutput>)> done,
                        TrackContext track = nullptr);
void StartBackwardStream(const Connection& conn, StreamLink& link, const BackwardCall& call,
                         std::shared_ptr<const std::vector<Tensor>> tensors, const StreamRows& rows,
                         std::shared_ptr<ResponseTensors> outputs,
                         std::function<void(absl::StatusOr<BackwardOutput>)> done,
                         TrackContext track = nullptr);

}  // namespace moe::client

#endif  // MOE_CLIENT_STREAM_CALL_H_
