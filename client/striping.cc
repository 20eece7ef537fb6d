// Connection::Forward and Connection::Backward over TCP: a micro-batch goes as one stream, or,
// from ClientOptions::stripe_bytes up, striped (moe.proto `Stripe`): cut by rows into up to
// `connections` streams, one per connection, which the server joins and runs once.
//
// Why: one TCP connection carries a large tensor at a few GB/s on loopback whatever the host
// (docs/SERVICE_PERFORMANCE.md); a large micro-batch's stripes move side by side. The streams
// share their outputs, each assembling its rows in place, so nothing is copied to join them.
#include <algorithm>
#include <deque>
#include <functional>
#include <future>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "client/client.h"
#include "client/requests.h"
#include "client/stream_call.h"
#include "common/status_macros.h"
#include "wire/wire.h"

namespace moe::client {
namespace {

// The streams of one striped micro-batch (moe.proto `Stripe`) on the client: each stream's
// result arrives in Done; the first error cancels the streams still running (the server fails
// them all anyway; this ends them without waiting for it), and the last stream to finish
// merges the results in row order, or reports the error, to the call's `done`.
template <typename Out>
class StripedCall {
 public:
  using Merge = std::function<absl::StatusOr<Out>(std::vector<Out>&)>;
  StripedCall(size_t streams, Merge merge, std::function<void(absl::StatusOr<Out>)> done)
      : contexts_(streams, nullptr),
        results_(streams),
        remaining_(streams),
        merge_(std::move(merge)),
        done_(std::move(done)) {}

  // Before stream i starts (a stream that starts after another failed is cancelled at once).
  void Track(size_t i, grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_[i] = ctx;
    if (!error_.ok()) ctx->TryCancel();
  }
  void Done(size_t i, absl::StatusOr<Out> result) {
    bool last;
    {
      // Under the lock: a stream's context lives until its Done returns, which needs the lock.
      std::lock_guard<std::mutex> lock(mu_);
      contexts_[i] = nullptr;
      if (result.ok()) {
        results_[i] = std::move(*result);
      } else {
        // Keep the first error that says why; the streams this cancels report CANCELLED.
        if (error_.ok() || (absl::IsCancelled(error_) && !absl::IsCancelled(result.status()))) {
          error_ = result.status();
        }
        for (grpc::ClientContext* c : contexts_) {
          if (c != nullptr) c->TryCancel();
        }
      }
      last = --remaining_ == 0;
    }
    if (!last) return;
    done_(error_.ok() ? merge_(results_) : absl::StatusOr<Out>(error_));
  }

 private:
  std::mutex mu_;
  std::vector<grpc::ClientContext*> contexts_;  // of the streams still running
  std::vector<Out> results_;
  size_t remaining_;
  absl::Status error_;
  Merge merge_;
  std::function<void(absl::StatusOr<Out>)> done_;
};

// A future and the callback that fulfils it.
template <typename Out>
std::pair<std::future<absl::StatusOr<Out>>, std::function<void(absl::StatusOr<Out>)>> Promise() {
  auto promise = std::make_shared<std::promise<absl::StatusOr<Out>>>();
  return {promise->get_future(),
          [promise](absl::StatusOr<Out> r) { promise->set_value(std::move(r)); }};
}

// Whether a call goes through region_calls.cc: the connection has registered regions, or a
// tensor is on a device.
bool NeedsRegions(const Connection& conn, std::initializer_list<const TensorView*> views) {
  if (conn.transport() == Transport::kSharedMemory) return true;
  for (const TensorView* v : views) {
    if (!v->empty() && v->location.is_cuda()) return true;
  }
  return false;
}

// How many streams carry a micro-batch of `rows` rows and `bytes` request bytes (1: unstriped).
int StripesFor(const ClientOptions& options, int64_t rows, int64_t bytes) {
  if (options.stripe_bytes <= 0 || options.connections < 2) return 1;
  const int64_t n = std::min<int64_t>(
      {options.connections, rows, bytes / options.stripe_bytes, int64_t{wire::kMaxStripes}});
  return static_cast<int>(std::max<int64_t>(n, 1));
}

// T of a [T, ...] request tensor (0 for one with no shape).
int64_t Rows(const Tensor& t) { return t.shape.empty() ? 0 : t.shape[0]; }

// Stream `index` of `count`: rows [begin, end) of a micro-batch of `total_rows`.
StreamRows StripeRows(int index, int count, int64_t begin, int64_t end, int64_t total_rows) {
  StreamRows rows;
  rows.begin = begin;
  rows.end = end;
  rows.stripe.set_index(static_cast<uint32_t>(index));
  rows.stripe.set_count(static_cast<uint32_t>(count));
  rows.stripe.set_row_begin(begin);
  rows.stripe.set_total_rows(total_rows);
  return rows;
}

// Starts the `stripes` streams of a striped micro-batch of `rows` rows, stream i with rows
// [begin, end) (the rows split as evenly as they go): start(its rows, its response tensors, its
// done callback, its track callback) starts one stream.
template <typename Out, typename Start>
void StartStripes(int stripes, int64_t rows, const std::shared_ptr<StripedCall<Out>>& striped,
                  const std::shared_ptr<std::deque<wire::StripedAssembler>>& outputs, Start start) {
  int64_t begin = 0;
  for (int i = 0; i < stripes; ++i) {
    const int64_t end = begin + rows / stripes + (i < rows % stripes);
    start(StripeRows(i, stripes, begin, end, rows), ResponseTensors::Stripe(outputs, i, begin),
          std::function<void(absl::StatusOr<Out>)>(
              [striped, i](absl::StatusOr<Out> r) { striped->Done(i, std::move(r)); }),
          TrackContext([striped, i](grpc::ClientContext* ctx) { striped->Track(i, ctx); }));
    begin = end;
  }
}

// Finishes a striped micro-batch's shared output `i` into `*out`, as ResponseTensors::FinishInto
// does a whole one's.
absl::Status FinishStriped(std::deque<wire::StripedAssembler>& outputs, size_t i, uint32_t streams,
                           bool required, Tensor* out) {
  if (!required && !outputs[i].seen()) return absl::OkStatus();
  MOE_ASSIGN_OR_RETURN(*out, outputs[i].Finish(streams));
  return absl::OkStatus();
}

}  // namespace

// Over TCP the caller's tensors are copied once, into the call's own buffers, so the caller may
// reuse them as soon as this returns; the messages refer to those copies (or, for the overloads
// that take tensors, to the caller's own). A micro-batch above `stripe_bytes` goes as several
// streams (StripedCall), each sending its rows of those same buffers. With registered regions
// or device tensors the call goes through ForwardInto (region_calls.cc), which copies host
// tensors into its slot before it returns.
std::future<absl::StatusOr<ForwardOutput>> Connection::Forward(const std::string& layer,
                                                               uint64_t context_id, bool training,
                                                               const TensorView& x,
                                                               const TensorView& ids,
                                                               const TensorView& weights) {
  if (NeedsRegions(*this, {&x, &ids, &weights})) {
    return ForwardInto(layer, context_id, training, x, ids, weights, MutableTensorView(), nullptr);
  }
  return Forward(layer, context_id, training, ToTensor(x), ToTensor(ids), ToTensor(weights));
}

std::future<absl::StatusOr<ForwardOutput>> Connection::Forward(const std::string& layer,
                                                               uint64_t context_id, bool training,
                                                               Tensor&& x, Tensor&& ids,
                                                               Tensor&& weights) {
  if (transport() == Transport::kSharedMemory) {
    return ForwardInto(layer, context_id, training, x.view(), ids.view(), weights.view(),
                       MutableTensorView(), nullptr);
  }
  auto [future, done] = Promise<ForwardOutput>();
  StartTcpForward(ForwardCall{layer, context_id, training, nullptr}, std::move(x), std::move(ids),
                  std::move(weights), std::move(done));
  return std::move(future);
}

void Connection::StartTcpForward(const ForwardCall& whole, Tensor&& x, Tensor&& ids,
                                 Tensor&& weights,
                                 std::function<void(absl::StatusOr<ForwardOutput>)> done) {
  const int64_t rows = Rows(x);
  const int stripes =
      StripesFor(options_, rows,
                 static_cast<int64_t>(x.bytes.size() + ids.bytes.size() + weights.bytes.size()));
  auto tensors = std::make_shared<std::vector<Tensor>>();
  tensors->push_back(std::move(x));
  tensors->push_back(std::move(ids));
  tensors->push_back(std::move(weights));
  if (stripes == 1) {
    StartForwardStream(*this, NextLink(), whole, tensors, StreamRows(),
                       ResponseTensors::Whole(kForwardResponseTensors), std::move(done));
    return;
  }
  // The server joins the streams by context id: an inference micro-batch gets one for that.
  const uint64_t context_id = whole.context_id;
  ForwardCall call = whole;
  if (call.context_id == 0) call.context_id = NextContextId();
  auto outputs = ResponseTensors::Shared(kForwardResponseTensors, rows);
  auto striped = std::make_shared<StripedCall<ForwardOutput>>(
      stripes,
      [outputs, stripes,
       context_id](std::vector<ForwardOutput>& parts) -> absl::StatusOr<ForwardOutput> {
        ForwardOutput o;
        o.context_id = context_id;
        o.aux_loss = parts[0].aux_loss;
        o.z_loss = parts[0].z_loss;
        const uint32_t n = static_cast<uint32_t>(stripes);
        MOE_RETURN_IF_ERROR(FinishStriped(*outputs, 0, n, /*required=*/true, &o.out));
        MOE_RETURN_IF_ERROR(FinishStriped(*outputs, 1, n, false, &o.expert_ids));
        MOE_RETURN_IF_ERROR(FinishStriped(*outputs, 2, n, false, &o.weights));
        return o;
      },
      std::move(done));
  StartStripes(stripes, rows, striped, outputs,
               [&](const StreamRows& stripe, std::shared_ptr<ResponseTensors> mine, auto done,
                   TrackContext track) {
                 StartForwardStream(*this, NextLink(), call, tensors, stripe, std::move(mine),
                                    std::move(done), std::move(track));
               });
}

// As Forward: `dout` is copied once into the call's own buffer (or taken over), striped above
// `stripe_bytes`; or goes through BackwardInto.
std::future<absl::StatusOr<BackwardOutput>> Connection::Backward(const std::string& layer,
                                                                 uint64_t context_id,
                                                                 const TensorView& dout,
                                                                 const BackwardOptions& options) {
  if (NeedsRegions(*this, {&dout})) {
    return BackwardInto(layer, context_id, dout, MutableTensorView(), MutableTensorView(), nullptr,
                        options);
  }
  return Backward(layer, context_id, ToTensor(dout), options);
}

std::future<absl::StatusOr<BackwardOutput>> Connection::Backward(const std::string& layer,
                                                                 uint64_t context_id, Tensor&& dout,
                                                                 const BackwardOptions& options) {
  if (transport() == Transport::kSharedMemory) {
    return BackwardInto(layer, context_id, dout.view(), MutableTensorView(), MutableTensorView(),
                        nullptr, options);
  }
  auto [future, done] = Promise<BackwardOutput>();
  StartTcpBackward(BackwardCall{layer, context_id, nullptr, options.aux_loss_grad}, std::move(dout),
                   std::move(done));
  return std::move(future);
}

void Connection::StartTcpBackward(const BackwardCall& call, Tensor&& dout,
                                  std::function<void(absl::StatusOr<BackwardOutput>)> done) {
  const int64_t rows = Rows(dout);
  const int stripes = StripesFor(options_, rows, static_cast<int64_t>(dout.bytes.size()));
  auto tensors = std::make_shared<std::vector<Tensor>>();
  tensors->push_back(std::move(dout));
  if (stripes == 1) {
    StartBackwardStream(*this, NextLink(), call, tensors, StreamRows(),
                        ResponseTensors::Whole(kBackwardResponseTensors), std::move(done));
    return;
  }
  auto outputs = ResponseTensors::Shared(kBackwardResponseTensors, rows);
  auto striped = std::make_shared<StripedCall<BackwardOutput>>(
      stripes,
      [outputs, stripes](std::vector<BackwardOutput>&) -> absl::StatusOr<BackwardOutput> {
        BackwardOutput o;
        const uint32_t n = static_cast<uint32_t>(stripes);
        MOE_RETURN_IF_ERROR(FinishStriped(*outputs, 0, n, /*required=*/true, &o.dx));
        MOE_RETURN_IF_ERROR(FinishStriped(*outputs, 1, n, false, &o.dweights));
        return o;
      },
      std::move(done));
  StartStripes(stripes, rows, striped, outputs,
               [&](const StreamRows& stripe, std::shared_ptr<ResponseTensors> mine, auto done,
                   TrackContext track) {
                 StartBackwardStream(*this, NextLink(), call, tensors, stripe, std::move(mine),
                                     std::move(done), std::move(track));
               });
}

}  // namespace moe::client
