// The ExpertService's shared state (service.h): construction, the sweeper, the layer table and
// the checks every RPC makes (authentication, authorization, the layer lookup), and the helpers
// of service_internal.h. The RPCs themselves live one reactor or group of unary calls a file:
// forward_reactor.cc and backward_reactor.cc (over micro_batch_reactor.h), weights_reactors.cc,
// session_reactor.cc, layer_handlers.cc, optimizer_handlers.cc, checkpoint_handlers.cc,
// region_handlers.cc.
#include "server/service.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/auth.h"
#include "server/service_internal.h"
#include "server/status_map.h"
#include "wire/wire.h"

namespace moe::server {
namespace {

// At most this many principals in a layer's shared_with: the list is kept per layer and
// searched on every call.
constexpr int kMaxSharedWith = 64;

}  // namespace

absl::Status CallAlive(grpc::CallbackServerContext* ctx) {
  if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  if (ctx->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline passed before the work started");
  }
  return absl::OkStatus();
}

std::string SessionOf(grpc::CallbackServerContext* ctx) {
  auto it = ctx->client_metadata().find(kSessionMetadataKey);
  if (it == ctx->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
}

absl::StatusOr<std::set<std::string>> SharedWith(
    const google::protobuf::RepeatedPtrField<std::string>& list) {
  if (list.size() > kMaxSharedWith) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_with: at most ", kMaxSharedWith, " principals, got ", list.size()));
  }
  std::set<std::string> out;
  for (int i = 0; i < list.size(); ++i) {
    MOE_RETURN_IF_ERROR(ValidatePrincipal(list[i], absl::StrCat("shared_with[", i, "]")));
    out.insert(list[i]);
  }
  return out;
}

ExpertServiceImpl::ExpertServiceImpl(const ServerOptions& options, MemoryBudget budget,
                                     std::unique_ptr<Engine> engine, Metrics* metrics,
                                     std::shared_ptr<const Authenticator> auth)
    : options_(options),
      auth_(std::move(auth)),
      metrics_(metrics),
      engine_(std::move(engine)),
      started_(Clock::now()),
      ledger_({std::move(budget), options.principal_layer_bytes_quota,
               options.principal_context_bytes_quota},
              metrics),
      contexts_(options.context_budget_bytes,
                std::chrono::milliseconds(static_cast<int64_t>(options.context_ttl_seconds * 1000)),
                std::chrono::milliseconds(
                    static_cast<int64_t>(options.sessionless_context_ttl_seconds * 1000)),
                &ledger_, metrics) {
  RegionRegistryOptions regions;
  regions.principal_region_bytes_quota = options.principal_region_bytes_quota;
  regions.on_change = [metrics](const RegionRegistry::Stats& s) {
    metrics->Regions(s.regions, s.region_bytes, s.event_pairs);
  };
  regions_ =
      std::make_unique<RegionRegistry>(std::move(regions), EngineRegionMapper(engine_.get()));
  nccl_ = std::make_unique<NcclChannels>(NcclChannelsOptions{},
                                         [this] { return engine_->StartNcclLink(); });
  metrics_->Layers(0);
  metrics_->Regions(0, 0, 0);
  executor_.Submit([this](double) { SampleMemory(); });
  sweeper_ = std::thread([this] { SweepLoop(); });
}

ExpertServiceImpl::~ExpertServiceImpl() {
  {
    std::lock_guard<std::mutex> lock(sweep_mu_);
    sweep_stop_ = true;
  }
  sweep_cv_.notify_all();
  sweeper_.join();
}

void ExpertServiceImpl::SweepLoop() {
  // Sweep often enough that a context outlives its TTL by at most a quarter of it (or 1 s).
  const double ttl =
      std::min(options_.context_ttl_seconds, options_.sessionless_context_ttl_seconds);
  const auto period =
      std::chrono::milliseconds(std::clamp<int64_t>(static_cast<int64_t>(ttl * 250), 10, 1000));
  std::unique_lock<std::mutex> lock(sweep_mu_);
  while (!sweep_cv_.wait_for(lock, period, [this] { return sweep_stop_; })) {
    contexts_.Expire();
    executor_.Submit([this](double) { SampleMemory(); });
  }
}

void ExpertServiceImpl::SampleMemory() {
  memory_used_ = engine_->memory_in_use_bytes();
  memory_total_ = engine_->memory_total_bytes();
  metrics_->DeviceMemory(memory_used_, memory_total_);
  metrics_->PinnedHostMemory(engine_->pinned_host_bytes());
}

absl::StatusOr<std::shared_ptr<LayerEntry>> ExpertServiceImpl::FindLayer(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("layer: no layer named \"", name, "\""));
  }
  return it->second;
}

absl::StatusOr<Caller> ExpertServiceImpl::Authenticate(
    const grpc::CallbackServerContext* ctx) const {
  if (auth_ == nullptr) return Caller{kAnonymousPrincipal, false};
  MOE_ASSIGN_OR_RETURN(std::string principal, auth_->Authenticate(*ctx));
  const bool admin = auth_->IsAdmin(principal);
  return Caller{std::move(principal), admin};
}

absl::Status ExpertServiceImpl::AuthorizeLayer(const Caller& caller, const LayerEntry& entry,
                                               Access access, const char* field) const {
  if (caller.admin || caller.principal == entry.owner) return absl::OkStatus();
  const bool shared = entry.shared_with.count(caller.principal) != 0;
  if (shared && access != Access::kManage) return absl::OkStatus();
  if (shared) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, ": principal \"", caller.principal, "\" may not delete layer \"", entry.name,
        "\", import weights into it or load a checkpoint over it; only its owner and admins may"));
  }
  return absl::PermissionDeniedError(
      absl::StrCat(field, ": principal \"", caller.principal, "\" may not use layer \"", entry.name,
                   "\": it belongs to another principal and is not shared with it"));
}

absl::StatusOr<std::string> ExpertServiceImpl::CheckpointRoot(const Caller& caller) const {
  const std::string& root = options_.checkpoint_dir;
  if (root.empty() || auth_ == nullptr || !auth_->enabled() || caller.admin) return root;
  const std::string dir = absl::StrCat(root, "/", PrincipalDirectoryName(caller.principal));
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("checkpoint directory ", dir, " of principal \"",
                                            caller.principal, "\": ", std::strerror(errno)));
  }
  // The principal's directory is the root its paths resolve under (checkpoint.h), so it must be
  // a directory itself, never a link planted to lead elsewhere.
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("path: the checkpoint directory of principal \"", caller.principal,
                     "\" is not a directory (a symbolic link or another file is in its place)"));
  }
  return dir;
}

std::vector<std::shared_ptr<LayerEntry>> ExpertServiceImpl::VisibleLayers(
    const Caller& caller) const {
  std::vector<std::shared_ptr<LayerEntry>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, e] : layers_) {
    if (AuthorizeLayer(caller, *e, Access::kRead, "").ok()) out.push_back(e);
  }
  return out;
}

absl::StatusOr<MemoryLedger::RequestCharge> ExpertServiceImpl::AdmitEngineCall(
    const LayerEntry& entry, int64_t tokens, EngineCall call) {
  MOE_ASSIGN_OR_RETURN(int64_t bytes, engine_->HostWorkingBytes(entry.config, tokens, call));
  MemoryLedger::RequestCharge charge = ledger_.NewWorkingCharge();
  if (call != EngineCall::kTrainingForward) {
    MOE_RETURN_IF_ERROR(
        charge.Set(bytes, absl::StrCat(call == EngineCall::kBackward ? "backward" : "forward",
                                       " of ", tokens, " tokens")));
    return charge;
  }
  // A training Forward is admitted only if, once its context is kept (at most its own working
  // memory), its Backward (dout and working memory) still fits: a budget filled with contexts
  // can always run the Backward that frees one. The charge then falls to what the call holds.
  MOE_ASSIGN_OR_RETURN(int64_t backward,
                       engine_->HostWorkingBytes(entry.config, tokens, EngineCall::kBackward));
  const int64_t dout =
      tokens * entry.config.d_model * static_cast<int64_t>(DTypeSize(entry.config.dtype));
  int64_t reserve = 0;
  if (__builtin_add_overflow(bytes, backward, &reserve) ||
      __builtin_add_overflow(reserve, dout, &reserve)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("forward of ", tokens, " tokens: needs more than 2^63 bytes"));
  }
  MOE_RETURN_IF_ERROR(charge.Set(reserve, absl::StrCat("training forward of ", tokens,
                                                       " tokens (with room for its backward)")));
  MOE_RETURN_IF_ERROR(charge.Set(bytes, "training forward"));  // a fall always fits
  return charge;
}

void ExpertServiceImpl::RefreshLayer(LayerEntry& entry) {
  entry.step = entry.layer->step();
  entry.resident_bytes = entry.layer->resident_bytes();
  metrics_->LayerResident(entry.name, entry.resident_bytes);
  SampleMemory();
}

void ExpertServiceImpl::FillInfo(const LayerEntry& entry, v1::LayerInfo* info) const {
  info->set_name(entry.name);
  *info->mutable_config() = wire::LayerConfigToProto(entry.config);
  info->set_step(entry.step);
  info->set_resident_bytes(entry.resident_bytes);
  auto [n, b] = contexts_.LayerUsage(entry.name);
  info->set_saved_contexts(n);
  info->set_saved_context_bytes(b);
  info->set_device(engine_->name());
  info->set_owner(entry.owner);
  for (const std::string& p : entry.shared_with) info->add_shared_with(p);
}

void ExpertServiceImpl::FinishUnary(grpc::ServerUnaryReactor* reactor, const char* method,
                                    const absl::Status& status) {
  grpc::Status g = ToGrpcStatus(status);
  metrics_->Request(method, GrpcCodeName(g.error_code()));
  reactor->Finish(g);
}

absl::StatusOr<Caller> ExpertServiceImpl::BeginUnary(grpc::CallbackServerContext* ctx,
                                                     const char* method,
                                                     const google::protobuf::Message& req,
                                                     grpc::ServerUnaryReactor* reactor) {
  metrics_->BytesIn(method, static_cast<int64_t>(req.ByteSizeLong()));
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (!caller.ok()) FinishUnary(reactor, method, caller.status());
  return caller;
}

absl::StatusOr<std::unique_ptr<Layer>> ExpertServiceImpl::CreateAdmittedLayer(
    const std::string& principal, const std::string& name, const LayerConfig& config) {
  MOE_ASSIGN_OR_RETURN(const int64_t need, engine_->LayerStateBytes(config));
  MOE_RETURN_IF_ERROR(ledger_.AdmitLayer(principal, name, need));
  absl::StatusOr<std::unique_ptr<Layer>> layer = engine_->CreateLayer(config);
  if (!layer.ok()) {
    ledger_.ReleaseLayer(name);
    return layer.status();
  }
  // LayerStateBytes promises resident_bytes(); should they ever differ, what the layer holds
  // is what the ledger must count.
  if ((*layer)->resident_bytes() != need) ledger_.SetLayerBytes(name, (*layer)->resident_bytes());
  return layer;
}

absl::Status ExpertServiceImpl::CheckLayerCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<int>(layers_.size()) >= options_.max_layers) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server already holds --max_layers=", options_.max_layers, " layers"));
  }
  return absl::OkStatus();
}

absl::Status ExpertServiceImpl::InsertLayer(const std::string& name, const LayerConfig& config,
                                            std::unique_ptr<Layer> layer, const std::string& owner,
                                            std::set<std::string> shared_with,
                                            std::shared_ptr<LayerEntry>* out) {
  auto entry = std::make_shared<LayerEntry>();
  entry->name = name;
  entry->config = config;
  entry->owner = owner;
  entry->shared_with = std::move(shared_with);
  entry->layer = std::move(layer);
  RefreshLayer(*entry);
  {
    std::lock_guard<std::mutex> lock(mu_);
    layers_[name] = entry;
    metrics_->Layers(static_cast<int64_t>(layers_.size()));
  }
  *out = entry;
  return absl::OkStatus();
}

}  // namespace moe::server
