// moe::client: the library a trainer links to run its MoE layers on one or several moe-servers.
//
//   auto conn = moe::client::Connection::Connect("localhost:50051");
//   auto layer = moe::client::RemoteLayer::Create(*conn, "moe0", config);
//   auto fut = (*layer)->Forward(x, ids, p);        // several may be in flight at once
//   auto fwd = fut.get();                           // absl::StatusOr<ForwardOutput>
//   auto bwd = (*layer)->Backward(fwd->context_id, dout).get();
//   auto step = (*layer)->Step();
//
// Every call carries a deadline (ClientOptions::timeout). Errors are absl::Status with the
// server's code and message. Tensors larger than ClientOptions::chunk_bytes are split into
// several messages (docs/PROTOCOL.md, "Chunking") and responses reassembled. Each Forward or
// Backward is its own bidirectional stream, so micro-batches in flight do not wait on each
// other; a Connection also holds one OpenSession stream, so the server frees this client's
// saved contexts when the client goes away.
//
// Received tensors are large fresh buffers; under glibc's default malloc each is page-faulted
// in anew. A trainer should call moe::RetainFreedHeapMemory() (common/host_memory.h) first thing
// in main, or set the GLIBC_TUNABLES given there (docs/decisions/0005-retained-heap-memory.md).
// The library does not do it itself: it is the whole process's allocator.
//
// This is the library's one public header. Its implementation: connection.cc (channels,
// credentials, deadlines, unary calls), striping.cc (Forward and Backward: whole or striped over
// the connections), stream_call.cc (one Forward or Backward stream), requests.cc (the one place
// that fills Forward and Backward requests), remote_layer.cc (RemoteLayer and the session that
// holds its contexts), sharded_layer.cc (ShardedLayer); the headers beside those are internal.
#ifndef MOE_CLIENT_CLIENT_H_
#define MOE_CLIENT_CLIENT_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
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

struct ClientOptions {
  std::chrono::milliseconds timeout{30000};  // deadline of every call
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
};

// The bearer token a file holds (ClientOptions::token), surrounding whitespace removed;
// InvalidArgument naming `field` and the path when it cannot be read or is empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& field);

// grpc::Status -> absl::Status, code and message unchanged.
absl::Status FromGrpcStatus(const grpc::Status& status);

struct ForwardOutput {
  uint64_t context_id = 0;
  Tensor out;         // [T, d]
  Tensor expert_ids;  // [T, K] int32, the routing used
  Tensor weights;     // [T, K] float32
  double aux_loss = 0;
  double z_loss = 0;
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
  // Forward and Backward copy the tensors they are given before they return (so the caller may
  // reuse them at once) and send that copy by reference; the call runs on one of the
  // connection's `connections` TCP connections.
  std::future<absl::StatusOr<ForwardOutput>> Forward(const std::string& layer, uint64_t context_id,
                                                     bool training, const TensorView& x,
                                                     const TensorView& ids,
                                                     const TensorView& weights);
  std::future<absl::StatusOr<BackwardOutput>> Backward(const std::string& layer,
                                                       uint64_t context_id, const TensorView& dout);
  // The same, taking the tensors over instead of copying them (for a trainer that has no more
  // use for them once they are sent: the copy of a 75 MB tensor costs about 3 ms on the H100
  // machine). An empty tensor is an absent one.
  std::future<absl::StatusOr<ForwardOutput>> Forward(const std::string& layer, uint64_t context_id,
                                                     bool training, Tensor&& x, Tensor&& ids,
                                                     Tensor&& weights);
  std::future<absl::StatusOr<BackwardOutput>> Backward(const std::string& layer,
                                                       uint64_t context_id, Tensor&& dout);
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
  // The raw-buffer stub (wire/raw_message.h) of the connection next in turn, for a Forward or
  // Backward stream (client/stream_call.h).
  grpc::GenericStub& NextRawStub() { return *raw_stubs_[next_raw_stub_++ % raw_stubs_.size()]; }

  std::string target_;
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ExpertService::Stub> stub_;
  // Forward and Backward as raw buffers, one stub per connection (the first on channel_), taken
  // in turn.
  std::vector<std::unique_ptr<grpc::GenericStub>> raw_stubs_;
  std::vector<std::shared_ptr<grpc::Channel>> extra_channels_;
  std::atomic<uint64_t> next_raw_stub_{0};
  std::string session_id_;
  SessionCall* session_ = nullptr;
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
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id, const TensorView& dout);
  // The same, taking the tensors over instead of copying them (Connection::Forward's).
  std::future<absl::StatusOr<ForwardOutput>> Forward(Tensor&& x, Tensor&& ids, Tensor&& weights,
                                                     bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id, Tensor&& dout);
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
class ShardedLayer {
 public:
  // Splits [0, E) into `conns.size()` contiguous ranges (sizes differ by at most one) and creates
  // (or attaches) "<name>" on each server with that range. config.expert_first/count ignored.
  static absl::StatusOr<std::unique_ptr<ShardedLayer>> Create(
      std::vector<std::shared_ptr<Connection>> conns, const std::string& name,
      const LayerConfig& config);

  const LayerConfig& config() const { return config_; }
  size_t num_shards() const { return shards_.size(); }
  RemoteLayer& shard(size_t i) { return *shards_[i]; }

  // Blocks the calling thread only inside the returned future (std::async).
  std::future<absl::StatusOr<ForwardOutput>> Forward(const TensorView& x, const TensorView& ids,
                                                     const TensorView& weights,
                                                     bool training = true);
  std::future<absl::StatusOr<BackwardOutput>> Backward(uint64_t context_id, const TensorView& dout);
  // Steps every shard; tokens_per_expert covers all E experts, grad_norm is the global norm.
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
};

// Copies a view into an owning tensor.
Tensor ToTensor(const TensorView& view);

}  // namespace moe::client

#endif  // MOE_CLIENT_CLIENT_H_
