// The MoE layer contract and the engine interface every device implements.
//
// This header is the single definition of what a layer computes; docs/CONTRACT.md says the
// same in prose. The server talks only to `Engine` and `Layer`, so the CPU engine and the CUDA
// engine are interchangeable behind it.
//
// Where the bytes live (see "Device tensors" in docs/CONTRACT.md). Every input is a view and
// says where its bytes are (common/tensor.h MemoryLocation): host memory (what the server
// received as bytes) or a CUDA device's memory (a trainer's tensor mapped into the server,
// engine/ipc.h). Every output goes either into a Tensor the engine allocates in host memory
// (the request names no destination) or straight into a caller's destination
// (MutableTensorView, host or device memory). The CPU engine takes host memory only and refuses a
// device view or destination with InvalidArgument naming it; the CUDA engine takes both and
// reads inputs on its own device in place. Destinations must not overlap any input or each other
// (InvalidArgument). Every view is checked (dtype, shape, byte size, location) before any work.
//
// When things are complete (StreamOrder below):
//   - Without a done_event the call returns with all its work finished: every output is
//     written and every input may be reused or freed.
//   - With a done_event (CUDA engine only) the call returns once the work is enqueued on the
//     engine's stream and records done_event after its last write of every output and its last
//     read of every input: device outputs are complete, and device inputs may be reused, once
//     done_event has fired. Outputs in host memory and results returned by value are complete
//     when the call returns, and host inputs may be reused then too.
//   - Inputs a layer keeps for its Backward (x, the routing) are copied into the engine's own
//     memory: a caller never keeps an input alive for a saved context.
//   - wait_event: the engine's stream waits on it before reading any device input or writing any
//     device destination, so a trainer enqueues "x is ready" on its stream and hands over.
//   - A call that fails has finished all its work when it returns and records no done_event.
//
// Math (per token t, shapes below):
//   routing  client: idx [T,K] int32 global expert ids, p [T,K] weights (given).
//            server: logits = x Wr (fp32), s = softmax(logits), (idx, p) = top-K of s
//                    (ties to the lower expert id), p /= sum_k p when `renormalize`.
//   expert   SwiGLU: y_e(x) = W2_e (silu(W1_e x) * (W3_e x))
//            SiLU | GeLU (tanh) | ReLU: y_e(x) = W2_e act(W1_e x)           (no W3)
//   output   out[t] = sum_k p[t,k] * y_{idx[t,k]}(x[t]), summing only the k whose expert lies
//            in this layer's shard [expert_first, expert_first + expert_count).
//   aux      (server routing) Switch load-balancing loss
//              aux = aux_loss_coef * E * sum_e f_e * P_e,
//              f_e = (#(t,k) with idx[t,k]=e) / (T*K),  P_e = mean_t s[t,e];
//            router z-loss  z = z_loss_coef * mean_t (logsumexp_e logits[t,e])^2.
//            Both are added to the loss whose gradient the backward returns, times
//            BackwardRequest::aux_grad_scale (they contribute to dWr). In a sharded layer every
//            shard computes the full router; only the shard with expert_first == 0 adds the aux
//            terms to dWr, so that a client summing shard gradients counts them once.
//   backward from dout [T,d]: dx [T,d] (with server routing dx also carries the path through
//            the router: softmax/top-K/renormalise and the aux terms); dp [T,K] fp32 (client
//            routing; 0 for k routed outside the shard); dW1, dW3, dW2 (and dWr for server routing)
//            are ACCUMULATED (summed) across Backward calls until Step() consumes and clears them.
//
// Layouts, row-major, local expert index l = e - expert_first:
//   x, out, dout, dx  [T, d]          dtype = LayerConfig::dtype
//   idx [T, K] int32;  p [T, K] float32 or the layer dtype;  dp [T, K] float32
//   w1, w3 [count, h, d]   w2 [count, d, h]   router [d, E] (server routing only)
// Storage is fp32 or bf16; every accumulation is fp32. With bf16 storage the optimizer keeps
// fp32 master weights and writes the rounded bf16 copy after each step.
#ifndef MOE_ENGINE_LAYER_H_
#define MOE_ENGINE_LAYER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/layer_config.h"
#include "common/tensor.h"
#include "engine/engine_options.h"
#include "engine/ipc.h"
#include "engine/nccl.h"

namespace moe {

// What a training Forward keeps for its Backward. Opaque to the server, which stores it under
// the client's context id and accounts its bytes against the saved-context budget.
class SavedContext {
 public:
  virtual ~SavedContext() = default;
  virtual int64_t num_tokens() const = 0;
  // Bytes this context holds (host or device), for the budget and the metrics.
  virtual int64_t bytes() const = 0;
};

// Stream ordering against a caller's CUDA work, for calls on device memory. Both are opaque
// cudaEvent_t values (this header needs no CUDA), owned by the caller; null: none.
struct StreamOrder {
  // The engine's stream waits on it before reading any device input or writing any device
  // destination. Any device's event (an interprocess one, engine/ipc.h, included).
  void* wait_event = nullptr;
  // Recorded on the engine's stream after the last write of every output and the last read of
  // every input; the call then returns without waiting for its device work. An event of the
  // engine's device (Engine::CreateCudaIpcEvent makes one a trainer can wait on).
  void* done_event = nullptr;

  bool empty() const { return wait_event == nullptr && done_event == nullptr; }
};

struct ForwardRequest {
  TensorView x;            // [T, d], layer dtype
  TensorView expert_ids;   // [T, K] int32; client routing only (empty otherwise)
  TensorView weights;      // [T, K] fp32 or layer dtype; client routing only
  bool training = true;    // false: keep nothing, return no context
  // [T, d] layer dtype. Empty: ForwardResult::out is a host Tensor the engine allocates. Set:
  // the engine writes out there (host or device memory) and ForwardResult::out stays empty.
  MutableTensorView out;
  StreamOrder order;
};

struct ForwardResult {
  Tensor out;              // [T, d], layer dtype; empty when the request named a destination
  // Server routing: the routing the router chose. Client routing: empty, as the caller has it
  // (echoing it would cost a device-to-host copy and, through moe-server, its bytes on the wire).
  Tensor expert_ids;       // [T, K] int32
  Tensor weights;          // [T, K] fp32
  double aux_loss = 0.0;   // server routing: load-balancing term (already times its coef)
  double z_loss = 0.0;     // server routing: z-loss term (already times its coef)
  std::vector<int64_t> tokens_per_local_expert;  // (t,k) entries routed to each local expert
  std::unique_ptr<SavedContext> context;         // null unless training
};

// A Backward's inputs and where its outputs go; each destination works as ForwardRequest::out
// (empty: the result carries a host Tensor; set: written there, the result's tensor empty).
struct BackwardRequest {
  TensorView dout;             // [T, d], layer dtype
  MutableTensorView dx;        // [T, d], layer dtype
  MutableTensorView dweights;  // [T, K] fp32; client routing only (must be empty otherwise)
  StreamOrder order;
  // d loss / d (aux + z): the weight of the Forward's aux terms in the caller's loss. The router
  // backward adds their gradient times this (server routing; 1: loss = task + aux + z, 0: the
  // aux terms are reported but not trained). Finite (the server checks it).
  double aux_grad_scale = 1.0;
};

struct BackwardResult {
  Tensor dx;        // [T, d], layer dtype; empty when the request named a destination
  Tensor dweights;  // [T, K] fp32, client routing only (empty for server routing, or
                    // when the request named a destination)
};

struct StepResult {
  int64_t step = 0;                       // optimizer steps taken so far, this one included
  double grad_norm = 0.0;                 // global L2 norm before clipping
  std::vector<int64_t> tokens_per_expert; // local experts, since the previous step
};

// One MoE layer on one device. Thread-compatible, not thread-safe: the server's per-device
// executor serialises calls to a layer.
class Layer {
 public:
  virtual ~Layer() = default;
  virtual const LayerConfig& config() const = 0;

  // Validates shapes, dtypes and ids (InvalidArgument naming the field) before any work.
  virtual absl::StatusOr<ForwardResult> Forward(const ForwardRequest& request) = 0;
  // Consumes `context` (from a training Forward of this layer), also when it fails.
  virtual absl::StatusOr<BackwardResult> Backward(std::unique_ptr<SavedContext> context,
                                                  const BackwardRequest& request) = 0;
  // dout [T, d] (layer dtype), outputs returned as host tensors.
  absl::StatusOr<BackwardResult> Backward(std::unique_ptr<SavedContext> context,
                                          const TensorView& dout) {
    BackwardRequest request;
    request.dout = dout;
    return Backward(std::move(context), request);
  }
  // Applies the optimizer to the accumulated gradients, then clears them.
  virtual absl::StatusOr<StepResult> Step() = 0;
  // Drops accumulated gradients and token counts without stepping.
  virtual absl::Status ZeroGrad() = 0;
  virtual int64_t step() const = 0;

  // Full state by name, for checkpoints and weight export. Names: "w1", "w3" (gated only),
  // "w2", "router" (server routing only); optimizer state "<name>.exp_avg", "<name>.exp_avg_sq"
  // (AdamW) or "<name>.momentum" (SGD), "<name>.master" (bf16 storage), all fp32; "step" is a
  // [1] int64 tensor. ExportState(false) gives only the weights, in the layer dtype.
  virtual absl::StatusOr<std::map<std::string, Tensor>> ExportState(
      bool include_optimizer) const = 0;
  // Replaces the named tensors (any subset; shapes and dtypes must match exactly). A tensor
  // named "step" ([1] int64) sets the step counter. Validates everything before changing
  // anything, so a rejected import leaves the layer as it was.
  virtual absl::Status ImportState(const std::map<std::string, Tensor>& state) = 0;

  // Bytes of device (or host, for the CPU engine) memory the layer's weights, gradients and
  // optimizer state occupy.
  virtual int64_t resident_bytes() const = 0;
};

// The memory a device offers its layers and saved contexts.
struct DeviceMemoryInfo {
  int64_t total_bytes = 0;  // capacity (the CPU engine: the machine's physical memory)
  int64_t free_bytes = 0;   // free now, to any process
  bool host = false;        // it is this process's host memory (the CPU engine)
};

// The engine calls whose working memory a server budgets (Engine::HostWorkingBytes).
enum class EngineCall { kForward, kTrainingForward, kBackward };

// A device. Creates layers on it; reports its memory.
class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string name() const = 0;   // "cpu", "cuda:0"
  virtual absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(const LayerConfig& config) = 0;
  // The bytes of state (weights, gradients, optimizer state, fp32 masters) a layer of `config`
  // would hold on this engine: exactly what its resident_bytes() reports once created. Computed
  // from the config alone, so a server can refuse a layer that does not fit before anything is
  // allocated. InvalidArgument for a config CreateLayer would refuse; ResourceExhausted when the
  // count does not fit in int64.
  virtual absl::StatusOr<int64_t> LayerStateBytes(const LayerConfig& config) const = 0;
  // The host memory one `call` of `tokens` tokens on a layer of `config` allocates besides its
  // inputs and the layer's state: working buffers, results and (a training Forward) the saved
  // context. An upper bound from the config alone, so a server can refuse a micro-batch its
  // host memory cannot hold before the engine allocates (an engine working in host memory would
  // otherwise be killed by the kernel's OOM killer, not refused). The CPU engine's whole working
  // set is host memory; the CUDA engine's host share is its results (its device memory running
  // out is already ResourceExhausted). ResourceExhausted past 2^62 bytes.
  virtual absl::StatusOr<int64_t> HostWorkingBytes(const LayerConfig& config, int64_t tokens,
                                                   EngineCall call) const = 0;
  // The device's memory now (cudaMemGetInfo for a GPU; the host's for the CPU engine).
  // Unavailable when it cannot be read.
  virtual absl::StatusOr<DeviceMemoryInfo> DeviceMemory() const = 0;
  virtual int64_t memory_in_use_bytes() const = 0;
  virtual int64_t memory_total_bytes() const = 0;
  // Page-locked host memory the engine holds for the process's large tensors (the CUDA engine's
  // engine/cuda/pinned_pool.h), in use and kept for reuse; 0 for an engine that pins none.
  virtual int64_t pinned_host_bytes() const { return 0; }

  // CUDA IPC (engine/ipc.h): what a server needs to use memory and events another process on
  // this host shares. An engine without CUDA refuses all three with FailedPrecondition.
  //
  // Maps [offset, offset + size_bytes) of the allocation `mem_handle` (cudaIpcMemHandle_t bytes)
  // names, which is on CUDA device `device` (this process's ordinal). InvalidArgument naming
  // the field for a handle of the wrong length, a device out of range or not the memory's, or a
  // range past the allocation's end; an error, never a crash, for a handle CUDA cannot open.
  virtual absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapCudaIpcMemory(
      absl::string_view mem_handle, int device, int64_t offset, int64_t size_bytes);
  // Opens another process's interprocess event (cudaIpcEventHandle_t bytes) with the engine's
  // device current, whatever device made it: an IPC event is waited on and recorded only by
  // streams of the device it was opened under (another device's stream faults on it).
  virtual absl::StatusOr<std::unique_ptr<SharedEvent>> OpenCudaIpcEvent(absl::string_view handle);
  // A new interprocess event on the engine's device and its handle bytes, for a peer to open.
  virtual absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> CreateCudaIpcEvent();

  // NCCL (engine/nccl.h): a link to a peer process's GPU whose unique ids the server hands the
  // peer, started without waiting for it. An engine without CUDA, or built without NCCL, refuses
  // with FailedPrecondition saying so (engine/nccl.cc).
  virtual absl::StatusOr<std::unique_ptr<NcclLink>> StartNcclLink();
};

// "auto" picks cuda:0 when a GPU is present (and the CUDA engine was built), else cpu.
// "cpu", "cuda", "cuda:N". Unknown or unavailable devices give InvalidArgument / Unavailable.
// `options` (engine/engine_options.h) carries the operator's settings to the engine made.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const std::string& device,
                                                     const EngineOptions& options = {});

}  // namespace moe

#endif  // MOE_ENGINE_LAYER_H_
