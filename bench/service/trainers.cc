// moe-service-bench's trainers (see trainers.h): the inputs, the host and device sides of both
// the service and the in-process baseline, and the steps they run.
#include "bench/service/trainers.h"

#include <chrono>
#include <utility>

#include "common/status_macros.h"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int64_t Bytes(const Tensor& t) { return static_cast<int64_t>(t.bytes.size()); }

Tensor RandomActivations(DType dtype, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  Tensor t = Tensor::Zeros(dtype, {rows, cols});
  std::normal_distribution<float> n(0.f, 1.f);
  const int64_t count = rows * cols;
  if (dtype == DType::kBFloat16) {
    uint16_t* p = t.as<uint16_t>();
    for (int64_t i = 0; i < count; ++i) p[i] = FloatToBFloat16(n(rng));
  } else {
    float* p = t.as<float>();
    for (int64_t i = 0; i < count; ++i) p[i] = n(rng);
  }
  return t;
}

// Device blocks place each tensor at a multiple of this (CUDA IPC references need 16).
constexpr int64_t kDeviceAlignment = 256;

// A step that failed returns `failure` only once every call it started is complete and the
// trainer's stream is idle: the caller frees the trainer's tensors and its stream next, which a
// call still in flight reads and writes (by CUDA IPC) and orders its results on when it ends.
template <typename T>
absl::Status AfterTheRest(std::vector<std::future<T>>& calls, const ServiceTrainer& t,
                          absl::Status failure) {
  for (std::future<T>& f : calls) {
    if (f.valid()) f.wait();
  }
  t.finish().IgnoreError();
  return failure;
}

}  // namespace

MicroBatch MakeMicroBatch(const LayerConfig& cfg, int64_t tokens, std::mt19937_64& rng) {
  MicroBatch mb;
  mb.x = RandomActivations(cfg.dtype, tokens, cfg.d_model, rng);
  mb.dout = RandomActivations(cfg.dtype, tokens, cfg.d_model, rng);
  if (cfg.routing == RoutingMode::kClient) {
    const int64_t k = cfg.top_k, e = cfg.num_experts;
    mb.ids = Tensor::Zeros(DType::kInt32, {tokens, k});
    mb.weights = Tensor::Zeros(DType::kFloat32, {tokens, k});
    std::vector<int32_t> perm(e);
    std::uniform_real_distribution<float> u(0.1f, 1.f);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < e; ++i) perm[i] = static_cast<int32_t>(i);
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) {  // k distinct experts: a partial Fisher-Yates shuffle
        std::uniform_int_distribution<int64_t> pick(j, e - 1);
        std::swap(perm[j], perm[pick(rng)]);
        mb.ids.as<int32_t>()[t * k + j] = perm[j];
        sum += (mb.weights.as<float>()[t * k + j] = u(rng));
      }
      for (int64_t j = 0; j < k; ++j) mb.weights.as<float>()[t * k + j] /= sum;
    }
  }
  return mb;
}

// --- device tensors -------------------------------------------------------------------------
absl::StatusOr<std::unique_ptr<DeviceTensors>> DeviceTensors::Upload(
    int device, const std::vector<MicroBatch>& mbs) {
  std::unique_ptr<DeviceTensors> d(new DeviceTensors());
  d->device_ = device;
  MOE_ASSIGN_OR_RETURN(d->stream_, DeviceStream::Create(device));
  for (const MicroBatch& mb : mbs) {
    Block b;
    int64_t end = 0;
    auto place = [&](DType dtype, std::vector<int64_t> shape, int64_t bytes) {
      Placed p{dtype, std::move(shape), end, bytes};
      end += (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
      return p;
    };
    const Tensor* inputs[4] = {&mb.x, &mb.ids, &mb.weights, &mb.dout};
    for (int k = 0; k < 4; ++k) {
      b.in[k] = place(inputs[k]->dtype, inputs[k]->shape, Bytes(*inputs[k]));
    }
    b.dest[0] = place(mb.x.dtype, mb.x.shape, Bytes(mb.x));           // out
    b.dest[1] = place(mb.dout.dtype, mb.dout.shape, Bytes(mb.dout));  // dx
    b.dest[2] = place(DType::kFloat32, mb.weights.shape, Bytes(mb.weights));  // dweights
    MOE_ASSIGN_OR_RETURN(b.memory, DeviceBuffer::Allocate(device, std::max<int64_t>(end, 1)));
    for (int k = 0; k < 4; ++k) {
      if (b.in[k].bytes == 0) continue;
      MOE_RETURN_IF_ERROR(CopyToDevice(b.memory->data() + b.in[k].offset,
                                       inputs[k]->bytes.data(),
                                       static_cast<size_t>(b.in[k].bytes), device));
    }
    d->blocks_.push_back(std::move(b));
  }
  return d;
}

TensorView DeviceTensors::In(size_t i, int k) const {
  const Placed& p = blocks_[i].in[k];
  if (p.bytes == 0) return {};
  return {p.dtype, p.shape, blocks_[i].memory->data() + p.offset, static_cast<size_t>(p.bytes),
          MemoryLocation::Cuda(device_)};
}

MutableTensorView DeviceTensors::Dest(size_t i, int k) const {
  const Placed& p = blocks_[i].dest[k];
  if (p.bytes == 0) return {};
  return {p.dtype, p.shape, blocks_[i].memory->data() + p.offset, static_cast<size_t>(p.bytes),
          MemoryLocation::Cuda(device_)};
}

absl::StatusOr<Tensor> DeviceTensors::DownloadOut(size_t i) const {
  const MutableTensorView d = out(i);
  Tensor t = Tensor::Uninitialized(d.dtype, d.shape);
  MOE_RETURN_IF_ERROR(CopyFromDevice(t.bytes.data(), d.data, d.size_bytes, device_));
  return t;
}

// --- the trainers ---------------------------------------------------------------------------
ServiceTrainer HostService(client::RemoteLayer& layer, const std::vector<MicroBatch>& mbs,
                           std::vector<MicroBatch>* owned) {
  ServiceTrainer t;
  t.forward = [&layer, &mbs, owned](size_t i, bool training) {
    if (owned == nullptr) {
      return layer.Forward(mbs[i].x.view(), mbs[i].ids.view(), mbs[i].weights.view(), training);
    }
    MicroBatch& o = (*owned)[i];
    return layer.Forward(std::move(o.x), std::move(o.ids), std::move(o.weights), training);
  };
  t.backward = [&layer, &mbs, owned](size_t i, uint64_t ctx) {
    return owned ? layer.Backward(ctx, std::move((*owned)[i].dout))
                 : layer.Backward(ctx, mbs[i].dout.view());
  };
  return t;
}

InprocTrainer HostInproc(const std::vector<MicroBatch>& mbs) {
  InprocTrainer t;
  t.forward = [&mbs](size_t i, bool training) {
    ForwardRequest req;
    req.x = mbs[i].x.view();
    if (!mbs[i].ids.empty()) {
      req.expert_ids = mbs[i].ids.view();
      req.weights = mbs[i].weights.view();
    }
    req.training = training;
    return req;
  };
  t.backward = [&mbs](size_t i) {
    BackwardRequest req;
    req.dout = mbs[i].dout.view();
    return req;
  };
  return t;
}

template <typename RemoteLayerT>
ServiceTrainer DeviceService(RemoteLayerT& layer, const DeviceTensors& dev) {
  ServiceTrainer t;
  t.forward = [&layer, &dev](size_t i, bool training) {
    return layer.ForwardInto(dev.x(i), dev.ids(i), dev.weights(i), dev.out(i), dev.stream(),
                             training);
  };
  t.backward = [&layer, &dev](size_t i, uint64_t ctx) {
    return layer.BackwardInto(ctx, dev.dout(i), dev.dx(i), dev.dweights(i), dev.stream());
  };
  t.finish = [&dev] { return dev.Synchronize(); };
  t.step = [&layer] { return layer.Step().status(); };
  return t;
}
template ServiceTrainer DeviceService(client::RemoteLayer&, const DeviceTensors&);
template ServiceTrainer DeviceService(client::ShardedLayer&, const DeviceTensors&);

InprocTrainer DeviceInproc(const DeviceTensors& dev) {
  InprocTrainer t;
  t.forward = [&dev](size_t i, bool training) {
    ForwardRequest req;
    req.x = dev.x(i);
    req.expert_ids = dev.ids(i);
    req.weights = dev.weights(i);
    req.out = dev.out(i);
    req.training = training;
    return req;
  };
  t.backward = [&dev](size_t i) {
    BackwardRequest req;
    req.dout = dev.dout(i);
    req.dx = dev.dx(i);
    req.dweights = dev.dweights(i);
    return req;
  };
  return t;
}

// --- the steps ------------------------------------------------------------------------------
absl::Status ServiceTrainStep(client::RemoteLayer& layer, const ServiceTrainer& t,
                              const std::vector<MicroBatch>& mbs, bool optimizer_step,
                              ModeResult* r) {
  ServiceTrainer stepping = t;
  stepping.step = [&layer] { return layer.Step().status(); };
  return ServiceTrainStep(stepping, mbs, optimizer_step, r);
}

absl::Status ServiceTrainStep(const ServiceTrainer& t, const std::vector<MicroBatch>& mbs,
                              bool optimizer_step, ModeResult* r) {
  const Clock::time_point t0 = Clock::now();
  std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> fwd;
  for (size_t i = 0; i < mbs.size(); ++i) fwd.push_back(t.forward(i, true));
  std::vector<uint64_t> ctx;
  for (size_t i = 0; i < fwd.size(); ++i) {
    auto out = fwd[i].get();  // in issue order: a later call's latency is seen no earlier
    if (r) r->forward_latency.push_back(Since(t0));
    if (!out.ok()) return AfterTheRest(fwd, t, out.status());
    if (r) {
      // out is x's size, whether it came back or went to a destination.
      r->payload_bytes += 2 * Bytes(mbs[i].x) + Bytes(mbs[i].ids) + Bytes(mbs[i].weights) +
                          Bytes(out->expert_ids) + Bytes(out->weights);
    }
    ctx.push_back(out->context_id);
  }
  const Clock::time_point t1 = Clock::now();
  std::vector<std::future<absl::StatusOr<client::BackwardOutput>>> bwd;
  for (size_t i = 0; i < mbs.size(); ++i) bwd.push_back(t.backward(i, ctx[i]));
  for (size_t i = 0; i < bwd.size(); ++i) {
    auto out = bwd[i].get();
    if (r) r->backward_latency.push_back(Since(t1));
    if (!out.ok()) return AfterTheRest(bwd, t, out.status());
    // dx is dout's size, dweights the routing weights' (float32 [T, K]).
    if (r) r->payload_bytes += 2 * Bytes(mbs[i].dout) + Bytes(mbs[i].weights);
  }
  if (optimizer_step) MOE_RETURN_IF_ERROR(t.step());
  return t.finish();
}

absl::Status ServiceInferRound(const ServiceTrainer& t, const std::vector<MicroBatch>& mbs,
                               ModeResult* r) {
  const Clock::time_point t0 = Clock::now();
  std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> fwd;
  for (size_t i = 0; i < mbs.size(); ++i) fwd.push_back(t.forward(i, false));
  for (size_t i = 0; i < fwd.size(); ++i) {
    auto out = fwd[i].get();
    if (r) r->forward_latency.push_back(Since(t0));
    if (!out.ok()) return AfterTheRest(fwd, t, out.status());
    if (r) {
      r->payload_bytes += 2 * Bytes(mbs[i].x) + Bytes(mbs[i].ids) + Bytes(mbs[i].weights) +
                          Bytes(out->expert_ids) + Bytes(out->weights);
    }
  }
  return t.finish();
}

absl::Status InprocTrainStep(Layer& layer, const InprocTrainer& t, size_t n, bool optimizer_step,
                             ModeResult* r) {
  std::vector<std::unique_ptr<SavedContext>> ctx;
  for (size_t i = 0; i < n; ++i) {
    const Clock::time_point t0 = Clock::now();
    auto out = layer.Forward(t.forward(i, true));
    if (r) r->forward_latency.push_back(Since(t0));
    if (!out.ok()) return out.status();
    ctx.push_back(std::move(out->context));
  }
  for (size_t i = 0; i < n; ++i) {
    const Clock::time_point t0 = Clock::now();
    auto out = layer.Backward(std::move(ctx[i]), t.backward(i));
    if (r) r->backward_latency.push_back(Since(t0));
    if (!out.ok()) return out.status();
  }
  if (optimizer_step) MOE_RETURN_IF_ERROR(layer.Step().status());
  return t.finish();
}

absl::Status InprocInferRound(Layer& layer, const InprocTrainer& t, size_t n, ModeResult* r) {
  for (size_t i = 0; i < n; ++i) {
    const Clock::time_point t0 = Clock::now();
    auto out = layer.Forward(t.forward(i, false));
    if (r) r->forward_latency.push_back(Since(t0));
    if (!out.ok()) return out.status();
  }
  return t.finish();
}

}  // namespace moe::bench
