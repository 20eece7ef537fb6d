// moe_offload._core: the Python binding of moe::client (client/client.h) that the moe_offload
// package's RemoteMoE is built on. It binds only that header's public API.
//
// Tensors cross as raw memory, not as torch objects, so the module links neither libtorch nor
// numpy and works with whichever torch the interpreter has: a tensor is (data pointer, byte
// count, shape, dtype code, device) of a contiguous tensor, device -1 for host memory or N for
// cuda:N. Host inputs the client reads in place (its Forward and Backward copy what they send
// before returning, so nothing else copies them); a host output is a HostBuffer that owns the
// client's result tensor and exposes its bytes through the buffer protocol, which
// torch.frombuffer wraps without a copy. Device tensors go through forward_into and
// backward_into (the client's ForwardInto and BackwardInto): results are written into
// destinations Python allocated, ordered on the caller's CUDA stream (a cudaStream_t passed as
// an integer), with no host wait on the GPU. Every call that can block (connecting, RPCs,
// waiting on a future) runs with the GIL released. A failed call raises
// moe_offload.ServerError with the gRPC status code's name and the message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/layer_config.h"
#include "common/tensor.h"

namespace py = pybind11;

namespace moe::python {
namespace {

// A non-OK absl::Status on its way to Python (translated to moe_offload.ServerError).
struct StatusError : std::exception {
  explicit StatusError(const absl::Status& s)
      : code(absl::StatusCodeToString(s.code())), message(s.message()) {}
  const char* what() const noexcept override { return message.c_str(); }
  std::string code;
  std::string message;
};

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> result) {
  ThrowIfError(result.status());
  return *std::move(result);
}

// An owning host tensor handed to Python; its bytes are the buffer (format "B", writable so
// that torch.frombuffer does not warn; the memory is this object's alone).
struct HostBuffer {
  Tensor tensor;
};

// Python's description of a tensor, (data_ptr, nbytes, shape, dtype code, device: -1 host,
// N cuda:N), as a destination, or an empty one for None. The memory must stay valid for the
// call (and, on a device, until the caller's stream passes it): the Python side holds it.
MutableTensorView MutableViewOf(const py::object& spec) {
  if (spec.is_none()) return {};
  auto t = spec.cast<py::tuple>();
  if (t.size() != 5) {
    throw std::invalid_argument("tensor spec: (data_ptr, nbytes, shape, dtype, device)");
  }
  MutableTensorView v;
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  v.size_bytes = t[1].cast<size_t>();
  v.shape = t[2].cast<std::vector<int64_t>>();
  v.dtype = static_cast<DType>(t[3].cast<int>());
  const int device = t[4].cast<int>();
  v.location = device < 0 ? MemoryLocation::Host() : MemoryLocation::Cuda(device);
  return v;
}

// The same as an input, or an absent one for None.
TensorView ViewOf(const py::object& spec) {
  if (spec.is_none()) return {};
  return MutableViewOf(spec).view();
}

client::Transport TransportOf(const std::string& name) {
  if (name == "auto") return client::Transport::kAuto;
  if (name == "tcp") return client::Transport::kTcp;
  if (name == "shm") return client::Transport::kSharedMemory;
  throw std::invalid_argument(
      absl::StrCat("transport: \"", name, "\" is not one of \"auto\", \"tcp\", \"shm\""));
}

client::DeviceTransportRequest DeviceTransportOf(const std::string& name) {
  if (name == "auto") return client::DeviceTransportRequest::kAuto;
  if (name == "nccl") return client::DeviceTransportRequest::kNccl;
  if (name == "never") return client::DeviceTransportRequest::kNever;
  throw std::invalid_argument(absl::StrCat("device_transport: \"", name,
                                           "\" is not one of \"auto\", \"nccl\", \"never\""));
}

const char* DeviceTransportKey(client::DeviceTransportRequest request) {
  return request == client::DeviceTransportRequest::kNccl    ? "nccl"
         : request == client::DeviceTransportRequest::kNever ? "never"
                                                              : "auto";
}

const char* TransportKey(client::Transport transport) {
  return transport == client::Transport::kSharedMemory ? "shm"
         : transport == client::Transport::kTcp        ? "tcp"
                                                       : "auto";
}

// An output tensor as Python receives it: (HostBuffer, shape, dtype code).
py::tuple Out(Tensor t) {
  std::vector<int64_t> shape = t.shape;
  const int dtype = static_cast<int>(t.dtype);
  return py::make_tuple(HostBuffer{std::move(t)}, shape, dtype);
}

py::dict StateToPython(std::map<std::string, Tensor> state) {
  py::dict d;
  for (auto& [name, t] : state) d[py::str(name)] = Out(std::move(t));
  return d;
}

// Copies each (name -> tensor spec) into the owning map ImportWeights takes.
std::map<std::string, Tensor> StateFromPython(const py::dict& d) {
  std::map<std::string, Tensor> state;
  for (auto [k, v] : d) {
    state.emplace(k.cast<std::string>(), client::ToTensor(ViewOf(py::reinterpret_borrow<py::object>(v))));
  }
  return state;
}

// The client's transport decisions (ClientOptions::log) go to the "moe_offload" logger at INFO.
// The client calls it from within a call (Connect, a first device call), on the calling thread
// or one of gRPC's; it holds no Python object, so a connection may end on any thread.
void LogToPython(const std::string& line) {
  py::gil_scoped_acquire acquire;
  try {
    py::module_::import("logging").attr("getLogger")("moe_offload").attr("info")(line);
  } catch (const std::exception&) {
    // A log line that cannot be written is dropped; the call it describes goes on.
  }
}

// One logical layer: a RemoteLayer on one server, or a ShardedLayer over several. Shard i is
// the RemoteLayer holding the i-th contiguous range of experts (the only one, unsharded).
class CoreLayer {
 public:
  static std::unique_ptr<CoreLayer> Open(const std::vector<std::string>& targets, bool sharded,
                                         const std::string& name, const LayerConfig& config,
                                         bool create, const client::ClientOptions& options,
                                         const std::vector<std::string>& shared_with) {
    if (targets.empty()) throw std::invalid_argument("servers: at least one server is needed");
    std::unique_ptr<CoreLayer> layer(new CoreLayer());
    client::ClientOptions with_log = options;
    with_log.log = LogToPython;
    py::gil_scoped_release release;
    std::vector<std::shared_ptr<client::Connection>> conns;
    for (const std::string& target : targets) {
      conns.push_back(ValueOrThrow(client::Connection::Connect(target, with_log)));
    }
    if (!sharded) {
      layer->single_ = ValueOrThrow(
          create ? client::RemoteLayer::Create(conns[0], name, config, shared_with)
                 : client::RemoteLayer::Attach(conns[0], name));
      return layer;
    }
    LayerConfig whole = config;
    if (!create) {
      // Every shard must exist already; the first one's config (unsharded) is the layer's.
      for (const auto& conn : conns) {
        auto shard = ValueOrThrow(client::RemoteLayer::Attach(conn, name));
        if (conn == conns[0]) whole = shard->config();
      }
      whole.expert_first = 0;
      whole.expert_count = -1;
    }
    layer->sharded_ = ValueOrThrow(client::ShardedLayer::Create(conns, name, whole));
    return layer;
  }

  LayerConfig config() const { return sharded_ ? sharded_->config() : single_->config(); }
  int num_shards() const { return sharded_ ? static_cast<int>(sharded_->num_shards()) : 1; }
  LayerConfig shard_config(int i) { return Shard(i).config(); }
  std::string shard_target(int i) { return Shard(i).connection().target(); }

  // -> (context_id, out, expert_ids, weights, aux_loss, z_loss); context_id 0 unless training.
  py::tuple Forward(const py::object& x, const py::object& ids, const py::object& weights,
                    bool training) {
    const TensorView xv = ViewOf(x), iv = ViewOf(ids), wv = ViewOf(weights);
    absl::StatusOr<client::ForwardOutput> r;
    {
      py::gil_scoped_release release;
      r = sharded_ ? sharded_->Forward(xv, iv, wv, training).get()
                   : single_->Forward(xv, iv, wv, training).get();
    }
    client::ForwardOutput f = ValueOrThrow(std::move(r));
    return py::make_tuple(f.context_id, Out(std::move(f.out)), Out(std::move(f.expert_ids)),
                          Out(std::move(f.weights)), f.aux_loss, f.z_loss);
  }

  // Forward into `out` (x's dtype and shape, on x's device), tensors host or device, ordered on
  // `stream` (a cudaStream_t; 0: the legacy default stream) -> (context_id, aux_loss, z_loss).
  // A sharded layer splits and sums device tensors on their GPU (client::ShardedLayer).
  py::tuple ForwardInto(const py::object& x, const py::object& ids, const py::object& weights,
                        const py::object& out, uintptr_t stream, bool training) {
    const TensorView xv = ViewOf(x), iv = ViewOf(ids), wv = ViewOf(weights);
    const MutableTensorView ov = MutableViewOf(out);
    void* const s = reinterpret_cast<void*>(stream);
    absl::StatusOr<client::ForwardOutput> r;
    {
      py::gil_scoped_release release;
      r = sharded_ ? sharded_->ForwardInto(xv, iv, wv, ov, s, training).get()
                   : single_->ForwardInto(xv, iv, wv, ov, s, training).get();
    }
    client::ForwardOutput f = ValueOrThrow(std::move(r));
    return py::make_tuple(f.context_id, f.aux_loss, f.z_loss);
  }

  // Backward into `dx` (dout's dtype and shape) and `dweights` ([T, K] float32, client routing;
  // None under server routing), ordered on `stream` as ForwardInto.
  void BackwardInto(uint64_t context_id, const py::object& dout, const py::object& dx,
                    const py::object& dweights, uintptr_t stream, double aux_loss_grad) {
    const TensorView dv = ViewOf(dout);
    const MutableTensorView dxv = MutableViewOf(dx), dwv = MutableViewOf(dweights);
    client::BackwardOptions options;
    options.aux_loss_grad = aux_loss_grad;
    void* const s = reinterpret_cast<void*>(stream);
    absl::StatusOr<client::BackwardOutput> r;
    {
      py::gil_scoped_release release;
      r = sharded_ ? sharded_->BackwardInto(context_id, dv, dxv, dwv, s, options).get()
                   : single_->BackwardInto(context_id, dv, dxv, dwv, s, options).get();
    }
    ThrowIfError(r.status());
  }

  // -> (dx, dweights); dweights has no elements with server routing. `aux_loss_grad`: d loss /
  // d aux (client::BackwardOptions; a sharded layer routes on the client and has no aux).
  py::tuple Backward(uint64_t context_id, const py::object& dout, double aux_loss_grad) {
    const TensorView dv = ViewOf(dout);
    client::BackwardOptions options;
    options.aux_loss_grad = aux_loss_grad;
    absl::StatusOr<client::BackwardOutput> r;
    {
      py::gil_scoped_release release;
      r = sharded_ ? sharded_->Backward(context_id, dv).get()
                   : single_->Backward(context_id, dv, options).get();
    }
    client::BackwardOutput b = ValueOrThrow(std::move(r));
    return py::make_tuple(Out(std::move(b.dx)), Out(std::move(b.dweights)));
  }

  py::dict Step() {
    absl::StatusOr<client::StepOutput> r;
    {
      py::gil_scoped_release release;
      r = sharded_ ? sharded_->Step() : single_->Step();
    }
    client::StepOutput s = ValueOrThrow(std::move(r));
    py::dict d;
    d["step"] = s.step;
    d["grad_norm"] = s.grad_norm;
    d["tokens_per_expert"] = s.tokens_per_expert;
    return d;
  }

  void ZeroGrad(int i) {
    client::RemoteLayer& shard = Shard(i);
    py::gil_scoped_release release;
    ThrowIfError(shard.ZeroGrad());
  }

  py::dict Export(int i, bool include_optimizer) {
    client::RemoteLayer& shard = Shard(i);
    absl::StatusOr<std::map<std::string, Tensor>> r;
    {
      py::gil_scoped_release release;
      r = shard.ExportWeights(include_optimizer);
    }
    return StateToPython(ValueOrThrow(std::move(r)));
  }

  void Import(int i, const py::dict& state) {
    client::RemoteLayer& shard = Shard(i);
    const std::map<std::string, Tensor> s = StateFromPython(state);
    py::gil_scoped_release release;
    ThrowIfError(shard.ImportWeights(s));
  }

  // -> {"path", "bytes", "step"} as the server reports them.
  py::dict Save(int i, const std::string& path) {
    client::RemoteLayer& shard = Shard(i);
    absl::StatusOr<v1::SaveCheckpointResponse> r;
    {
      py::gil_scoped_release release;
      r = shard.SaveCheckpoint(path);
    }
    v1::SaveCheckpointResponse s = ValueOrThrow(std::move(r));
    py::dict d;
    d["path"] = s.path();
    d["bytes"] = s.bytes();
    d["step"] = s.step();
    return d;
  }

  void Load(int i, const std::string& path) {
    client::RemoteLayer& shard = Shard(i);
    py::gil_scoped_release release;
    ThrowIfError(shard.LoadCheckpoint(path));
  }

  // Shard i's connection: how host tensors travel ("tcp" or "shm") and why, and how device
  // tensors do (client::DeviceTransportName: "unavailable", "undecided", "cuda ipc", "staged").
  py::dict TransportOfShard(int i) {
    client::Connection& conn = Shard(i).connection();
    py::dict d;
    d["host"] = TransportKey(conn.transport());
    d["reason"] = conn.transport_reason();
    d["device"] = client::DeviceTransportName(conn.device_transport());
    return d;
  }

  void ReleaseIdleDeviceRegions() {
    for (int i = 0; i < num_shards(); ++i) {
      client::Connection& conn = Shard(i).connection();
      py::gil_scoped_release release;
      ThrowIfError(conn.ReleaseIdleDeviceRegions());
    }
  }

 private:
  CoreLayer() = default;
  client::RemoteLayer& Shard(int i) {
    if (i < 0 || i >= num_shards()) {
      throw std::out_of_range(absl::StrCat("shard ", i, " of ", num_shards()));
    }
    return sharded_ ? sharded_->shard(i) : *single_;
  }
  std::unique_ptr<client::RemoteLayer> single_;
  std::unique_ptr<client::ShardedLayer> sharded_;
};

}  // namespace
}  // namespace moe::python

PYBIND11_MODULE(_core, m) {
  using namespace moe;
  using moe::python::CoreLayer;
  using moe::python::HostBuffer;
  m.doc() = "moe::client for Python (use moe_offload.RemoteMoE)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const moe::python::StatusError& e) {
      py::object cls = py::module_::import("moe_offload._errors").attr("ServerError");
      py::object instance = cls(e.code, e.message);
      PyErr_SetObject(cls.ptr(), instance.ptr());
    }
  });

  m.attr("DTYPE_FLOAT32") = static_cast<int>(DType::kFloat32);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(DType::kBFloat16);
  m.attr("DTYPE_INT32") = static_cast<int>(DType::kInt32);
  m.attr("DTYPE_INT64") = static_cast<int>(DType::kInt64);

  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol())
      .def_property_readonly("nbytes", [](const HostBuffer& b) { return b.tensor.bytes.size(); })
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.tensor.bytes.data(), 1, py::format_descriptor<uint8_t>::format(),
                               1, {static_cast<py::ssize_t>(b.tensor.bytes.size())}, {1},
                               /*readonly=*/false);
      });

  py::enum_<Activation>(m, "Activation")
      .value("SWIGLU", Activation::kSwiGLU)
      .value("SILU", Activation::kSiLU)
      .value("GELU_TANH", Activation::kGeLUTanh)
      .value("RELU", Activation::kReLU);
  py::enum_<RoutingMode>(m, "RoutingMode")
      .value("CLIENT", RoutingMode::kClient)
      .value("SERVER", RoutingMode::kServer);
  py::enum_<OptimizerKind>(m, "OptimizerKind")
      .value("ADAMW", OptimizerKind::kAdamW)
      .value("SGD", OptimizerKind::kSgd);

  py::class_<OptimizerConfig>(m, "OptimizerConfig")
      .def(py::init<>())
      .def_readwrite("kind", &OptimizerConfig::kind)
      .def_readwrite("learning_rate", &OptimizerConfig::learning_rate)
      .def_readwrite("beta1", &OptimizerConfig::beta1)
      .def_readwrite("beta2", &OptimizerConfig::beta2)
      .def_readwrite("epsilon", &OptimizerConfig::epsilon)
      .def_readwrite("weight_decay", &OptimizerConfig::weight_decay)
      .def_readwrite("momentum", &OptimizerConfig::momentum)
      .def_readwrite("max_grad_norm", &OptimizerConfig::max_grad_norm);

  py::class_<LayerConfig>(m, "LayerConfig")
      .def(py::init<>())
      .def_readwrite("num_experts", &LayerConfig::num_experts)
      .def_readwrite("top_k", &LayerConfig::top_k)
      .def_readwrite("d_model", &LayerConfig::d_model)
      .def_readwrite("d_hidden", &LayerConfig::d_hidden)
      .def_readwrite("activation", &LayerConfig::activation)
      .def_property(
          "dtype", [](const LayerConfig& c) { return static_cast<int>(c.dtype); },
          [](LayerConfig& c, int d) { c.dtype = static_cast<DType>(d); })
      .def_readwrite("routing", &LayerConfig::routing)
      .def_readwrite("expert_first", &LayerConfig::expert_first)
      .def_readwrite("expert_count", &LayerConfig::expert_count)
      .def_readwrite("seed", &LayerConfig::seed)
      .def_readwrite("init_scale", &LayerConfig::init_scale)
      .def_readwrite("renormalize", &LayerConfig::renormalize)
      .def_readwrite("aux_loss_coef", &LayerConfig::aux_loss_coef)
      .def_readwrite("z_loss_coef", &LayerConfig::z_loss_coef)
      .def_readwrite("recompute_h", &LayerConfig::recompute_h)
      .def_readwrite("optimizer", &LayerConfig::optimizer)
      .def("local_experts", &LayerConfig::local_experts);

  py::class_<client::ClientOptions>(m, "ClientOptions")
      .def(py::init<>())
      .def_property(
          "timeout_seconds",
          [](const client::ClientOptions& o) { return o.timeout.count() / 1000.0; },
          [](client::ClientOptions& o, double s) {
            o.timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
          })
      .def_readwrite("chunk_bytes", &client::ClientOptions::chunk_bytes)
      .def_readwrite("max_receive_bytes", &client::ClientOptions::max_receive_bytes)
      .def_readwrite("connections", &client::ClientOptions::connections)
      .def_readwrite("stripe_bytes", &client::ClientOptions::stripe_bytes)
      .def_readwrite("token", &client::ClientOptions::token)
      .def_property(
          "transport",
          [](const client::ClientOptions& o) { return moe::python::TransportKey(o.transport); },
          [](client::ClientOptions& o, const std::string& name) {
            o.transport = moe::python::TransportOf(name);
          })
      .def_property(
          "device_transport",
          [](const client::ClientOptions& o) {
            return moe::python::DeviceTransportKey(o.device_transport);
          },
          [](client::ClientOptions& o, const std::string& name) {
            o.device_transport = moe::python::DeviceTransportOf(name);
          })
      .def(
          "set_tls",
          [](client::ClientOptions& o, const std::string& ca_file, const std::string& cert_file,
             const std::string& key_file, const std::string& server_name) {
            o.tls.enabled = true;
            o.tls.ca_file = ca_file;
            o.tls.cert_file = cert_file;
            o.tls.key_file = key_file;
            o.tls.server_name = server_name;
          },
          py::arg("ca_file") = "", py::arg("cert_file") = "", py::arg("key_file") = "",
          py::arg("server_name") = "");

  m.def(
      "read_token_file",
      [](const std::string& path) {
        return moe::python::ValueOrThrow(client::ReadTokenFile(path, "token_file"));
      },
      py::arg("path"));

  py::class_<CoreLayer>(m, "CoreLayer")
      .def_static("open", &CoreLayer::Open, py::arg("targets"), py::arg("sharded"),
                  py::arg("name"), py::arg("config"), py::arg("create"), py::arg("options"),
                  py::arg("shared_with"))
      .def_property_readonly("config", &CoreLayer::config)
      .def_property_readonly("num_shards", &CoreLayer::num_shards)
      .def("shard_config", &CoreLayer::shard_config)
      .def("shard_target", &CoreLayer::shard_target)
      .def("forward", &CoreLayer::Forward, py::arg("x"), py::arg("expert_ids"),
           py::arg("weights"), py::arg("training"))
      .def("backward", &CoreLayer::Backward, py::arg("context_id"), py::arg("dout"),
           py::arg("aux_loss_grad"))
      .def("forward_into", &CoreLayer::ForwardInto, py::arg("x"), py::arg("expert_ids"),
           py::arg("weights"), py::arg("out"), py::arg("stream"), py::arg("training"))
      .def("backward_into", &CoreLayer::BackwardInto, py::arg("context_id"), py::arg("dout"),
           py::arg("dx"), py::arg("dweights"), py::arg("stream"), py::arg("aux_loss_grad"))
      .def("transport", &CoreLayer::TransportOfShard, py::arg("shard"))
      .def("release_idle_device_regions", &CoreLayer::ReleaseIdleDeviceRegions)
      .def("step", &CoreLayer::Step)
      .def("zero_grad", &CoreLayer::ZeroGrad, py::arg("shard"))
      .def("export_state", &CoreLayer::Export, py::arg("shard"), py::arg("include_optimizer"))
      .def("import_state", &CoreLayer::Import, py::arg("shard"), py::arg("state"))
      .def("save", &CoreLayer::Save, py::arg("shard"), py::arg("path"))
      .def("load", &CoreLayer::Load, py::arg("shard"), py::arg("path"));
}
