// The ExpertService implementation on gRPC's callback API.
//
// Threading: reactions (OnReadDone, OnWriteDone, ...) only parse, account and hand work to the
// device executor; they never wait. Every engine call, and every change to the layer table,
// runs on the executor thread, which then starts the write or finishes the call. The layer table
// is read (Get, List, stats) under a mutex from any thread, using values the executor caches.
#ifndef MOE_SERVER_SERVICE_H_
#define MOE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "engine/layer.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/context_store.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "server/options.h"
#include "server/request_validation.h"
#include "server/stripe_join.h"

namespace moe::server {

// Metadata key naming the caller's session (see context_store.h).
inline constexpr char kSessionMetadataKey[] = "moe-session-id";

struct LayerEntry {
  std::string name;
  LayerConfig config;
  std::unique_ptr<Layer> layer;  // used only on the executor
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> resident_bytes{0};
};

// The callback service with Forward and Backward taking raw buffers: their tensors' bytes are
// decoded and encoded by reference (proto/raw_message.h) instead of through protobuf's copies.
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
                                                    v1::ExpertService::Service>>>>>>>>>>>>>>;

class ExpertServiceImpl final : public ExpertServiceBase {
 public:
  ExpertServiceImpl(const ServerOptions& options, std::unique_ptr<Engine> engine, Metrics* metrics);
  ~ExpertServiceImpl() override;

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
  // Raw: moe.v1.ForwardRequest in, moe.v1.ForwardResponse out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Forward(
      grpc::CallbackServerContext* ctx) override;
  // Raw: moe.v1.BackwardRequest in, moe.v1.BackwardResponse out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Backward(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* req,
                                 v1::StepResponse* resp) override;
  grpc::ServerUnaryReactor* ZeroGrad(grpc::CallbackServerContext* ctx,
                                     const v1::ZeroGradRequest* req,
                                     v1::ZeroGradResponse* resp) override;
  grpc::ServerWriteReactor<v1::WeightChunk>* ExportWeights(
      grpc::CallbackServerContext* ctx, const v1::ExportWeightsRequest* req) override;
  grpc::ServerReadReactor<v1::WeightChunk>* ImportWeights(grpc::CallbackServerContext* ctx,
                                                          v1::ImportWeightsResponse* resp) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::SaveCheckpointRequest* req,
                                           v1::SaveCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::LoadCheckpointRequest* req,
                                           v1::LoadCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::StatsResponse* resp) override;
  grpc::ServerWriteReactor<v1::SessionEvent>* OpenSession(
      grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* req) override;

  // For the reactors (service.cc).
  Metrics& metrics() { return *metrics_; }
  ContextStore& contexts() { return contexts_; }
  DeviceExecutor& executor() { return executor_; }
  StripeJoins& stripes() { return stripes_; }
  const ServerOptions& options() const { return options_; }
  // NotFound naming the layer.
  absl::StatusOr<std::shared_ptr<LayerEntry>> FindLayer(const std::string& name) const;
  void RefreshLayer(LayerEntry& entry);  // executor only: caches step and resident bytes
  void FillInfo(const LayerEntry& entry, v1::LayerInfo* info) const;
  // Records the request and finishes a unary call.
  void FinishUnary(grpc::ServerUnaryReactor* reactor, const char* method,
                   const absl::Status& status);

 private:
  // Runs `work` on the executor (after the deadline/cancel check) and finishes the call with
  // its status; accounts queue and compute latency and bytes.
  template <typename Work>
  grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* ctx, const char* method,
                                     const google::protobuf::Message* req,
                                     const google::protobuf::Message* resp, Work work);
  absl::Status InsertLayer(const std::string& name, const LayerConfig& config,
                           std::unique_ptr<Layer> layer, std::shared_ptr<LayerEntry>* out);
  void SampleMemory();  // executor only
  void SweepLoop();

  const ServerOptions options_;
  Metrics* metrics_;
  std::unique_ptr<Engine> engine_;
  const std::chrono::steady_clock::time_point started_;
  std::atomic<int64_t> memory_used_{0};
  std::atomic<int64_t> memory_total_{0};
  ContextStore contexts_;
  StripeJoins stripes_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<LayerEntry>> layers_;  // written on the executor only
  // Last members: destroyed first, so no task or sweep runs once the rest starts going away.
  DeviceExecutor executor_;
  std::mutex sweep_mu_;
  std::condition_variable sweep_cv_;
  bool sweep_stop_ = false;
  std::thread sweeper_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_SERVICE_H_
