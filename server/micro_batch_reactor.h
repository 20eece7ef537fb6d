// The reactor Forward and Backward share (forward_reactor.cc, backward_reactor.cc): one
// bidirectional stream of micro-batches. It reads chunks until `last_chunk`, hands the assembled
// micro-batch to the device executor, writes the response chunks, then reads the next
// micro-batch. Exactly one operation is outstanding at a time, so the reactor needs no lock for
// its own state; a failure finishes the stream with that micro-batch's status.
//
// It reads and writes raw buffers (the service registers Forward and Backward as raw methods):
// each request is split into its small fields, parsed as `Req`, and its tensors' bytes, which are
// copied once into the assembled inputs; responses are encoded by reference (wire/raw_message.h).
//
// A striped micro-batch (moe.proto `Stripe`, stripe_join.h) is one reactor per stream: each
// copies its rows straight into the micro-batch's inputs, which the streams share (assembled in
// place, wire::StripedAssembler), and the stream that arrives last runs the micro-batch on the
// executor once and hands each stream its rows of the result to send.
//
// What a micro-batch may hold or do is decided in one place, the admission section below: the
// caller's right to the layer and session at the first message, and every message's tensors
// charged to the memory ledger before they are copied in.
//
// A micro-batch may name tensors and destinations by reference, in regions the caller's session
// registered (docs/PROTOCOL.md, "Registered memory regions"): such a micro-batch is one message
// (wire::ReadReferences), its referenced tensors are neither assembled nor charged (they are the
// client's memory), and the derived reactor resolves them on the executor (Bind) into views the
// engine reads and writes in place; the response then carries each destination written in place
// as its dtype, shape and reference, with no bytes.
#ifndef MOE_SERVER_MICRO_BATCH_REACTOR_H_
#define MOE_SERVER_MICRO_BATCH_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "engine/layer.h"
#include "moe/v1/moe.pb.h"
#include "server/held_bytes.h"
#include "server/memory_ledger.h"
#include "server/region_registry.h"
#include "server/service.h"
#include "server/service_internal.h"
#include "server/stripe_join.h"
#include "wire/raw_message.h"
#include "wire/wire.h"

namespace moe::server {

// A micro-batch's response (wire/raw_message.h): the result tensors, kept until the last message
// that refers to them is sent, cut into messages of at most the requested payload bytes. Message m
// is encoded only when it is about to be written (the first on the executor, the others in
// OnWriteDone), so the device executor hands the tensors over and takes the next micro-batch at
// once; and the encoding refers to the tensors' bytes instead of copying them into protobuf's
// strings and again into gRPC's buffers (docs/decisions/0007-lazy-response-encoding.md).
template <typename Resp>
using ChunkedResponse = wire::ChunkedMessages<Resp>;

// What a micro-batch computed: its result tensors (each [T, ...] or empty) and the response's
// small fields; shared by the streams of a striped micro-batch, each of which sends its rows.
template <typename Resp>
struct Computed {
  std::shared_ptr<const std::vector<Tensor>> tensors;
  typename ChunkedResponse<Resp>::Header header;
};

template <typename Req, typename Resp>
class MicroBatchReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                          public StripeJoin::Part {
 public:
  // An input tensor of Req: its field number and name, whether a micro-batch must carry it,
  // how its buffer is sized, and whether it indexes memory (expert_ids): such an input given by
  // reference in host memory is copied into the server's memory before the engine checks it, so
  // no change the client makes meanwhile can lead the engine out of bounds.
  struct Input {
    int field;
    const char* name;
    bool required;
    wire::TensorAssembler::Sizing sizing;
    bool indexes = false;
  };

  // What the engine gets for a micro-batch (Bind): its inputs, those given by reference resolved
  // to the region's memory; the destinations the client named; the stream order of its event
  // pair. Holds the call's regions (mapped while it lives) and its event pair.
  struct Bound {
    std::vector<TensorView> inputs;
    std::vector<MutableTensorView> destinations;  // per destination field; empty: in the response
    StreamOrder order;
    RegionRegistry::Call call;
    std::vector<Tensor> copies;  // indexing inputs copied out of host regions
  };

  MicroBatchReactor(ExpertServiceImpl* service, grpc::CallbackServerContext* ctx,
                    const char* method, std::vector<Input> inputs, std::vector<int> output_fields);

  // A caller that does not authenticate gets its status before any message is read. The derived
  // reactor's constructor calls it last.
  void Start();

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  // A stream of a striped micro-batch cancelled while it waits for the others is answered by
  // the join (nothing else would wake it); the streams still reading see their reads fail.
  void OnCancel() override;
  void OnDone() override;
  void AbortStripe(const absl::Status& status) override;

 protected:
  // The first message of a micro-batch: the derived reactor's own small fields.
  virtual absl::Status ReadHeader(const Req& first) = 0;
  // A later message: those fields must not change.
  virtual absl::Status CheckSame(const Req& chunk) const = 0;
  // Input i's proto tensor in `chunk`, or nullptr when the message does not carry it.
  virtual const v1::Tensor* InputOf(const Req& chunk, size_t i) const = 0;
  // The fields every stream of a striped micro-batch must repeat: their names (for the error)
  // and values.
  virtual std::pair<std::string, std::string> StripeHeader() const = 0;
  // Runs the micro-batch on the executor: `inputs` in the order of the Inputs (empty views for
  // absent ones), `calls` every stream that carried it (one unless striped).
  virtual absl::StatusOr<Computed<Resp>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>& calls) = 0;

  bool striped() const { return stripe_.count() != 0; }
  // The micro-batch's references (wire/raw_message.h): input i's (in the order of the Inputs),
  // and the one the client named for destination field j of Req; null when there is none.
  const wire::ResolvedTensor* InputRef(size_t i) const;
  const v1::TensorRef* DestinationRef(size_t j) const;
  // Resolves the micro-batch's references in the caller's session (RegionRegistry::ResolveCall:
  // NotFound, or InvalidArgument naming the reference, or FailedPrecondition for a lost region or
  // a busy event pair). `destinations` has an entry per destination field: what the server
  // writes to the reference the client named there (wire::DestinationTensor), nullopt for none.
  // Without references, the inputs pass through unchanged. Call on the executor, before the
  // engine; after it, the call's CheckIntact says whether its results may be returned.
  absl::StatusOr<Bound> Bind(const std::vector<TensorView>& inputs,
                             const std::vector<std::optional<wire::ResolvedTensor>>& destinations);
  // The response's tensor for each destination written in place: dtype, shape and reference,
  // no bytes; nullopt for a destination the response carries.
  std::vector<std::optional<v1::Tensor>> WrittenInPlace(const Bound& bound) const;
  // Room for `bytes` of input i before its first chunk, charged to the memory ledger first
  // (ResourceExhausted, nothing reserved, when it does not fit). Part of admission (below).
  absl::Status ReserveInput(size_t i, int64_t bytes);
  wire::TensorAssembler& assembler(size_t i) { return assemblers_[i]; }
  const Caller& caller() const { return *caller_; }  // authenticated once Start() reads

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  const std::string method_;
  const std::string session_;
  const absl::StatusOr<Caller> caller_;
  std::string layer_;
  uint64_t context_id_ = 0;

 private:
  using Self = MicroBatchReactor<Req, Resp>;

  // Finishes the stream with `status`; a striped micro-batch still collecting fails with it on
  // every stream.
  void Fail(const absl::Status& status);
  // This stream's call was cancelled; the message says which stripe, for the other streams.
  absl::Status Cancelled();

  // --- Reading a micro-batch ---
  // The message's references (all on the first message, none later).
  absl::Status ReadMessageReferences(bool first);
  absl::Status BeginBatch();
  absl::Status CheckSameBatch() const;
  absl::Status AddInputs();
  absl::Status FinishInputs();
  void ResetInputs();

  // --- Admission: whether this micro-batch may hold memory and run ---
  // At its first message, before a byte of its tensors is buffered: the caller may train the
  // layer (Compute checks again, on the executor, against the layer it runs on) and another
  // principal's session is refused (not-open is left to the work that needs the session).
  absl::Status AdmitBatch();
  // Charges this message's tensors to the memory ledger before they are copied in (HeldBytes);
  // past the budget the micro-batch fails with ResourceExhausted and nothing of it is added.
  absl::Status ChargeInputs();

  // --- Striping ---
  // Counts this stream out of its join; returns the join (null when not striped).
  std::shared_ptr<StripeJoin> LeaveJoin();
  void ArriveStriped();
  // The striped micro-batch's whole inputs, once all `streams` streams have arrived.
  absl::StatusOr<std::vector<Tensor>> FinishShared(uint32_t streams);

  // --- Running and answering ---
  void RunAlone();
  // Starts sending this stream's rows of `computed` (all of it unless striped).
  void Send(const Computed<Resp>& computed);

  const std::vector<Input> inputs_;
  std::vector<int> input_fields_;
  const std::vector<int> output_fields_;
  std::vector<wire::TensorAssembler> assemblers_;  // unless striped
  std::vector<TensorView> views_;  // the assembled inputs, from the last message to the compute
  grpc::ByteBuffer buffer_;        // the request being read
  wire::IncomingMessage incoming_;
  Req request_;  // its small fields
  int64_t chunk_ = kDefaultResponseChunkBytes;
  ChunkedResponse<Resp> response_;
  grpc::ByteBuffer message_;  // the message being written: response_'s message next_
  size_t next_ = 0;
  bool in_batch_ = false;
  Clock::time_point receive_start_;
  Clock::time_point send_start_;
  // Striping: this stream's rows, which inputs it carried, the inputs its micro-batch's streams
  // share, and its join (read by OnCancel on any thread).
  int64_t row_begin_ = 0;
  int64_t rows_ = 0;
  std::vector<bool> stream_carries_;
  // Admission: what the inputs of the micro-batch being read hold, and its charge to the memory
  // ledger.
  std::vector<HeldBytes> held_;
  MemoryLedger::RequestCharge charge_;
  // References: the micro-batch's, and what Bind resolved, for the transport metrics once it is
  // answered.
  wire::MessageReferences refs_;
  const char* transport_ = "tcp";
  int64_t referenced_in_bytes_ = 0;
  int64_t referenced_out_bytes_ = 0;
  std::shared_ptr<std::deque<wire::StripedAssembler>> shared_inputs_;
  std::mutex join_mu_;
  v1::Stripe stripe_;
  std::shared_ptr<StripeJoin> join_;
  std::string join_key_;
};

// The two instantiations, compiled once in micro_batch_reactor.cc.
extern template class MicroBatchReactor<v1::ForwardRequest, v1::ForwardResponse>;
extern template class MicroBatchReactor<v1::BackwardRequest, v1::BackwardResponse>;

}  // namespace moe::server

#endif  // MOE_SERVER_MICRO_BATCH_REACTOR_H_
