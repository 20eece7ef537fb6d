// NcclForwardInto and NcclBackwardInto (see nccl_channel.h): a micro-batch whose tensors and
// destinations all live on the trainer's GPU, moved over the connection's NCCL channel while a
// unary NcclForward / NcclBackward carries its control fields.
//
// Order of a call: post the sends of its inputs and the receives of its results on the channel
// (after the caller's stream's work; this takes its sequence number), then the RPC. On the
// response the caller's stream waits on both directions' completion (the host never waits on the
// GPU); results the response carries as bytes (server routing's routing, a dweights with no
// destination) are returned as host tensors. A failed call drops the channel: the server may or
// may not have matched its transfers, so the next call opens a new one.
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/nccl_channel.h"
#include "wire/wire.h"

namespace moe::client {
namespace {

template <typename Out>
std::future<absl::StatusOr<Out>> Ready(absl::StatusOr<Out> value) {
  std::promise<absl::StatusOr<Out>> p;
  p.set_value(std::move(value));
  return p.get_future();
}

NcclBuffer In(const TensorView& v) {
  return {const_cast<void*>(v.data), static_cast<int64_t>(v.size_bytes)};
}
NcclBuffer Out(const MutableTensorView& v) { return {v.data, static_cast<int64_t>(v.size_bytes)}; }

// A result the response carries as bytes; empty when it carries none.
absl::StatusOr<Tensor> Carried(const v1::Tensor& t, bool has, const char* field) {
  if (!has || (t.data().empty() && t.shape().empty())) return Tensor();
  wire::TensorAssembler a(field, wire::TensorAssembler::Sizing::kClaimedAtOnce);
  if (absl::Status st = a.Add(t); !st.ok()) return st;
  return a.Finish();
}

// The response's header for a result written over the channel must be the destination's.
absl::Status SameShape(const v1::Tensor& t, const MutableTensorView& d, const char* field) {
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  if (t.dtype() == wire::DTypeToProto(d.dtype) && shape == d.shape) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(field, ": the server wrote [", absl::StrJoin(shape, ", "),
                                          "], the destination is [", absl::StrJoin(d.shape, ", "),
                                          "]"));
}

// Posts the transfers, sends the request with `start` and finishes with `finish(response)`.
template <typename Req, typename Resp, typename Out, typename Start, typename Finish>
std::future<absl::StatusOr<Out>> Run(Connection& conn, const std::shared_ptr<NcclRoute>& route,
                                     std::shared_ptr<NcclChannel> channel,
                                     std::vector<NcclBuffer> sends,
                                     std::vector<NcclBuffer> receives, void* stream, Req req,
                                     Start start, Finish finish) {
  absl::StatusOr<NcclChannel::Ticket> ticket = channel->Post(sends, receives, stream);
  if (!ticket.ok()) {
    route->Drop(conn, channel);
    return Ready<Out>(ticket.status());
  }
  struct Call {
    grpc::ClientContext ctx;
    Req req;
    Resp resp;
    std::promise<absl::StatusOr<Out>> promise;
    std::unique_ptr<nccl::Posted> posted;
  };
  auto call = std::make_shared<Call>();
  call->req = std::move(req);
  call->req.mutable_nccl()->set_channel_id(channel->id());
  call->req.mutable_nccl()->set_seq(ticket->seq);
  call->posted = std::move(ticket->posted);
  conn.Prepare(&call->ctx);
  std::future<absl::StatusOr<Out>> future = call->promise.get_future();
  start(&call->ctx, &call->req, &call->resp,
        [call, &conn, route, channel, stream, finish](grpc::Status g) {
          absl::StatusOr<Out> result = absl::UnknownError("no result");
          if (!g.ok()) {
            result = FromGrpcStatus(g);
          } else {
            // First, so the caller's stream is ordered after the transfers whatever follows.
            absl::Status st = call->posted->StreamWait(stream);
            result = st.ok() ? finish(call->resp) : absl::StatusOr<Out>(st);
          }
          if (!result.ok()) route->Drop(conn, channel);
          call->promise.set_value(std::move(result));
        });
  return future;
}

}  // namespace

std::optional<std::future<absl::StatusOr<ForwardOutput>>> NcclForwardInto(
    Connection& conn, const std::shared_ptr<NcclRoute>& route, const std::string& layer,
    uint64_t context_id, bool training, const TensorView& x, const TensorView& ids,
    const TensorView& weights, const MutableTensorView& out, void* stream) {
  if (!route->active()) return std::nullopt;
  const TensorView* inputs[] = {&x, &ids, &weights};
  const MutableTensorView* required[] = {&out};
  const int device = NcclCallDevice(inputs, required, {});
  if (device < 0) return std::nullopt;
  std::shared_ptr<NcclChannel> channel = route->Channel(conn, device);
  if (channel == nullptr) return std::nullopt;
  v1::ForwardRequest req;
  req.set_layer(layer);
  req.set_context_id(context_id);
  req.set_training(training);
  req.set_last_chunk(true);
  std::vector<NcclBuffer> sends;
  v1::Tensor* fields[] = {req.mutable_x(), req.mutable_expert_ids(), req.mutable_weights()};
  for (int i = 0; i < 3; ++i) {
    if (inputs[i]->empty()) continue;
    wire::SetTensorHeader(inputs[i]->dtype, inputs[i]->shape, fields[i]);
    sends.push_back(In(*inputs[i]));
  }
  if (ids.empty()) req.clear_expert_ids();
  if (weights.empty()) req.clear_weights();
  const MutableTensorView dest = out;
  return Run<v1::ForwardRequest, v1::ForwardResponse, ForwardOutput>(
      conn, route, std::move(channel), std::move(sends), {Out(out)}, stream, std::move(req),
      [&conn](grpc::ClientContext* ctx, const v1::ForwardRequest* r, v1::ForwardResponse* resp,
              std::function<void(grpc::Status)> done) {
        conn.stub()->async()->NcclForward(ctx, r, resp, std::move(done));
      },
      [dest](const v1::ForwardResponse& r) -> absl::StatusOr<ForwardOutput> {
        if (absl::Status st = SameShape(r.out(), dest, "out"); !st.ok()) return st;
        ForwardOutput o;
        o.context_id = r.context_id();
        o.aux_loss = r.aux_loss();
        o.z_loss = r.z_loss();
        absl::StatusOr<Tensor> ids = Carried(r.expert_ids(), r.has_expert_ids(), "expert_ids");
        if (!ids.ok()) return ids.status();
        absl::StatusOr<Tensor> w = Carried(r.weights(), r.has_weights(), "weights");
        if (!w.ok()) return w.status();
        o.expert_ids = *std::move(ids);
        o.weights = *std::move(w);
        return o;
      });
}

std::optional<std::future<absl::StatusOr<BackwardOutput>>> NcclBackwardInto(
    Connection& conn, const std::shared_ptr<NcclRoute>& route, const std::string& layer,
    uint64_t context_id, const TensorView& dout, const MutableTensorView& dx,
    const MutableTensorView& dweights, void* stream, const BackwardOptions& options) {
  if (!route->active()) return std::nullopt;
  const TensorView* inputs[] = {&dout};
  const MutableTensorView* required[] = {&dx};
  const MutableTensorView* optional[] = {&dweights};
  const int device = NcclCallDevice(inputs, required, optional);
  // dweights by NCCL needs its [T, K] shape, which the caller's destination gives.
  if (device < 0 || (!dweights.empty() && dweights.shape.size() != 2)) return std::nullopt;
  std::shared_ptr<NcclChannel> channel = route->Channel(conn, device);
  if (channel == nullptr) return std::nullopt;
  v1::BackwardRequest req;
  req.set_layer(layer);
  req.set_context_id(context_id);
  req.set_last_chunk(true);
  if (options.aux_loss_grad != 1.0) req.set_aux_loss_grad(options.aux_loss_grad);
  wire::SetTensorHeader(dout.dtype, dout.shape, req.mutable_dout());
  std::vector<NcclBuffer> receives = {Out(dx)};
  if (!dweights.empty()) {
    req.mutable_nccl()->set_dweights_k(dweights.shape[1]);
    receives.push_back(Out(dweights));
  }
  const MutableTensorView dx_dest = dx, dw_dest = dweights;
  return Run<v1::BackwardRequest, v1::BackwardResponse, BackwardOutput>(
      conn, route, std::move(channel), {In(dout)}, std::move(receives), stream, std::move(req),
      [&conn](grpc::ClientContext* ctx, const v1::BackwardRequest* r, v1::BackwardResponse* resp,
              std::function<void(grpc::Status)> done) {
        conn.stub()->async()->NcclBackward(ctx, r, resp, std::move(done));
      },
      [dx_dest, dw_dest](const v1::BackwardResponse& r) -> absl::StatusOr<BackwardOutput> {
        if (absl::Status st = SameShape(r.dx(), dx_dest, "dx"); !st.ok()) return st;
        BackwardOutput o;
        if (!dw_dest.empty()) {
          if (absl::Status st = SameShape(r.dweights(), dw_dest, "dweights"); !st.ok()) return st;
          return o;
        }
        absl::StatusOr<Tensor> dw = Carried(r.dweights(), r.has_dweights(), "dweights");
        if (!dw.ok()) return dw.status();
        o.dweights = *std::move(dw);
        return o;
      });
}

}  // namespace moe::client
