// Metric families and their update helpers (see metrics.h, docs/METRICS.md). prometheus-cpp's
// Family::Add returns the existing series for known labels, so helpers look series up by label
// on each update instead of caching pointers that a layer deletion could invalidate.
#include "server/metrics.h"

#include <string>

namespace moe::server {
namespace {

const prometheus::Histogram::BucketBoundaries& StageBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
  return *buckets;
}

}  // namespace

Metrics::Metrics(std::string device)
    : device_(std::move(device)), registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  requests_ =
      &prometheus::BuildCounter()
           .Name("moe_requests_total")
           .Help("Finished requests (Forward/Backward: micro-batches) by method and gRPC code")
           .Register(r);
  tokens_ = &prometheus::BuildCounter()
                 .Name("moe_tokens_total")
                 .Help("Tokens processed by layer and direction (forward|backward)")
                 .Register(r);
  expert_tokens_ = &prometheus::BuildCounter()
                        .Name("moe_expert_tokens_total")
                        .Help("(token, k) assignments routed to each expert by Forward")
                        .Register(r);
  stage_ = &prometheus::BuildHistogram()
                .Name("moe_stage_duration_seconds")
                .Help("Per-stage latency (receive, queue, compute, send) by method")
                .Register(r);
  bytes_in_ = &prometheus::BuildCounter()
                   .Name("moe_received_bytes_total")
                   .Help("Serialized bytes of request messages read, by method")
                   .Register(r);
  bytes_out_ = &prometheus::BuildCounter()
                    .Name("moe_sent_bytes_total")
                    .Help("Serialized bytes of response messages written, by method")
                    .Register(r);
  context_bytes_ = &prometheus::BuildGauge()
                        .Name("moe_saved_context_bytes")
                        .Help("Bytes held by saved training contexts")
                        .Register(r)
                        .Add({});
  context_budget_ = &prometheus::BuildGauge()
                         .Name("moe_saved_context_budget_bytes")
                         .Help("Byte budget for saved training contexts")
                         .Register(r)
                         .Add({});
  contexts_ = &prometheus::BuildGauge()
                   .Name("moe_saved_contexts")
                   .Help("Number of saved training contexts")
                   .Register(r)
                   .Add({});
  contexts_dropped_ = &prometheus::BuildCounter()
                           .Name("moe_saved_contexts_dropped_total")
                           .Help("Saved contexts freed without a Backward, by reason")
                           .Register(r);
  context_rejections_ = &prometheus::BuildCounter()
                             .Name("moe_saved_context_rejections_total")
                             .Help("Training Forwards refused because of the context budget")
                             .Register(r)
                             .Add({});
  steps_ = &prometheus::BuildCounter()
                .Name("moe_optimizer_steps_total")
                .Help("Optimizer steps applied, by layer")
                .Register(r);
  grad_norm_ = &prometheus::BuildGauge()
                    .Name("moe_grad_norm")
                    .Help("Global gradient L2 norm of the last Step, by layer")
                    .Register(r);
  layers_ =
      &prometheus::BuildGauge().Name("moe_layers").Help("Layers on the server").Register(r).Add({});
  resident_ = &prometheus::BuildGauge()
                   .Name("moe_layer_resident_bytes")
                   .Help("Bytes of weights, gradients and optimizer state per layer")
                   .Register(r);
  memory_used_ = &prometheus::BuildGauge()
                      .Name("moe_device_memory_used_bytes")
                      .Help("Device memory in use")
                      .Register(r)
                      .Add({{"device", device_}});
  memory_total_ = &prometheus::BuildGauge()
                       .Name("moe_device_memory_total_bytes")
                       .Help("Device memory capacity")
                       .Register(r)
                       .Add({{"device", device_}});
  pinned_host_ = &prometheus::BuildGauge()
                      .Name("moe_pinned_host_bytes")
                      .Help("Page-locked host memory the engine holds for large tensors")
                      .Register(r)
                      .Add({});
  streams_ = &prometheus::BuildGauge()
                  .Name("moe_active_streams")
                  .Help("Open streams by method")
                  .Register(r);
  striped_ = &prometheus::BuildCounter()
                  .Name("moe_striped_micro_batches_total")
                  .Help("Micro-batches that arrived striped over several streams, by method")
                  .Register(r);
  sessions_ = &prometheus::BuildGauge()
                   .Name("moe_sessions")
                   .Help("Open client sessions")
                   .Register(r)
                   .Add({});
  memory_budget_ = &prometheus::BuildGauge()
                        .Name("moe_memory_budget_bytes")
                        .Help("Bytes the server admits into each memory (device, host)")
                        .Register(r);
  auto& admitted = prometheus::BuildGauge()
                       .Name("moe_memory_admitted_bytes")
                       .Help("Bytes admitted against the memory budget, by kind")
                       .Register(r);
  admitted_layer_state_ = &admitted.Add({{"kind", "layer_state"}});
  admitted_contexts_ = &admitted.Add({{"kind", "saved_contexts"}});
  admitted_requests_ = &admitted.Add({{"kind", "requests"}});
  admission_rejections_ = &prometheus::BuildCounter()
                               .Name("moe_admission_rejections_total")
                               .Help(
                                   "Requests refused for the memory budget or a principal's "
                                   "quota, by reason")
                               .Register(r);
  transport_calls_ = &prometheus::BuildCounter()
                          .Name("moe_transport_calls_total")
                          .Help(
                              "Forward and Backward micro-batches answered, by method and the "
                              "transport of their tensors (tcp, shared_memory, cuda_ipc, nccl)")
                          .Register(r);
  transport_bytes_ = &prometheus::BuildCounter()
                          .Name("moe_transport_bytes_total")
                          .Help("Forward and Backward bytes moved, by direction and transport")
                          .Register(r);
  regions_ = &prometheus::BuildGauge()
                  .Name("moe_regions")
                  .Help("Memory regions clients registered")
                  .Register(r)
                  .Add({});
  region_bytes_ = &prometheus::BuildGauge()
                       .Name("moe_region_bytes")
                       .Help("Bytes of the memory regions clients registered")
                       .Register(r)
                       .Add({});
  event_pairs_ = &prometheus::BuildGauge()
                      .Name("moe_event_pairs")
                      .Help("CUDA event pairs clients registered")
                      .Register(r)
                      .Add({});
}

void Metrics::Request(const std::string& method, const char* code) {
  requests_->Add({{"method", method}, {"code", code}}).Increment();
}
void Metrics::Tokens(const std::string& layer, const char* direction, int64_t n) {
  tokens_->Add({{"layer", layer}, {"direction", direction}}).Increment(static_cast<double>(n));
}
void Metrics::ExpertTokens(const std::string& layer, int64_t expert_first,
                           const std::vector<int64_t>& counts) {
  for (size_t i = 0; i < counts.size(); ++i) {
    expert_tokens_->Add({{"layer", layer}, {"expert", std::to_string(expert_first + i)}})
        .Increment(static_cast<double>(counts[i]));
  }
}
void Metrics::Stage(const std::string& method, const char* stage, double seconds) {
  stage_->Add({{"method", method}, {"stage", stage}}, StageBuckets()).Observe(seconds);
}
void Metrics::BytesIn(const std::string& method, int64_t n) {
  bytes_in_->Add({{"method", method}}).Increment(static_cast<double>(n));
}
void Metrics::BytesOut(const std::string& method, int64_t n) {
  bytes_out_->Add({{"method", method}}).Increment(static_cast<double>(n));
}
void Metrics::SavedContexts(int64_t count, int64_t bytes) {
  contexts_->Set(static_cast<double>(count));
  context_bytes_->Set(static_cast<double>(bytes));
}
void Metrics::SavedContextBudget(int64_t bytes) {
  context_budget_->Set(static_cast<double>(bytes));
}
void Metrics::ContextsDropped(const char* reason, int64_t n) {
  contexts_dropped_->Add({{"reason", reason}}).Increment(static_cast<double>(n));
}
void Metrics::ContextRejected() { context_rejections_->Increment(); }
void Metrics::OptimizerStep(const std::string& layer, double grad_norm) {
  steps_->Add({{"layer", layer}}).Increment();
  grad_norm_->Add({{"layer", layer}}).Set(grad_norm);
}
void Metrics::Layers(int64_t n) { layers_->Set(static_cast<double>(n)); }
void Metrics::LayerResident(const std::string& layer, int64_t bytes) {
  resident_->Add({{"layer", layer}}).Set(static_cast<double>(bytes));
}
void Metrics::DeviceMemory(int64_t used, int64_t total) {
  memory_used_->Set(static_cast<double>(used));
  memory_total_->Set(static_cast<double>(total));
}
void Metrics::PinnedHostMemory(int64_t bytes) { pinned_host_->Set(static_cast<double>(bytes)); }
void Metrics::StripedMicroBatch(const std::string& method) {
  striped_->Add({{"method", method}}).Increment();
}
void Metrics::StreamOpened(const std::string& method) {
  streams_->Add({{"method", method}}).Increment();
}
void Metrics::StreamClosed(const std::string& method) {
  streams_->Add({{"method", method}}).Decrement();
}
void Metrics::Sessions(int64_t n) { sessions_->Set(static_cast<double>(n)); }
void Metrics::MemoryBudgetBytes(const char* memory, int64_t bytes) {
  memory_budget_->Add({{"memory", memory}}).Set(static_cast<double>(bytes));
}
void Metrics::MemoryAdmitted(int64_t layer_state, int64_t saved_contexts, int64_t requests) {
  admitted_layer_state_->Set(static_cast<double>(layer_state));
  admitted_contexts_->Set(static_cast<double>(saved_contexts));
  admitted_requests_->Set(static_cast<double>(requests));
}
void Metrics::AdmissionRejected(const char* reason) {
  admission_rejections_->Add({{"reason", reason}}).Increment();
}
void Metrics::TransportCall(const std::string& method, const char* transport) {
  transport_calls_->Add({{"method", method}, {"transport", transport}}).Increment();
}
void Metrics::TransportBytes(const char* direction, const char* transport, int64_t n) {
  transport_bytes_->Add({{"direction", direction}, {"transport", transport}})
      .Increment(static_cast<double>(n));
}
void Metrics::Regions(int64_t regions, int64_t bytes, int64_t event_pairs) {
  regions_->Set(static_cast<double>(regions));
  region_bytes_->Set(static_cast<double>(bytes));
  event_pairs_->Set(static_cast<double>(event_pairs));
}

void Metrics::RemoveLayer(const std::string& layer, int64_t num_experts) {
  for (const char* dir : {"forward", "backward"}) {
    tokens_->Remove(&tokens_->Add({{"layer", layer}, {"direction", dir}}));
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    auto labels =
        std::map<std::string, std::string>{{"layer", layer}, {"expert", std::to_string(e)}};
    if (expert_tokens_->Has(labels)) expert_tokens_->Remove(&expert_tokens_->Add(labels));
  }
  steps_->Remove(&steps_->Add({{"layer", layer}}));
  grad_norm_->Remove(&grad_norm_->Add({{"layer", layer}}));
  resident_->Remove(&resident_->Add({{"layer", layer}}));
}

}  // namespace moe::server
