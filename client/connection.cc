// Connection: one server, reached over `ClientOptions::connections` TCP connections (a gRPC
// channel each) with this client's credentials; every call it makes carries its deadline, its
// session and its token; the unary and weight-streaming calls of ExpertService, the region calls
// among them. Forward and Backward are in striping.cc, region_calls.cc and stream_call.cc, the
// session in remote_layer.cc, what is registered for Forward and Backward in data_plane.cc.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/data_plane.h"
#include "client/requests.h"
#include "client/stream_call.h"
#include "common/host_memory.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "wire/tls.h"
#include "wire/wire.h"

namespace moe::client {
namespace {

constexpr char kSessionMetadataKey[] = "moe-session-id";
constexpr char kAuthorizationMetadataKey[] = "authorization";

// A token gRPC can send as a metadata value and the server's tokens file can hold: printable
// ASCII without spaces.
absl::Status CheckToken(const std::string& token) {
  for (char c : token) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) {
      return absl::InvalidArgumentError(
          "token: may hold only printable ASCII without spaces (a stray newline from a token "
          "file?)");
    }
  }
  return absl::OkStatus();
}

// One unary ExpertService call with the connection's deadline and session metadata; the
// server's status comes back as absl::Status carrying its message.
template <typename Req, typename Resp>
absl::StatusOr<Resp> CallUnary(const Connection& conn, v1::ExpertService::Stub* stub,
                               grpc::Status (v1::ExpertService::Stub::*method)(grpc::ClientContext*,
                                                                               const Req&, Resp*),
                               const Req& req) {
  grpc::ClientContext ctx;
  conn.Prepare(&ctx);
  Resp resp;
  MOE_RETURN_IF_ERROR(FromGrpcStatus((stub->*method)(&ctx, req, &resp)));
  return resp;
}

}  // namespace

const char* TransportName(Transport transport) {
  switch (transport) {
    case Transport::kAuto:
      return "auto";
    case Transport::kTcp:
      return "tcp";
    case Transport::kSharedMemory:
      return "shared memory";
  }
  return "unknown";
}

const char* DeviceTransportName(DeviceTransport transport) {
  switch (transport) {
    case DeviceTransport::kUnavailable:
      return "unavailable";
    case DeviceTransport::kUndecided:
      return "undecided";
    case DeviceTransport::kCudaIpc:
      return "cuda ipc";
    case DeviceTransport::kStaged:
      return "staged";
    case DeviceTransport::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

Tensor ToTensor(const TensorView& view) {
  Tensor t;
  t.dtype = view.dtype;
  t.shape = view.shape;
  t.bytes.resize(view.size_bytes);
  ParallelMemcpy(t.bytes.data(), view.data, view.size_bytes);
  return t;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " is empty"));
  }
  return token;
}

absl::StatusOr<std::shared_ptr<Connection>> Connection::Connect(const std::string& target,
                                                                ClientOptions options) {
  if (options.chunk_bytes <= 0) return absl::InvalidArgumentError("chunk_bytes: must be > 0");
  if (options.connections < 1) return absl::InvalidArgumentError("connections: must be >= 1");
  MOE_RETURN_IF_ERROR(CheckToken(options.token));
  MOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                       wire::MakeChannelCredentials(options.tls, "tls."));
  std::shared_ptr<Connection> c(new Connection());
  c->target_ = target;
  c->options_ = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(options.max_receive_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(-1);
  if (!options.tls.server_name.empty()) args.SetSslTargetNameOverride(options.tls.server_name);
  c->channel_ = grpc::CreateCustomChannel(target, credentials, args);
  if (!c->channel_->WaitForConnected(std::chrono::system_clock::now() + options.timeout)) {
    // A handshake that fails looks like a server that is not there; say which side to check.
    return absl::UnavailableError(absl::StrCat(
        "could not connect to ", target, " within ", options.timeout.count(), " ms",
        wire::UsesTls(options.tls)
            ? " (over TLS: is the server's certificate signed by tls.ca_file and issued for "
              "the target's host or tls.server_name, and does the server require a client "
              "certificate?)"
            : " (plaintext: does the server require TLS?)"));
  }
  c->stub_ = v1::ExpertService::NewStub(c->channel_);
  std::shared_ptr<StreamLink::Streams> streams = StreamLink::NewStreams();
  c->links_.push_back(std::make_shared<StreamLink>(c->channel_, streams));
  // Channels with equal arguments share one connection (gRPC's global subchannel pool): each
  // further channel gets a pool of its own, hence its own connection.
  grpc::ChannelArguments own_pool = args;
  own_pool.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (int i = 1; i < options.connections; ++i) {
    auto channel = grpc::CreateCustomChannel(target, credentials, own_pool);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + options.timeout)) {
      return absl::UnavailableError(absl::StrCat("could not open connection ", i + 1, " of ",
                                                 options.connections, " to ", target, " within ",
                                                 options.timeout.count(), " ms"));
    }
    c->links_.push_back(std::make_shared<StreamLink>(channel, streams));
    c->extra_channels_.push_back(std::move(channel));
  }
  std::random_device rd;
  c->context_prefix_ = (static_cast<uint64_t>(rd()) << 32) & 0xFFFFFFFF00000000ull;
  if (options.open_session) MOE_RETURN_IF_ERROR(c->OpenSession());
  std::function<void(const std::string&)> log = options.log;
  if (!log) log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  c->plane_ = std::make_shared<DataPlane>(options.transport, std::move(log));
  MOE_RETURN_IF_ERROR(c->plane_->Open(*c));
  return c;
}

// The idle long-lived streams end first (each busy one once answered), then the session: the
// server then drops every region and event pair of it, and the plane's memory goes once no call
// in flight holds it.
Connection::~Connection() {
  for (const std::shared_ptr<StreamLink>& link : links_) {
    link->ShutDown(std::chrono::milliseconds(2000));
  }
  CloseSession();
}

Transport Connection::transport() const { return plane_->transport(); }
const std::string& Connection::transport_reason() const { return plane_->reason(); }
DeviceTransport Connection::device_transport() const { return plane_->device_transport(); }

absl::Status Connection::ReleaseIdleDeviceRegions() {
  return plane_->ReleaseIdleDeviceRegions(*this);
}

absl::StatusOr<v1::RegisterRegionResponse> Connection::RegisterRegion(
    const v1::RegisterRegionRequest& req) {
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::RegisterRegion, req);
}

absl::Status Connection::UnregisterRegion(uint64_t region_id) {
  v1::UnregisterRegionRequest req;
  req.set_region_id(region_id);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::UnregisterRegion, req).status();
}

absl::StatusOr<v1::RegisterEventsResponse> Connection::RegisterEvents(
    const std::string& wait_event_handle) {
  v1::RegisterEventsRequest req;
  req.set_wait_event_handle(wait_event_handle);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::RegisterEvents, req);
}

absl::Status Connection::UnregisterEvents(uint64_t event_id) {
  v1::UnregisterEventsRequest req;
  req.set_event_id(event_id);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::UnregisterEvents, req).status();
}

uint64_t Connection::NextContextId() {
  return context_prefix_ | (++context_counter_ & 0xFFFFFFFFull);
}

void Connection::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  if (!session_id_.empty()) ctx->AddMetadata(kSessionMetadataKey, session_id_);
  AddToken(ctx);
}

void Connection::AddToken(grpc::ClientContext* ctx) const {
  if (!options_.token.empty()) {
    ctx->AddMetadata(kAuthorizationMetadataKey, absl::StrCat("Bearer ", options_.token));
  }
}

absl::Status Connection::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  MOE_RETURN_IF_ERROR(FromGrpcStatus(health->Check(&ctx, req, &resp)));
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(
        target_, " is not serving (",
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::LayerInfo> Connection::CreateLayer(const std::string& name,
                                                      const LayerConfig& config,
                                                      bool attach_if_exists,
                                                      const std::vector<std::string>& shared_with) {
  v1::CreateLayerRequest req;
  req.set_name(name);
  *req.mutable_config() = wire::LayerConfigToProto(config);
  req.set_attach_if_exists(attach_if_exists);
  for (const std::string& p : shared_with) req.add_shared_with(p);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::CreateLayer, req);
}

absl::StatusOr<v1::LayerInfo> Connection::GetLayer(const std::string& name) {
  v1::GetLayerRequest req;
  req.set_name(name);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::GetLayer, req);
}

absl::StatusOr<std::vector<v1::LayerInfo>> Connection::ListLayers() {
  MOE_ASSIGN_OR_RETURN(
      const v1::ListLayersResponse resp,
      CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::ListLayers, v1::ListLayersRequest()));
  return std::vector<v1::LayerInfo>(resp.layers().begin(), resp.layers().end());
}

absl::Status Connection::DeleteLayer(const std::string& name) {
  v1::DeleteLayerRequest req;
  req.set_name(name);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::DeleteLayer, req).status();
}

absl::StatusOr<v1::StatsResponse> Connection::GetStats() {
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::GetStats, v1::GetStatsRequest());
}

absl::StatusOr<StepOutput> Connection::Step(const std::string& layer) {
  v1::StepRequest req;
  req.set_layer(layer);
  MOE_ASSIGN_OR_RETURN(const v1::StepResponse resp,
                       CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::Step, req));
  StepOutput o;
  o.step = resp.step();
  o.grad_norm = resp.grad_norm();
  o.expert_first = resp.expert_first();
  o.tokens_per_expert.assign(resp.tokens_per_expert().begin(), resp.tokens_per_expert().end());
  return o;
}

absl::Status Connection::ZeroGrad(const std::string& layer) {
  v1::ZeroGradRequest req;
  req.set_layer(layer);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::ZeroGrad, req).status();
}

absl::StatusOr<std::map<std::string, Tensor>> Connection::ExportWeights(const std::string& layer,
                                                                        bool include_optimizer) {
  v1::ExportWeightsRequest req;
  req.set_layer(layer);
  req.set_include_optimizer(include_optimizer);
  req.set_max_chunk_bytes(ResponseChunkBytes(options_));
  grpc::ClientContext ctx;
  Prepare(&ctx);
  auto reader = stub_->ExportWeights(&ctx, req);
  std::map<std::string, std::unique_ptr<wire::TensorAssembler>> parts;
  v1::WeightChunk chunk;
  while (reader->Read(&chunk)) {
    auto& a = parts[chunk.name()];
    if (!a)
      a = std::make_unique<wire::TensorAssembler>(chunk.name(),
                                                  wire::TensorAssembler::Sizing::kClaimedAtOnce);
    if (auto s = a->Add(chunk.tensor()); !s.ok()) {
      ctx.TryCancel();
      reader->Finish();
      return s;
    }
  }
  MOE_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  std::map<std::string, Tensor> out;
  for (auto& [name, a] : parts) {
    MOE_ASSIGN_OR_RETURN(out[name], a->Finish());
  }
  return out;
}

absl::Status Connection::ImportWeights(const std::string& layer,
                                       const std::map<std::string, Tensor>& state) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ImportWeightsResponse resp;
  auto writer = stub_->ImportWeights(&ctx, &resp);
  const size_t chunk = static_cast<size_t>(options_.chunk_bytes);
  bool first = true;
  for (const auto& [name, t] : state) {
    size_t offset = 0;
    do {
      const size_t take = std::min(chunk, t.bytes.size() - offset);
      v1::WeightChunk c;
      if (first) c.set_layer(layer);
      first = false;
      c.set_name(name);
      wire::SetTensorHeader(t.dtype, t.shape, c.mutable_tensor());
      c.mutable_tensor()->set_offset(static_cast<int64_t>(offset));
      c.mutable_tensor()->set_data(reinterpret_cast<const char*>(t.bytes.data()) + offset, take);
      offset += take;
      c.set_last_chunk(offset == t.bytes.size());
      if (!writer->Write(c)) return FromGrpcStatus(writer->Finish());
    } while (offset < t.bytes.size());
  }
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish());
}

absl::StatusOr<v1::SaveCheckpointResponse> Connection::SaveCheckpoint(const std::string& layer,
                                                                      const std::string& path) {
  v1::SaveCheckpointRequest req;
  req.set_layer(layer);
  req.set_path(path);
  return CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::SaveCheckpoint, req);
}

absl::StatusOr<v1::LayerInfo> Connection::LoadCheckpoint(
    const std::string& layer, const std::string& path,
    const std::vector<std::string>& shared_with) {
  v1::LoadCheckpointRequest req;
  req.set_layer(layer);
  req.set_path(path);
  for (const std::string& p : shared_with) req.add_shared_with(p);
  MOE_ASSIGN_OR_RETURN(
      v1::LoadCheckpointResponse resp,
      CallUnary(*this, stub_.get(), &v1::ExpertService::Stub::LoadCheckpoint, req));
  return std::move(*resp.mutable_layer());
}

}  // namespace moe::client
