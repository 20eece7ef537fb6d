// moe::client: the library a trainer links to run its MoE layers on one or several moe-servers.
//
//   auto conn = moe::client::Connection::Connect("localhost:50051");
//   auto layer = moe::client::RemoteLayer::Create(*conn, "moe0", config);
//   auto fut = (*layer)->Forward(x, ids, p);        // several may be in flight at once
//   auto fwd = fut.get();                           // absl::StatusOr<ForwardOutput>
//   auto bwd = (*layer)->Backward(fwd->context_id, dout).get();
//   auto step = (*layer)->Step();
//
// Every call carries a deadline (ClientOptions::timeout; a whole Forward or Backward gets between
// one and two timeouts, see StreamLink). Errors are absl::Status with the server's code and
// message. Tensors larger than ClientOptions::chunk_bytes are split into several messages
// (docs/PROTOCOL.md, "Chunking") and responses reassembled. Each Forward or Backward in flight
// has a bidirectional stream to itself, so micro-batches in flight do not wait on each other;
// the streams of whole micro-batches stay open for the next ones (stream_call.h); a Connection
// also holds one OpenSession stream, so the server frees this client's
// saved contexts when the client goes away.
//
// A trainer on the server's host can skip TCP for the tensors (ClientOptions::transport): host
// tensors then travel through POSIX shared memory the connection registered, device tensors
// (TensorView::location cuda:N, in a client built with CUDA) by CUDA IPC in the trainer's own
// memory, ordered on its CUDA stream; ForwardInto and BackwardInto write results straight into
// the caller's host or device memory (docs/PROTOCOL.md, "Registered memory regions").
//
// Received tensors are large fresh buffers; under glibc's default malloc each is page-faulted
// in anew. A trainer should call moe::RetainFreedHeapMemory() (common/host_memory.h) first thing
// in main, or set the GLIBC_TUNABLES given there (docs/decisions/0005-retained-heap-memory.md).
// The library does not do it itself: it is the whole process's allocator.
//
// This is the library's one public header. Its implementation: connection.cc (channels,
// credentials, deadlines, unary calls), striping.cc (Forward and Backward over TCP: whole or
// striped over the connections), region_calls.cc (Forward and Backward through registered
// regions, device tensors, destinations), data_plane.cc (the regions and event pairs a
// connection registered), device_cuda.cc / device_none.cc (the client's CUDA calls, with and
// without CUDA), nccl_channel.cc and nccl_calls.cc (device tensors over an NCCL channel), and
// nccl_link_cuda.cc / nccl_link_none.cc (its communicators, with and without NCCL),
// stream_call.cc (one Forward or Backward stream), requests.cc (the one place that
// fills Forward and Backward requests), remote_layer.cc (RemoteLayer and the session that holds
// its contexts), sharded_layer.cc (ShardedLayer), sharded_device_cuda.cc / sharded_device_none.cc
// and shard_rows_cuda.cu (its device tensors, with and without CUDA); the headers beside those
// are internal.
#ifndef MOE_CLIENT_CLIENT_H_
#define MOE_CLIENT_CLIENT_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/layer_config.h"
#include "common/tensor.h"
#include "moe/v1/moe.grpc.pb.h"
#include "wire/tls.h"

namespace moe::client {

class DataPlane;     // data_plane.h
class ShardedDevice;  // sharded_device.h
class StreamLink;    // stream_call.h
struct ForwardCall;  // requests.h
struct BackwardCall;

// How Forward and Backward move their tensors (docs/PROTOCOL.md, "Registered memory regions").
enum class Transport {
  // Shared memory when the server is on this host (a loopback or unix: target) and registers a
  // region; TCP otherwise (another host, a server that refuses: permission, an older server,
  // no session). Connect logs one line saying which and why.
  kAuto,
  kTcp,  // the tensors' bytes in the gRPC messages
  // Registered regions: host tensors through POSIX shared memory regions the connection creates
  // and registers (one per micro-batch in flight, sized to the largest seen), device tensors by
  // CUDA IPC in the caller's own memory. Connect fails if the server will not register one.
  kSharedMemory,
};
// "auto", "tcp", "shared memory".
const char* TransportName(Transport transport);

// Whether device tensors may go over NCCL (ClientOptions::device_transport).
enum class DeviceTransportRequest {
  // NCCL when the server is on another host (a target that is not loopback or unix:) and this
  // client was built with NCCL; otherwise as `transport` decides.
  kAuto,
  // NCCL whatever the target (a server on this host with another GPU, say).
  kNccl,
  kNever,  // as `transport` decides: CUDA IPC or staged through host memory
};

// How a connection moves device tensors (TensorView::location cuda:N).
enum class DeviceTransport {
  kUnavailable,  // the client was built without CUDA: device tensors are InvalidArgument
  kUndecided,    // kAuto, until the first call with a device tensor tries CUDA IPC
  kCudaIpc,      // in place by CUDA IPC, ordered on the caller's stream by event pairs
  kStaged,       // copied through host memory on the caller's stream (the host transport)
  kNccl,         // GPU to GPU over the connection's NCCL channel (docs/PROTOCOL.md, "NCCL channels")
};
// "unavailable", "undecided", "cuda ipc", "staged", "nccl".
const char* DeviceTransportName(DeviceTransport transport);

struct ClientOptions {
  std::chrono::milliseconds timeout{30000};  // deadline of every call (see above)
  int64_t chunk_bytes = int64_t{1} << 20;    // tensor payload per request message
  int64_t max_receive_bytes = int64_t{256} << 20;
  bool open_session = true;  // tie saved contexts to this connection
  // TCP connections to the server that Forward and Backward calls take in turn (unary calls and
  // the session use the first). One connection carries a large tensor at a few GB/s on loopback
  // whatever the host, and every call on it shares that; micro-batches in flight on different
  // connections move their tensors side by side (docs/SERVICE_PERFORMANCE.md).
  int connections = 8;
  // A Forward or Backward whose request tensors hold at least twice this many bytes is striped:
  // sent as up to `connections` streams at once, one per connection, each with a contiguous
  // range of the micro-batch's rows and at least this many bytes (moe.proto `Stripe`); the
  // server runs the micro-batch once, so results and gradients are those of one call. 0 never
  // stripes.
  int64_t stripe_bytes = int64_t{8} << 20;
  // Plaintext unless set: TLS to a server started with a certificate, mutual TLS with this
  // client's own certificate as well (wire/tls.h; docs/OPERATIONS.md, "Transport security").
  wire::ClientTls tls;
  // The bearer token of this client's principal, for a server started with --tokens_file: sent
  // as "authorization: Bearer <token>" on every call, the session's included. Empty: none (the
  // server then knows the client by its TLS certificate, or has authentication off).
  std::string token;
  // How Forward and Backward move tensors (Transport). Registered regions need the session.
  Transport transport = Transport::kTcp;
  // Whether ForwardInto / BackwardInto calls whose tensors and destinations (out, dx) are all on
  // one CUDA device move them over an NCCL channel to the server's GPU (gRPC carrying control
  // only). The first such call opens the channel; if that fails, device tensors are staged
  // through host memory from then on, and the connection logs one line saying why. A failed
  // NCCL call ends the channel, and the next call opens a new one.
  DeviceTransportRequest device_transport = DeviceTransportRequest::kAuto;
  // Where the connection's one-line transport decisions go (kAuto and kSharedMemory); null:
  // standard error.
  std::function<void(const std::string&)> log;
};

// The bearer token a file holds (ClientOptions::token), surrounding whitespace removed;
// InvalidArgument naming `field` and the path when it cannot be read or is empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& field);

// grpc::Status -> absl::Status, code and message unchanged.
absl::Status FromGrpcStatus(const grpc::Status& status);

struct ForwardOutput {
  uint64_t context_id = 0;
  Tensor out;         // [T, d]
  Tensor expert_ids;  // [T, K] int32, the routing the server chose; empty with client routing
  Tensor weights;     // [T, K] float32, likewise
  double aux_loss = 0;
  double z_loss = 0;
};

// What a Backward says besides its tensors.
struct BackwardOptions {
  // d loss / d aux (server routing): the weight with which the trainer's loss uses the Forward's
  // aux_loss + z_loss; the server adds their gradient times this (1: loss = task + aux + z; 0:
  // not trained). Sent only when it is not 1, so a server that predates it gets the same
  // request as before.
  double aux_loss_grad = 1.0;
};

struct BackwardOutput {
  Tensor dx;        // [T, d]
  Tensor dweights;  // [T, K] float32 (client routing), else empty
};

struct StepOutput {
  int64_t step = 0;
  double grad_norm = 0;
  int64_t expert_first = 0;
  std::vector<int64_t> tokens_per_expert;
};

// One server.
class Connection {
 public:
  // Connects (waiting up to the timeout for the channel) and opens the session.
  static absl::StatusOr<std::shared_ptr<Connection>> Connect(const std::string& target,
                                                             ClientOptions options = {});
  ~Connection();  // ends the session: the server frees its contexts

  const std::string& target() const { return target_; }
  const std::string& session_id() const { return session_id_; }
  const ClientOptions& options() const { return options_; }
  // The transport of host tensors, decided at Connect: kTcp or kSharedMemory, never kAuto; and
  // why ("requested", or kAuto's reason).
  Transport transport() const;
  const std::string& transport_reason() const;
  DeviceTransport device_transport() const;

  // grpc.health.v1 Check of `service` ("" = the whole server). OK only when SERVING.
  absl::Status Health(const std::string& service = "");

  // `shared_with`: principals that may read and train the layer besides its creator
  // (moe.proto CreateLayerRequest.shared_with).
  absl::StatusOr<v1::LayerInfo> CreateLayer(const std::string& name, const LayerConfig& config,
                                            bool attach_if_exists = false,
                                            const std::vector<std::string>& shared_with = {});
  absl::StatusOr<v1::LayerInfo> GetLayer(const std::string& name);
  absl::StatusOr<std::vector<v1::LayerInfo>> ListLayers();
  absl::Status DeleteLayer(const std::string& name);
  absl::StatusOr<v1::StatsResponse> GetStats();

  // `ids`, `weights` empty for server routing. `training` keeps a context under `context_id`.
  // Forward and Backward copy the host tensors they are given before they return (so the caller
  // may reuse them at once): over TCP into the call's own buffers, which the messages refer to,
  // with shared memory into the connection's region the server reads. The call runs on one of
  // the connection's `connections` TCP connections. Device tensors go as ForwardInto says, their
  // results coming back in host memory.
  std::future<absl::StatusOr<ForwardOutput>> Forward(const std::string& layer, uint64_t context_id,
                                                     bool training, const TensorView& x,
                                                     const TensorView& ids,
                                                     const TensorView& weights);
  std::future<absl::StatusOr<BackwardOutput>> Backward(const std::string& layer,
                                                       uint64_t context_id, const TensorView& dout,
                                                       const BackwardOptions& options = {});
  // The same, taking the tensors over instead of copying them (for a trainer that has no more
  // use for them once they are sent: the copy of a 75 MB tensor costs about 3 ms on the H100
  // machine). An empty tensor is an absent one.
  std::future<absl::StatusOr<ForwardOutput>> Forward(const std::string& layer, uint64_t context_id,
                                                     bool training, Tensor&& x, Tensor&& ids,
                                                     Tensor&& weights);
  std::future<absl::StatusOr<BackwardOutput>> Backward(const std::string& layer,
                                                       uint64_t context_id, Tensor&& dout,
                                                       const BackwardOptions& options = {});

  // Forward and Backward whose results go into the caller's memory, and whose tensors may live
  // on a CUDA device (TensorView::location cuda:N; one device per call). A destination must have
  // the result's dtype and shape (out and dx: those of x and dout; dweights: [T, K] float32);
  // an empty one means "return it" (ForwardOutput::out etc.), and a written one comes back
  // empty. Without CUDA in this client, a device tensor is InvalidArgument naming its field.
  //
  // `stream` is the caller's cudaStream_t that produces the device inputs and consumes the
  // device results (null: the legacy default stream of their device). By CUDA IPC
  // (device_transport() kCudaIpc) the server reads the inputs after the work `stream` had
  // enqueued when the call was made, and work enqueued on `stream` once the future is ready runs
  // after the results are written, with no host wait on the GPU. Until the future is ready the
  // call's device tensors must stay allocated and unchanged and nothing may read the
  // destinations; the inputs' CUDA allocations must be cudaMalloc'd (not a stream-ordered
  // pool's) and each tensor must start a multiple of 16 bytes into its allocation. Staged
  // (kStaged), the inputs are copied to host memory on `stream` before the call returns and the
  // results onto `stream` before the future is ready. Host destinations are written before the
  // future is ready. With TCP for host tensors, a call that also names device tensors by CUDA
  // IPC is one message, so its host tensors must fit the server's message size. Over NCCL
  // (ClientOptions::device_transport; a call whose tensors and destinations out, dx and any
  // dweights are all on one device) the ordering on `stream` is CUDA IPC's, with no alignment or
  // allocator rule; a failed call may have written the destinations (they then hold zeros).
  std::future<absl::StatusOr<ForwardOutput>> ForwardInto(
      const std::string& layer, uint64_t context_id, bool training, const TensorView& x,
      const TensorView& ids, const TensorView& weights, const MutableTensorView& out,
      void* stream);
  std::future<absl::StatusOr<BackwardOutput>> BackwardInto(
      const std::string& layer, uint64_t context_id, const TensorView& dout,
      const MutableTensorView& dx, const MutableTensorView& dweights, void* stream,
      const BackwardOptions& options = {});
  // Registered regions keep the server's mapping of a device allocation until the connection
  // ends: a trainer that frees device memory (say, empties its allocator's cache) calls this to
  // unregister every cached device region no call in flight uses.
  absl::Status ReleaseIdleDeviceRegions();

  absl::StatusOr<StepOutput> Step(const std::string& layer);
  absl::Status ZeroGrad(const std::string& layer);

  absl::StatusOr<std::map<std::string, Tensor>> ExportWeights(const std::string& layer,
                                                              bool include_optimizer);
  absl::Status ImportWeights(const std::string& layer, const std::map<std::string, Tensor>& state);
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(const std::string& layer,
                                                            const std::string& path);
  // `shared_with` applies when the checkpoint creates the layer.
  absl::StatusOr<v1::LayerInfo> LoadCheckpoint(const std::string& layer, const std::string& path,
                                               const std::vector<std::string>& shared_with = {});

  // The region calls of ExpertService, with this connection's session (which owns what they
  // register). Forward and Backward make and use their own; these are for a trainer that
  // manages regions itself.
  absl::StatusOr<v1::RegisterRegionResponse> RegisterRegion(const v1::RegisterRegionRequest& req);
  absl::Status UnregisterRegion(uint64_t region_id);
  // `wait_event_handle`: the cudaIpcEventHandle_t of the caller's interprocess event.
  absl::StatusOr<v1::RegisterEventsResponse> RegisterEvents(const std::string& wait_event_handle);
  absl::Status UnregisterEvents(uint64_t event_id);

  // A context id unique to this connection (random prefix, counter).
  uint64_t NextContextId();
  v1::ExpertService::Stub* stub() { return stub_.get(); }
  // A ClientContext with this connection's deadline, session and token metadata.
  void Prepare(grpc::ClientContext* ctx) const;

 private:
  class SessionCall;  // remote_layer.cc: the OpenSession stream
  Connection() = default;
  // Opens the session (Connect, with ClientOptions::open_session) and ends it (the destructor):
  // remote_layer.cc.
  absl::Status OpenSession();
  void CloseSession();
  // The token metadata alone (Prepare's; the session's stream has no deadline).
  void AddToken(grpc::ClientContext* ctx) const;
  // The TCP connection next in turn, for a Forward or Backward (client/stream_call.h).
  StreamLink& NextLink() { return *links_[next_link_++ % links_.size()]; }
  // A Forward or Backward over TCP, whole or striped, its result handed to `done` (striping.cc).
  void StartTcpForward(const ForwardCall& call, Tensor&& x, Tensor&& ids, Tensor&& weights,
                       std::function<void(absl::StatusOr<ForwardOutput>)> done);
  void StartTcpBackward(const BackwardCall& call, Tensor&& dout,
                        std::function<void(absl::StatusOr<BackwardOutput>)> done);

  std::string target_;
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ExpertService::Stub> stub_;
  // Forward and Backward as raw buffers (wire/raw_message.h), one link per TCP connection (the
  // first on channel_), taken in turn; each holds its long-lived streams.
  std::vector<std::shared_ptr<StreamLink>> links_;
  std::vector<std::shared_ptr<grpc::Channel>> extra_channels_;
  std::atomic<uint64_t> next_link_{0};
  std::string session_id_;
  SessionCall* session_ = nullptr;
  // The regions and event pairs registered for Forward and Backward; shared with their calls in
  // flight.
  std::shared_ptr<DataPlane> plane_;
  uint64_t context_prefix_ = 0;
  std::atomic<uint64_t> context_counter_{0};
};

// A layer on one server.
class RemoteLayer {
 public:
  // Creates the layer (shared with `shared_with`, besides this client's principal), or attaches
  // to an existing one with an identical config that this client's principal may train.
  static absl::StatusOr<std::unique_ptr<RemoteLayer>> Create(
      std::shared_ptr<Connection> conn, const std::string& name, const LayerConfig& config,
      const std::vector<std::string>& shared_with = {});
  // Attaches to an existing layer (NotFound if there is none).
  static absl::StatusOr<std::unique_ptr<RemoteLayer>> Attach(std::shared_ptr<Connection> conn,
                                                             const std::string& name);

  const std::string& name() const { return name_; }
  const LayerConfig& config() const { return config_; }
  Connection& connection() { return *conn_; }

  // Training forwards get a fresh context id (ForwardOutput::context_id) for their Backward.
  std::future<absl::StatusOr<ForwardOutput>> Forward(const TensorView& x,
                                                     const TensorView& ids = {},
                                                     const TensorView& weights = {},
                                                     bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id, const TensorView& dout,
                                                       const BackwardOptions& options = {});
  // The same, taking the tensors over instead of copying them (Connection::Forward's).
  std::future<absl::StatusOr<ForwardOutput>> Forward(Tensor&& x, Tensor&& ids, Tensor&& weights,
                                                     bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id, Tensor&& dout,
                                                       const BackwardOptions& options = {});
  // Results into the caller's memory, tensors possibly on a CUDA device, ordered on `stream`
  // (Connection::ForwardInto's).
  std::future<absl::StatusOr<ForwardOutput>> ForwardInto(const TensorView& x,
                                                         const TensorView& ids,
                                                         const TensorView& weights,
                                                         const MutableTensorView& out,
                                                         void* stream = nullptr,
                                                         bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> BackwardInto(uint64_t context_id,
                                                           const TensorView& dout,
                                                           const MutableTensorView& dx,
                                                           const MutableTensorView& dweights = {},
                                                           void* stream = nullptr,
                                                           const BackwardOptions& options = {});
  absl::StatusOr<StepOutput> Step() { return conn_->Step(name_); }
  absl::Status ZeroGrad() { return conn_->ZeroGrad(name_); }
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(const std::string& path) {
    return conn_->SaveCheckpoint(name_, path);
  }
  absl::Status LoadCheckpoint(const std::string& path) {
    return conn_->LoadCheckpoint(name_, path).status();
  }
  absl::StatusOr<std::map<std::string, Tensor>> ExportWeights(bool include_optimizer = false) {
    return conn_->ExportWeights(name_, include_optimizer);
  }
  absl::Status ImportWeights(const std::map<std::string, Tensor>& state) {
    return conn_->ImportWeights(name_, state);
  }

 private:
  RemoteLayer(std::shared_ptr<Connection> conn, std::string name, LayerConfig config)
      : conn_(std::move(conn)), name_(std::move(name)), config_(config) {}
  std::shared_ptr<Connection> conn_;
  std::string name_;
  LayerConfig config_;
};

// One logical client-routed layer whose experts are spread over several servers, each holding a
// contiguous range. Forward sends each shard only the tokens with at least one of the top-K
// picks in its range and sums the partial outputs; Backward does the same for dout and sums dx
// and dweights. Shards with no routed tokens get no call. float32 layers only: summing rounded
// bf16 partials would not be the layer's arithmetic.
//
// Tensors on a GPU (ForwardInto, BackwardInto; a client built with CUDA) are split and summed on
// that GPU (sharded_device.h): each shard's rows (ascending token order) are gathered there into
// buffers of the layer's own and sent by the shard's connection as any device call (CUDA IPC or
// NCCL, else staged), all shards at once; the partials are summed in shard order in float32, so
// results are bitwise those of host tensors.
class ShardedLayer {
 public:
  // Splits [0, E) into `conns.size()` contiguous ranges (sizes differ by at most one) and creates
  // (or attaches) "<name>" on each server with that range. config.expert_first/count ignored.
  static absl::StatusOr<std::unique_ptr<ShardedLayer>> Create(
      std::vector<std::shared_ptr<Connection>> conns, const std::string& name,
      const LayerConfig& config);
  // Unregisters the layer's device buffers from the shards' connections (which unregisters
  // every other idle device region of theirs too: Connection::ReleaseIdleDeviceRegions) before
  // freeing them. No call may be in flight.
  ~ShardedLayer();

  const LayerConfig& config() const { return config_; }
  size_t num_shards() const { return shards_.size(); }
  RemoteLayer& shard(size_t i) { return *shards_[i]; }

  // Blocks the calling thread only inside the returned future (std::async). Host tensors only
  // (the results come back in host memory): a device tensor is InvalidArgument naming it;
  // ForwardInto and BackwardInto take device tensors.
  std::future<absl::StatusOr<ForwardOutput>> Forward(const TensorView& x, const TensorView& ids,
                                                     const TensorView& weights,
                                                     bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id, const TensorView& dout);
  // Results into the caller's memory, in RemoteLayer::ForwardInto's shape. Host tensors: as
  // Forward and Backward, the results copied into the destinations (an empty one: returned).
  // Device tensors (a client built with CUDA; else InvalidArgument naming the field): x, ids,
  // weights and out, then dout, dx and dweights, all on one cuda:N device, all destinations
  // given, of any allocator (the layer's own buffers are what the shards' connections send).
  // Work is ordered on the caller's `stream` (null: the device's legacy default stream) as
  // RemoteLayer's: the call reads the inputs after the work `stream` had enqueued when it was
  // made, and work enqueued on `stream` once the future is ready runs after the results are
  // written; until then the tensors must stay allocated and unchanged. The host waits on the GPU
  // once per Forward, on a stream of the call's own, for the shards' row counts (a small copy).
  // An id outside [0, E) is InvalidArgument naming it. A shard's error fails the call with that
  // shard's status; the other shards' server contexts then die with their TTL or the session,
  // and the sharded context is not kept (its Backward is NotFound). A context's Backward takes
  // the kind of tensors its Forward took.
  std::future<absl::StatusOr<ForwardOutput>> ForwardInto(const TensorView& x,
                                                         const TensorView& ids,
                                                         const TensorView& weights,
                                                         const MutableTensorView& out,
                                                         void* stream = nullptr,
                                                         bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> BackwardInto(uint64_t context_id,
                                                           const TensorView& dout,
                                                           const MutableTensorView& dx,
                                                           const MutableTensorView& dweights,
                                                           void* stream = nullptr,
                                                           const BackwardOptions& options = {});
  // Steps every shard, all at once; tokens_per_expert covers all E experts, grad_norm is the
  // global norm. The first failing shard's error (the others have stepped).
  absl::StatusOr<StepOutput> Step();

 private:
  struct Pending {
    int64_t tokens = 0;
    // Per shard: its context id and the global rows it received (none: the shard was skipped).
    std::vector<uint64_t> shard_context;
    std::vector<std::vector<int64_t>> rows;
  };
  ShardedLayer() = default;
  absl::StatusOr<ForwardOutput> RunForward(Tensor x, Tensor ids, Tensor weights, bool training);
  absl::StatusOr<BackwardOutput> RunBackward(uint64_t context_id, Tensor dout);

  LayerConfig config_;
  std::vector<std::unique_ptr<RemoteLayer>> shards_;
  std::mutex mu_;
  std::map<uint64_t, Pending> pending_;
  std::atomic<uint64_t> next_id_{1};
  // Device tensors' calls and contexts (null without CUDA); declared after shards_, so it goes
  // first.
  std::unique_ptr<ShardedDevice> device_;
};

// Copies a host view into an owning tensor.
Tensor ToTensor(const TensorView& view);

}  // namespace moe::client

#endif  // MOE_CLIENT_CLIENT_H_
