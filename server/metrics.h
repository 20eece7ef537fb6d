// moe-server's Prometheus metrics (docs/METRICS.md is the exact list; keep the two in step).
//
// One Registry; the HTTP endpoint that serves it (metrics_http.h) lives in the server, so tests can
// read the same numbers without HTTP. Per-layer series are removed when a layer is deleted, which
// keeps every label bounded by what exists on the server.
#ifndef MOE_SERVER_METRICS_H_
#define MOE_SERVER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe::server {

class Metrics {
 public:
  explicit Metrics(std::string device);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void Request(const std::string& method, const char* code);
  void Tokens(const std::string& layer, const char* direction, int64_t n);
  void ExpertTokens(const std::string& layer, int64_t expert_first,
                    const std::vector<int64_t>& counts);
  void Stage(const std::string& method, const char* stage, double seconds);
  void BytesIn(const std::string& method, int64_t n);
  void BytesOut(const std::string& method, int64_t n);
  void SavedContexts(int64_t count, int64_t bytes);
  void SavedContextBudget(int64_t bytes);
  void ContextsDropped(const char* reason, int64_t n);
  void ContextRejected();
  void OptimizerStep(const std::string& layer, double grad_norm);
  void Layers(int64_t n);
  void LayerResident(const std::string& layer, int64_t bytes);
  void DeviceMemory(int64_t used, int64_t total);
  void PinnedHostMemory(int64_t bytes);
  void StreamOpened(const std::string& method);
  void StreamClosed(const std::string& method);
  void StripedMicroBatch(const std::string& method);
  void Sessions(int64_t n);
  // Admission (memory_ledger.h): a budget by memory ("device" or "host"), what is admitted by
  // kind, and refusals by reason ("memory_budget", "layer_quota", "context_quota").
  void MemoryBudgetBytes(const char* memory, int64_t bytes);
  void MemoryAdmitted(int64_t layer_state, int64_t saved_contexts, int64_t requests);
  void AdmissionRejected(const char* reason);
  // The data plane (docs/PROTOCOL.md, "Registered memory regions"): a Forward or Backward
  // micro-batch answered, by the transport its tensors took ("tcp": in its messages;
  // "shared_memory", "cuda_ipc": by reference in registered regions), and tensor bytes moved by
  // direction ("in", "out") and transport.
  void TransportCall(const std::string& method, const char* transport);
  void TransportBytes(const char* direction, const char* transport, int64_t n);
  // Registered regions, their bytes, and event pairs, on the server now.
  void Regions(int64_t regions, int64_t bytes, int64_t event_pairs);
  // Drops every series labelled with `layer` (num_experts: how many expert series it may have).
  void RemoveLayer(const std::string& layer, int64_t num_experts);

 private:
  std::string device_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Counter>* expert_tokens_;
  prometheus::Family<prometheus::Histogram>* stage_;
  prometheus::Family<prometheus::Counter>* bytes_in_;
  prometheus::Family<prometheus::Counter>* bytes_out_;
  prometheus::Gauge* context_bytes_;
  prometheus::Gauge* context_budget_;
  prometheus::Gauge* contexts_;
  prometheus::Family<prometheus::Counter>* contexts_dropped_;
  prometheus::Counter* context_rejections_;
  prometheus::Family<prometheus::Counter>* steps_;
  prometheus::Family<prometheus::Gauge>* grad_norm_;
  prometheus::Gauge* layers_;
  prometheus::Family<prometheus::Gauge>* resident_;
  prometheus::Gauge* memory_used_;
  prometheus::Gauge* memory_total_;
  prometheus::Gauge* pinned_host_;
  prometheus::Family<prometheus::Gauge>* streams_;
  prometheus::Family<prometheus::Counter>* striped_;
  prometheus::Gauge* sessions_;
  prometheus::Family<prometheus::Gauge>* memory_budget_;
  prometheus::Gauge* admitted_layer_state_;
  prometheus::Gauge* admitted_contexts_;
  prometheus::Gauge* admitted_requests_;
  prometheus::Family<prometheus::Counter>* admission_rejections_;
  prometheus::Family<prometheus::Counter>* transport_calls_;
  prometheus::Family<prometheus::Counter>* transport_bytes_;
  prometheus::Gauge* regions_;
  prometheus::Gauge* region_bytes_;
  prometheus::Gauge* event_pairs_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_METRICS_H_
