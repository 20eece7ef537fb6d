// Connection::ForwardInto and BackwardInto: a micro-batch whose tensors may live on a CUDA
// device, whose results may go into the caller's memory, and which moves its tensors by
// registered regions where the connection has them (data_plane.h); Forward and Backward come
// here too whenever a call is not plain host tensors over TCP.
//
// Each of a call's tensors (a Part) travels one way: inline (bytes in the messages, or a result
// in the response: TCP), in the call's shared memory slot (host tensors; device tensors staged
// through host memory), or by CUDA IPC in the caller's own device memory. A call with any
// reference is one message on one stream (docs/PROTOCOL.md); one without goes the TCP way,
// striped as usual. Results the server wrote into the slot are copied out (into the returned
// tensors or the caller's destinations) on the response, before the result is handed on.
//
// Stream ordering with CUDA IPC: the call records its event pair's wait event on the caller's
// stream before sending (the server's stream waits on it before reading), and on the response
// makes the caller's stream wait on the server's done event; the host never waits on the GPU.
// Staged device tensors are copied on the caller's stream and waited for (a fallback).
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/data_plane.h"
#include "client/device.h"
#include "client/nccl_channel.h"
#include "client/requests.h"
#include "client/stream_call.h"
#include "common/host_memory.h"
#include "common/status_macros.h"

namespace moe::client {
namespace {

// CUDA regions' references are multiples of this (docs/PROTOCOL.md, "References"); slot
// placements use a cache line.
constexpr int64_t kCudaReferenceAlignment = 16;
constexpr int64_t kSlotAlignment = 64;

// How one of a call's tensors travels.
enum class Way {
  kAbsent,  // an input not given (server routing sends no ids or weights)
  kInline,  // bytes in the messages, or a result in the response
  kSlot,    // host bytes in the call's shared memory slot
  kRegion,  // the caller's device memory, by CUDA IPC
};

// One request tensor or destination of a call.
struct Part {
  std::string field;
  Way way = Way::kAbsent;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  size_t bytes = 0;
  MemoryLocation location;
  const void* src = nullptr;  // an input's bytes
  void* dst = nullptr;        // a destination's; null: the result is returned as a Tensor
  bool known_shape = true;    // false: a returned result whose shape the client cannot know
  int64_t slot_offset = 0;    // kSlot
  device::ExportedTensor exported;  // a device tensor's allocation (kRegion)
  DataPlane::DeviceRef region;      // kRegion, once held
};

Part Input(const TensorView& v, const char* field) {
  Part p;
  p.field = field;
  if (v.empty()) return p;
  p.way = Way::kInline;
  p.dtype = v.dtype;
  p.shape = v.shape;
  p.bytes = v.size_bytes;
  p.location = v.location;
  p.src = v.data;
  return p;
}

// A destination: the caller's `d`, or (d empty) a result of `dtype` and `shape` to return.
Part Destination(const MutableTensorView& d, const char* field, DType dtype,
                 std::vector<int64_t> shape, bool known_shape) {
  Part p;
  p.field = field;
  p.way = Way::kInline;
  if (!d.empty()) {
    p.dtype = d.dtype;
    p.shape = d.shape;
    p.bytes = d.size_bytes;
    p.location = d.location;
    p.dst = d.data;
    return p;
  }
  p.dtype = dtype;
  p.shape = std::move(shape);
  p.known_shape = known_shape;
  if (known_shape) p.bytes = static_cast<size_t>(NumElements(p.shape)) * DTypeSize(dtype);
  return p;
}

std::string ShapeText(DType dtype, const std::vector<int64_t>& shape) {
  return absl::StrCat(DTypeName(dtype), " [", absl::StrJoin(shape, ", "), "]");
}

// One call on its way: what it holds from the DataPlane until its response, and where its
// results go. Shared by the caller's thread (until the request is sent) and the response
// callback.
template <typename Out>
struct RegionCall {
  std::shared_ptr<DataPlane> plane;
  std::vector<Part> inputs;
  std::vector<Part> dests;             // in the order of the response's tensors
  std::vector<Tensor Out::*> results;  // dests[i]'s tensor in Out
  void* stream = nullptr;
  int device = -1;  // of the call's device tensors
  std::unique_ptr<DataPlane::Slot> slot;
  std::unique_ptr<DataPlane::EventPair> events;
  std::vector<uint64_t> held_regions;
  std::shared_ptr<ResponseTensors> responses;  // the stream's, when the call has references
  std::function<void(absl::StatusOr<Out>)> done;

  // Gives back what the call holds; a failed call's slot and event pair are not reused.
  void Release(bool ok) {
    plane->ReleaseSlot(std::move(slot), ok);
    plane->ReleaseEvents(std::move(events), ok);
    for (uint64_t id : held_regions) plane->ReleaseDeviceRegion(id);
    held_regions.clear();
  }
};

// Checks every part's device and decides how it travels: device tensors by CUDA IPC where the
// connection has it (kAuto decides at the first), else through host memory; host tensors in the
// slot with shared memory, else inline.
template <typename Out>
absl::Status Plan(Connection& conn, RegionCall<Out>& c) {
  std::vector<Part*> device_parts;
  for (std::vector<Part>* parts : {&c.inputs, &c.dests}) {
    for (Part& p : *parts) {
      if (p.way == Way::kAbsent || !p.location.is_cuda()) continue;
      if (!device::Built()) {
        return absl::InvalidArgumentError(absl::StrCat(
            p.field, ": a tensor on ", p.location.DebugString(),
            ", but this client was built without CUDA; pass host tensors"));
      }
      if (c.device >= 0 && p.location.device != c.device) {
        return absl::InvalidArgumentError(absl::StrCat(
            p.field, ": on ", p.location.DebugString(), ", but the call's other device tensors "
            "are on cuda:", c.device, " (one call's device tensors share one device)"));
      }
      c.device = p.location.device;
      device_parts.push_back(&p);
    }
  }
  DeviceTransport dt = c.plane->device_transport();
  if (!device_parts.empty() && dt != DeviceTransport::kStaged) {
    for (Part* p : device_parts) {
      MOE_ASSIGN_OR_RETURN(p->exported,
                           device::ExportTensor(p->src ? p->src : p->dst,
                                                static_cast<int64_t>(p->bytes), p->field));
      if (p->exported.device != c.device) {
        return absl::InvalidArgumentError(absl::StrCat(
            p->field, ": said to be on cuda:", c.device, ", but its memory is on cuda:",
            p->exported.device));
      }
      if (p->exported.offset % kCudaReferenceAlignment != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            p->field, ": starts ", p->exported.offset, " bytes into its CUDA allocation; CUDA "
            "IPC references need a multiple of ", kCudaReferenceAlignment));
      }
    }
    // What the call holds in regions and events (the first call of kAuto's tries it).
    auto hold = [&]() -> absl::Status {
      for (Part* p : device_parts) {
        absl::StatusOr<DataPlane::DeviceRef> ref =
            c.plane->AcquireDeviceRegion(conn, p->exported);
        if (!ref.ok()) return ref.status();
        p->region = *ref;
        c.held_regions.push_back(ref->region_id);
      }
      absl::StatusOr<std::unique_ptr<DataPlane::EventPair>> events =
          c.plane->AcquireEvents(conn, c.device);
      if (!events.ok()) return events.status();
      c.events = std::move(*events);
      return absl::OkStatus();
    };
    if (dt == DeviceTransport::kUndecided) {
      absl::Status held;
      dt = c.plane->DecideDevice([&] { return held = hold(); });
      if (!held.ok() || dt != DeviceTransport::kCudaIpc) {
        c.Release(/*ok=*/true);
        // Refused here although another call found CUDA IPC working meanwhile: this one fails.
        if (dt == DeviceTransport::kCudaIpc) return held;
      }
    } else {
      MOE_RETURN_IF_ERROR(hold());
    }
  }
  const bool shm = c.plane->transport() == Transport::kSharedMemory;
  for (std::vector<Part>* parts : {&c.inputs, &c.dests}) {
    for (Part& p : *parts) {
      if (p.way == Way::kAbsent) continue;
      if (p.location.is_cuda() && dt == DeviceTransport::kCudaIpc) {
        p.way = Way::kRegion;
      } else {
        p.way = shm && p.known_shape ? Way::kSlot : Way::kInline;
      }
    }
  }
  return absl::OkStatus();
}

// Places the slot parts in one slot and copies the inputs there; makes the inline inputs'
// tensors (`tensors`, in input order; empty for the others).
template <typename Out>
absl::Status StageInputs(Connection& conn, RegionCall<Out>& c, std::vector<Tensor>* tensors) {
  int64_t total = 0;
  for (std::vector<Part>* parts : {&c.inputs, &c.dests}) {
    for (Part& p : *parts) {
      if (p.way != Way::kSlot) continue;
      p.slot_offset = total;
      total += (static_cast<int64_t>(p.bytes) + kSlotAlignment - 1) / kSlotAlignment *
               kSlotAlignment;
    }
  }
  if (total > 0) {
    MOE_ASSIGN_OR_RETURN(c.slot, c.plane->AcquireSlot(conn, total));
  }
  for (const Part& p : c.inputs) {
    Tensor t;
    void* to = nullptr;
    if (p.way == Way::kSlot) {
      to = c.slot->data() + p.slot_offset;
    } else if (p.way == Way::kInline) {
      t = Tensor::Uninitialized(p.dtype, p.shape);
      to = t.bytes.data();
    }
    if (to != nullptr && p.bytes > 0) {
      if (p.location.is_cuda()) {
        MOE_RETURN_IF_ERROR(
            device::CopyToHost(to, p.src, p.bytes, p.location.device, c.stream, p.field));
      } else {
        ParallelMemcpy(to, p.src, p.bytes);
      }
    }
    tensors->push_back(std::move(t));
  }
  return absl::OkStatus();
}

// What the request names by reference.
template <typename Out>
std::shared_ptr<References> MakeReferences(const RegionCall<Out>& c) {
  auto refs = std::make_shared<References>();
  bool any = false;
  auto ref_of = [&](const Part& p) {
    v1::TensorRef r;
    if (p.way == Way::kSlot) {
      r.set_region_id(c.slot->region_id);
      r.set_offset(p.slot_offset);
    } else {
      r.set_region_id(p.region.region_id);
      r.set_offset(p.region.offset);
    }
    return r;
  };
  for (const Part& p : c.inputs) {
    refs->inputs.emplace_back();
    if (p.way == Way::kSlot || p.way == Way::kRegion) {
      refs->inputs.back() = TensorByRef{p.dtype, p.shape, ref_of(p)};
      any = true;
    }
  }
  for (const Part& p : c.dests) {
    refs->destinations.emplace_back();
    if (p.way == Way::kSlot || p.way == Way::kRegion) {
      refs->destinations.back() = ref_of(p);
      any = true;
    }
  }
  if (!any) return nullptr;
  refs->event_id = c.events ? c.events->event_id : 0;
  return refs;
}

// Puts the results where the call asked, from the response (`out`), the slot, or (by CUDA IPC)
// nowhere: the server wrote them in place; then orders the caller's stream after the server's
// writes.
template <typename Out>
absl::Status Deliver(RegionCall<Out>& c, Out& out) {
  // First, so that the caller's stream is ordered after the server's writes whatever follows.
  if (c.events) {
    MOE_RETURN_IF_ERROR(c.events->done->StreamWait(c.stream, c.device));
  }
  for (size_t i = 0; i < c.dests.size(); ++i) {
    const Part& p = c.dests[i];
    Tensor& t = out.*(c.results[i]);
    if (p.way == Way::kSlot || p.way == Way::kRegion) {
      const ResponseTensors::Written& w = c.responses->written[i];
      if (w.dtype != p.dtype || w.shape != p.shape) {
        // A caller's destination of the wrong shape (the layer's K, say), or a server at odds
        // with this client.
        return absl::Status(
            p.dst != nullptr ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kInternal,
            absl::StrCat(p.field, ": the server wrote ", ShapeText(w.dtype, w.shape),
                         p.dst != nullptr ? ", the destination is " : ", the call expected ",
                         ShapeText(p.dtype, p.shape)));
      }
    } else if (p.dst != nullptr &&
               (t.dtype != p.dtype || t.shape != p.shape || t.bytes.size() != p.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.field, ": the server answered ", ShapeText(t.dtype, t.shape), ", the destination is ",
          ShapeText(p.dtype, p.shape)));
    }
    const void* from = nullptr;
    if (p.way == Way::kSlot) {
      from = c.slot->data() + p.slot_offset;
    } else if (p.way == Way::kInline && p.dst != nullptr) {
      from = t.bytes.data();
    }
    if (from == nullptr) continue;
    if (p.dst == nullptr) {  // a result to return, out of the slot
      t = Tensor::Uninitialized(p.dtype, p.shape);
      ParallelMemcpy(t.bytes.data(), from, p.bytes);
      continue;
    }
    if (p.bytes > 0) {
      if (p.location.is_cuda()) {
        MOE_RETURN_IF_ERROR(
            device::CopyToDevice(p.dst, from, p.bytes, p.location.device, c.stream, p.field));
      } else {
        ParallelMemcpy(p.dst, from, p.bytes);
      }
    }
    t = Tensor();  // written to the destination: the result carries none
  }
  return absl::OkStatus();
}

template <typename Out>
void Finish(const std::shared_ptr<RegionCall<Out>>& c, absl::StatusOr<Out> result) {
  if (result.ok()) {
    if (absl::Status st = Deliver(*c, *result); !st.ok()) result = st;
  }
  c->Release(result.ok());
  c->done(std::move(result));
}

// Plans and stages the call, then starts it: `start_refs(refs, tensors, responses, done)` sends
// a micro-batch with references as one stream; `start_tcp(tensors, done)` sends one without.
template <typename Out, typename StartRefs, typename StartTcp>
std::future<absl::StatusOr<Out>> Run(Connection& conn, std::shared_ptr<RegionCall<Out>> c,
                                     const std::vector<const char*>& response_names,
                                     StartRefs start_refs, StartTcp start_tcp) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<Out>>>();
  std::future<absl::StatusOr<Out>> future = promise->get_future();
  c->done = [promise](absl::StatusOr<Out> r) { promise->set_value(std::move(r)); };
  std::vector<Tensor> tensors;
  absl::Status st = Plan(conn, *c);
  if (st.ok()) st = StageInputs(conn, *c, &tensors);
  std::shared_ptr<References> refs;
  if (st.ok()) {
    refs = MakeReferences(*c);
    if (c->events) st = c->events->wait->Record(c->stream, c->device);
  }
  if (!st.ok()) {
    c->Release(/*ok=*/true);  // nothing was sent: the server never used what the call held
    promise->set_value(st);
    return future;
  }
  auto done = [c](absl::StatusOr<Out> r) { Finish(c, std::move(r)); };
  if (refs == nullptr) {
    start_tcp(std::move(tensors), std::move(done));
    return future;
  }
  c->responses = ResponseTensors::Whole(response_names, refs->destinations);
  start_refs(std::move(refs), std::move(tensors), c->responses, std::move(done));
  return future;
}

}  // namespace

std::future<absl::StatusOr<ForwardOutput>> Connection::ForwardInto(
    const std::string& layer, uint64_t context_id, bool training, const TensorView& x,
    const TensorView& ids, const TensorView& weights, const MutableTensorView& out,
    void* stream) {
  auto c = std::make_shared<RegionCall<ForwardOutput>>();
  c->plane = plane_;
  c->stream = stream;
  c->inputs = {Input(x, "x"), Input(ids, "expert_ids"), Input(weights, "weights")};
  absl::Status st = x.empty() ? absl::InvalidArgumentError("x: missing") : absl::OkStatus();
  for (auto [v, field] : {std::pair{&x, "x"}, std::pair{&ids, "expert_ids"},
                          std::pair{&weights, "weights"}}) {
    if (st.ok() && !v->empty()) st = CheckTensor(*v, field, v->dtype, v->shape);
  }
  if (st.ok() && !out.empty()) st = CheckTensor(out, "out", x.dtype, x.shape);
  if (!st.ok()) {
    std::promise<absl::StatusOr<ForwardOutput>> p;
    p.set_value(st);
    return p.get_future();
  }
  if (auto nccl = NcclForwardInto(*this, plane_->nccl_route(*this), layer, context_id, training,
                                  x, ids, weights, out, stream)) {
    return std::move(*nccl);
  }
  c->dests = {Destination(out, "out", x.dtype, x.shape, /*known_shape=*/true)};
  c->results = {&ForwardOutput::out};
  const ForwardCall call{layer, context_id, training, nullptr};
  return Run(
      *this, c, {std::begin(kForwardResponseTensors), std::end(kForwardResponseTensors)},
      [this, call](std::shared_ptr<References> refs, std::vector<Tensor> tensors,
                   std::shared_ptr<ResponseTensors> responses, auto done) {
        ForwardCall with_refs = call;
        with_refs.refs = std::move(refs);
        StartForwardStream(*this, NextLink(), with_refs,
                           std::make_shared<const std::vector<Tensor>>(std::move(tensors)),
                           StreamRows(), std::move(responses), std::move(done));
      },
      [this, call](std::vector<Tensor> tensors, auto done) {
        StartTcpForward(call, std::move(tensors[0]), std::move(tensors[1]), std::move(tensors[2]),
                        std::move(done));
      });
}

std::future<absl::StatusOr<BackwardOutput>> Connection::BackwardInto(
    const std::string& layer, uint64_t context_id, const TensorView& dout,
    const MutableTensorView& dx, const MutableTensorView& dweights, void* stream,
    const BackwardOptions& options) {
  auto c = std::make_shared<RegionCall<BackwardOutput>>();
  c->plane = plane_;
  c->stream = stream;
  c->inputs = {Input(dout, "dout")};
  absl::Status st = dout.empty() ? absl::InvalidArgumentError("dout: missing")
                                 : CheckTensor(dout, "dout", dout.dtype, dout.shape);
  if (st.ok() && !dx.empty()) st = CheckTensor(dx, "dx", dout.dtype, dout.shape);
  if (st.ok() && !dweights.empty()) {
    st = CheckTensor(dweights, "dweights", DType::kFloat32,
                     {dout.shape.empty() ? -1 : dout.shape[0], -1});
  }
  if (!st.ok()) {
    std::promise<absl::StatusOr<BackwardOutput>> p;
    p.set_value(st);
    return p.get_future();
  }
  if (auto nccl = NcclBackwardInto(*this, plane_->nccl_route(*this), layer, context_id, dout, dx,
                                   dweights, stream, options)) {
    return std::move(*nccl);
  }
  // dweights is [T, K]: K is the layer's, which a Backward does not name, so a dweights the
  // caller gave no destination for comes back in the response.
  c->dests = {Destination(dx, "dx", dout.dtype, dout.shape, /*known_shape=*/true),
              Destination(dweights, "dweights", DType::kFloat32, {}, /*known_shape=*/false)};
  c->results = {&BackwardOutput::dx, &BackwardOutput::dweights};
  const BackwardCall call{layer, context_id, nullptr, options.aux_loss_grad};
  return Run(
      *this, c, {std::begin(kBackwardResponseTensors), std::end(kBackwardResponseTensors)},
      [this, call](std::shared_ptr<References> refs, std::vector<Tensor> tensors,
                   std::shared_ptr<ResponseTensors> responses, auto done) {
        BackwardCall with_refs = call;
        with_refs.refs = std::move(refs);
        StartBackwardStream(*this, NextLink(), with_refs,
                            std::make_shared<const std::vector<Tensor>>(std::move(tensors)),
                            StreamRows(), std::move(responses), std::move(done));
      },
      [this, call](std::vector<Tensor> tensors, auto done) {
        StartTcpBackward(call, std::move(tensors[0]), std::move(done));
      });
}

}  // namespace moe::client
