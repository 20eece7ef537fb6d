// The ExpertService implementation on gRPC's callback API: the service's shared state (the layer
// table, the executors, the memory ledger, the context store, the registered regions) and its
// method table. The RPCs live
// in files of their own, after grpc's route_guide callback example: a reactor class per streaming
// RPC, a group of unary handlers per file (named at each method below).
//
// Threading: reactions (OnReadDone, OnWriteDone, ...) only parse, account and hand work to the
// device executor; they never wait. Every engine call, and every change to the layer table,
// runs on the executor thread, which then starts the write or finishes the call. The layer table
// is read (Get, List, stats) under a mutex from any thread, using values the executor caches.
// Checkpoint files are read and written on a second executor, the file executor, never on the
// device one.
#ifndef MOE_SERVER_SERVICE_H_
#define MOE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "engine/layer.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/auth.h"
#include "server/context_store.h"
#include "server/executor.h"
#include "server/memory_ledger.h"
#include "server/metrics.h"
#include "server/nccl_channels.h"
#include "server/options.h"
#include "server/region_registry.h"
#include "server/request_validation.h"
#include "server/stripe_join.h"

namespace moe::server {

// Metadata key naming the caller's session (see context_store.h).
inline constexpr char kSessionMetadataKey[] = "moe-session-id";

struct LayerEntry {
  std::string name;
  LayerConfig config;
  // Who may use it (fixed when the layer is created or loaded): its owner, the principals it
  // is shared with, and admins (ExpertServiceImpl::AuthorizeLayer).
  std::string owner;
  std::set<std::string> shared_with;
  std::unique_ptr<Layer> layer;  // used only on the executor
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> resident_bytes{0};
};

// The authenticated principal of a call.
struct Caller {
  std::string principal;
  bool admin = false;
};

// What a call does to a layer. The owner and admins may do all of it; the principals the layer
// is shared with may read and train it (docs/PROTOCOL.md, "Authorization").
enum class Access {
  kRead,    // GetLayer, ExportWeights, SaveCheckpoint
  kTrain,   // Forward, Backward, Step, ZeroGrad, attach_if_exists
  kManage,  // DeleteLayer, ImportWeights, LoadCheckpoint into it
};

// The registered-memory calls (region_handlers.cc), the last four of the generated service.
template <class Base>
using RegionMethods = v1::ExpertService::WithCallbackMethod_RegisterRegion<
    v1::ExpertService::WithCallbackMethod_UnregisterRegion<
        v1::ExpertService::WithCallbackMethod_RegisterEvents<
            v1::ExpertService::WithCallbackMethod_UnregisterEvents<Base>>>>;
// The NCCL calls (nccl_handlers.cc), the last four of the generated service.
template <class Base>
using NcclMethods = v1::ExpertService::WithCallbackMethod_OpenNcclChannel<
    v1::ExpertService::WithCallbackMethod_CloseNcclChannel<
        v1::ExpertService::WithCallbackMethod_NcclForward<
            v1::ExpertService::WithCallbackMethod_NcclBackward<Base>>>>;
// The callback service with Forward and Backward taking raw buffers: their tensors' bytes are
// decoded and encoded by reference (wire/raw_message.h) instead of through protobuf's copies.
// The wire format is unchanged. Same order of methods as the generated CallbackService.
using ExpertServiceBase = v1::ExpertService::WithCallbackMethod_CreateLayer<
    v1::ExpertService::WithCallbackMethod_GetLayer<v1::ExpertService::WithCallbackMethod_ListLayers<
        v1::ExpertService::WithCallbackMethod_DeleteLayer<
            v1::ExpertService::WithRawCallbackMethod_Forward<
                v1::ExpertService::WithRawCallbackMethod_Backward<
                    v1::ExpertService::WithCallbackMethod_Step<
                        v1::ExpertService::WithCallbackMethod_ZeroGrad<
                            v1::ExpertService::WithCallbackMethod_ExportWeights<
                                v1::ExpertService::WithCallbackMethod_ImportWeights<
                                    v1::ExpertService::WithCallbackMethod_SaveCheckpoint<
                                        v1::ExpertService::WithCallbackMethod_LoadCheckpoint<
                                            v1::ExpertService::WithCallbackMethod_GetStats<
                                                v1::ExpertService::WithCallbackMethod_OpenSession<
                                                    RegionMethods<NcclMethods<
                                                        v1::ExpertService::Service>>>>>>>>>>>>>>>>;

class ExpertServiceImpl final : public ExpertServiceBase {
 public:
  // `budget`: what layer state, saved contexts and request tensors are admitted into
  // (memory_ledger.h). `auth` null: authentication off (every caller "anonymous").
  ExpertServiceImpl(const ServerOptions& options, MemoryBudget budget,
                    std::unique_ptr<Engine> engine, Metrics* metrics,
                    std::shared_ptr<const Authenticator> auth = nullptr);
  ~ExpertServiceImpl() override;

  // layer_handlers.cc
  grpc::ServerUnaryReactor* CreateLayer(grpc::CallbackServerContext* ctx,
                                        const v1::CreateLayerRequest* req,
                                        v1::LayerInfo* resp) override;
  grpc::ServerUnaryReactor* GetLayer(grpc::CallbackServerContext* ctx,
                                     const v1::GetLayerRequest* req, v1::LayerInfo* resp) override;
  grpc::ServerUnaryReactor* ListLayers(grpc::CallbackServerContext* ctx,
                                       const v1::ListLayersRequest* req,
                                       v1::ListLayersResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteLayer(grpc::CallbackServerContext* ctx,
                                        const v1::DeleteLayerRequest* req,
                                        v1::DeleteLayerResponse* resp) override;
  // Raw: moe.v1.ForwardRequest in, moe.v1.ForwardResponse out (forward_reactor.cc).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Forward(
      grpc::CallbackServerContext* ctx) override;
  // Raw: moe.v1.BackwardRequest in, moe.v1.BackwardResponse out (backward_reactor.cc).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Backward(
      grpc::CallbackServerContext* ctx) override;
  // optimizer_handlers.cc
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* req,
                                 v1::StepResponse* resp) override;
  grpc::ServerUnaryReactor* ZeroGrad(grpc::CallbackServerContext* ctx,
                                     const v1::ZeroGradRequest* req,
                                     v1::ZeroGradResponse* resp) override;
  // weights_reactors.cc
  grpc::ServerWriteReactor<v1::WeightChunk>* ExportWeights(
      grpc::CallbackServerContext* ctx, const v1::ExportWeightsRequest* req) override;
  grpc::ServerReadReactor<v1::WeightChunk>* ImportWeights(grpc::CallbackServerContext* ctx,
                                                          v1::ImportWeightsResponse* resp) override;
  // checkpoint_handlers.cc
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::SaveCheckpointRequest* req,
                                           v1::SaveCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::LoadCheckpointRequest* req,
                                           v1::LoadCheckpointResponse* resp) override;
  // layer_handlers.cc
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::StatsResponse* resp) override;
  // session_reactor.cc
  grpc::ServerWriteReactor<v1::SessionEvent>* OpenSession(
      grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* req) override;
  // region_handlers.cc
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* req,
                                           v1::RegisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* req,
                                             v1::UnregisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterEvents(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterEventsRequest* req,
                                           v1::RegisterEventsResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterEvents(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterEventsRequest* req,
                                             v1::UnregisterEventsResponse* resp) override;
  // nccl_handlers.cc
  grpc::ServerUnaryReactor* OpenNcclChannel(grpc::CallbackServerContext* ctx,
                                            const v1::OpenNcclChannelRequest* req,
                                            v1::OpenNcclChannelResponse* resp) override;
  grpc::ServerUnaryReactor* CloseNcclChannel(grpc::CallbackServerContext* ctx,
                                             const v1::CloseNcclChannelRequest* req,
                                             v1::CloseNcclChannelResponse* resp) override;
  grpc::ServerUnaryReactor* NcclForward(grpc::CallbackServerContext* ctx,
                                        const v1::ForwardRequest* req,
                                        v1::ForwardResponse* resp) override;
  grpc::ServerUnaryReactor* NcclBackward(grpc::CallbackServerContext* ctx,
                                         const v1::BackwardRequest* req,
                                         v1::BackwardResponse* resp) override;

  // For the reactors and handlers (the files named above).
  Metrics& metrics() { return *metrics_; }
  ContextStore& contexts() { return contexts_; }
  MemoryLedger& ledger() { return ledger_; }
  DeviceExecutor& executor() { return executor_; }
  StripeJoins& stripes() { return stripes_; }
  // The regions and event pairs clients registered (region_handlers.cc); the session reactor
  // opens and drops sessions in it as it does in contexts().
  RegionRegistry& regions() { return *regions_; }
  // The NCCL channels clients opened (nccl_handlers.cc); sessions opened and dropped as above.
  NcclChannels& nccl() { return *nccl_; }
  const ServerOptions& options() const { return options_; }
  // NotFound naming the layer.
  absl::StatusOr<std::shared_ptr<LayerEntry>> FindLayer(const std::string& name) const;
  // Who makes the call: every handler asks first, and answers Unauthenticated on an error.
  absl::StatusOr<Caller> Authenticate(const grpc::CallbackServerContext* ctx) const;
  // OK when `caller` may do `access` to the layer; PermissionDenied naming `field`, the layer
  // and the principal otherwise.
  absl::Status AuthorizeLayer(const Caller& caller, const LayerEntry& entry, Access access,
                              const char* field) const;
  // Where the caller's checkpoint paths are relative to: --checkpoint_dir for admins and
  // without authentication, else the caller's own directory below it (made if missing), so
  // one principal's checkpoints are out of every other's reach.
  absl::StatusOr<std::string> CheckpointRoot(const Caller& caller) const;
  // Charges the host memory one engine `call` of `tokens` tokens on `entry`'s layer allocates
  // (Engine::HostWorkingBytes) against the budget for as long as the returned charge lives;
  // ResourceExhausted, before the engine allocates anything, when it does not fit.
  absl::StatusOr<MemoryLedger::RequestCharge> AdmitEngineCall(const LayerEntry& entry,
                                                              int64_t tokens, EngineCall call);
  void RefreshLayer(LayerEntry& entry);  // executor only: caches step and resident bytes
  void FillInfo(const LayerEntry& entry, v1::LayerInfo* info) const;
  // Records the request and finishes a unary call.
  void FinishUnary(grpc::ServerUnaryReactor* reactor, const char* method,
                   const absl::Status& status);

 private:
  // Every unary call's start: counts the request's bytes and authenticates the caller; on a
  // refusal the call is already finished with that status.
  absl::StatusOr<Caller> BeginUnary(grpc::CallbackServerContext* ctx, const char* method,
                                    const google::protobuf::Message& req,
                                    grpc::ServerUnaryReactor* reactor);
  // Runs `work` on the executor (after the deadline/cancel check) and finishes the call with
  // its status; accounts queue and compute latency and bytes.
  // `work` gets the authenticated Caller; a call that does not authenticate never reaches the
  // executor. Defined in service_internal.h, for the handler files.
  template <typename Work>
  grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* ctx, const char* method,
                                     const google::protobuf::Message* req,
                                     const google::protobuf::Message* resp, Work work);
  // Creates the layer once the ledger admits its state (Engine::LayerStateBytes) for
  // `principal`; ResourceExhausted, with nothing allocated, when it does not fit. The charge is
  // set to what the layer reports once built, and dropped when creation fails.
  absl::StatusOr<std::unique_ptr<Layer>> CreateAdmittedLayer(const std::string& principal,
                                                             const std::string& name,
                                                             const LayerConfig& config);
  // ResourceExhausted when the table already holds --max_layers layers.
  absl::Status CheckLayerCount() const;
  absl::Status InsertLayer(const std::string& name, const LayerConfig& config,
                           std::unique_ptr<Layer> layer, const std::string& owner,
                           std::set<std::string> shared_with, std::shared_ptr<LayerEntry>* out);
  // The layers `caller` may read (all for admins), in name order.
  std::vector<std::shared_ptr<LayerEntry>> VisibleLayers(const Caller& caller) const;
  // An NCCL micro-batch (nccl_handlers.cc): authenticates, queues `plan`'s transfers on the
  // request's channel, and once the inputs are in runs `compute(caller, inputs, outputs,
  // done_event)` on the executor over the received device buffers (the engine call records
  // `done_event`, when not null, and returns without waiting), sends the outputs after it on
  // the device and finishes the call.
  template <typename Req, typename Resp, typename Compute>
  grpc::ServerUnaryReactor* RunNccl(grpc::CallbackServerContext* ctx, const char* method,
                                    const Req* req, Resp* resp, absl::StatusOr<NcclPlan> plan,
                                    Compute compute);
  void SampleMemory();  // executor only
  void SweepLoop();

  const ServerOptions options_;
  const std::shared_ptr<const Authenticator> auth_;
  Metrics* metrics_;
  std::unique_ptr<Engine> engine_;
  const std::chrono::steady_clock::time_point started_;
  std::atomic<int64_t> memory_used_{0};
  std::atomic<int64_t> memory_total_{0};
  MemoryLedger ledger_;  // before contexts_, which charges it
  ContextStore contexts_;
  StripeJoins stripes_;
  // After engine_, whose IPC calls map its regions: destroyed, and so unmapped, before it.
  std::unique_ptr<RegionRegistry> regions_;
  // After engine_, whose links its channels hold; its pump stops before the executors go.
  std::unique_ptr<NcclChannels> nccl_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<LayerEntry>> layers_;  // written on the executor only
  // Last members: destroyed first, so no task or sweep runs once the rest starts going away.
  // Checkpoint calls hand tasks between the two executors; both outlive every call, since the
  // gRPC server is shut down, waiting for every call to finish, before the service goes away.
  FileExecutor file_executor_;  // checkpoint file I/O, off the device thread
  DeviceExecutor executor_;
  std::mutex sweep_mu_;
  std::condition_variable sweep_cv_;
  bool sweep_stop_ = false;
  std::thread sweeper_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_SERVICE_H_
