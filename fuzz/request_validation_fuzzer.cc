// The request validators on parsed requests, as the service runs them before any work:
// request_validation.h (names, stripes, chunk sizes, weight chunks), LayerConfigFromProto, and,
// over a config the input also gives, the engine's ValidateForwardRequest, ValidateDout and
// ValidateStateTensor on tensors assembled as the server assembles them. No crash; every refusal
// is InvalidArgument; what a validator accepts keeps the promises the engine relies on (x is
// [T, d] with T >= 1 and T * K < 2^31, byte counts match shapes, configs round-trip).
//
// Input: byte 0 picks the request type, then a length-prefixed LayerConfig, an extent (Backward's
// token count), a length-prefixed layer name (ImportWeights' first message's), then the request.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "engine/layer.h"
#include "engine/routing.h"
#include "engine/state.h"
#include "fuzz/fuzz_input.h"
#include "google/protobuf/stubs/logging.h"
#include "moe/v1/moe.pb.h"
#include "server/request_validation.h"
#include "wire/wire.h"

namespace {

using moe::fuzz::FuzzInput;

// Protobuf logs every string field that is not UTF-8; a fuzzer makes millions.
[[maybe_unused]] const bool kProtobufQuiet = (google::protobuf::SetLogHandler(nullptr), true);

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void CheckRefusal(const absl::Status& st) {
  Check(st.ok() || st.code() == absl::StatusCode::kInvalidArgument);
}

// A request's tensor as the server assembles it from one message; a view into `a`.
bool Assemble(const moe::v1::Tensor& proto, moe::wire::TensorAssembler& a, moe::TensorView* out) {
  absl::Status st = a.Add(proto);
  CheckRefusal(st);
  if (!st.ok()) return false;
  absl::StatusOr<moe::TensorView> v = a.FinishView();
  CheckRefusal(v.status());
  if (!v.ok()) return false;
  *out = *v;
  return true;
}

void CreateLayer(const std::string& bytes) {
  moe::v1::CreateLayerRequest req;
  if (!req.ParseFromString(bytes)) return;
  CheckRefusal(moe::server::ValidateLayerName(req.name(), "name"));
  absl::StatusOr<moe::LayerConfig> c = moe::wire::LayerConfigFromProto(req.config());
  CheckRefusal(c.status());
  if (!c.ok()) return;
  // What the server reports back (LayerInfo.config) reads as the same config.
  const moe::v1::LayerConfig p = moe::wire::LayerConfigToProto(*c);
  absl::StatusOr<moe::LayerConfig> again = moe::wire::LayerConfigFromProto(p);
  Check(again.ok());
  Check(moe::wire::LayerConfigToProto(*again).SerializeAsString() == p.SerializeAsString());
}

void Forward(const std::string& bytes, const absl::StatusOr<moe::LayerConfig>& config) {
  moe::v1::ForwardRequest req;
  if (!req.ParseFromString(bytes)) return;
  CheckRefusal(moe::server::ValidateLayerName(req.layer(), "layer"));
  Check(moe::server::ResponseChunkBytes(req.max_response_chunk_bytes()) >=
        moe::server::kMinResponseChunkBytes);
  if (req.stripe().count() != 0) {
    CheckRefusal(moe::server::ValidateStripe(req.stripe(), req.context_id()));
  }
  using Sizing = moe::wire::TensorAssembler::Sizing;
  moe::wire::TensorAssembler x("x", Sizing::kClaimedOnceAnEighthArrived),
      ids("expert_ids", Sizing::kClaimedOnceAnEighthArrived),
      w("weights", Sizing::kClaimedOnceAnEighthArrived);
  moe::ForwardRequest f;
  f.training = req.training();
  if (!Assemble(req.x(), x, &f.x)) return;
  if (req.has_expert_ids() && !Assemble(req.expert_ids(), ids, &f.expert_ids)) return;
  if (req.has_weights() && !Assemble(req.weights(), w, &f.weights)) return;
  if (!config.ok()) return;
  absl::StatusOr<int64_t> t = moe::ValidateForwardRequest(*config, f);
  CheckRefusal(t.status());
  if (!t.ok()) return;
  Check(*t >= 1 && f.x.shape.size() == 2 && f.x.shape[0] == *t && f.x.shape[1] == config->d_model);
  Check(*t * config->top_k <= std::numeric_limits<int32_t>::max());
  Check(f.x.size_bytes ==
        static_cast<size_t>(*t * config->d_model) * moe::DTypeSize(config->dtype));
}

void Backward(const std::string& bytes, const absl::StatusOr<moe::LayerConfig>& config,
              int64_t tokens) {
  moe::v1::BackwardRequest req;
  if (!req.ParseFromString(bytes)) return;
  if (req.stripe().count() != 0) {
    CheckRefusal(moe::server::ValidateStripe(req.stripe(), req.context_id()));
  }
  moe::wire::TensorAssembler a("dout",
                               moe::wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived);
  moe::TensorView dout;
  // The token count comes from the saved context, which holds at least one token.
  if (!Assemble(req.dout(), a, &dout) || !config.ok() || tokens < 1) return;
  const absl::Status st = moe::ValidateDout(*config, dout, tokens);
  CheckRefusal(st);
  if (st.ok()) Check(dout.shape == std::vector<int64_t>({tokens, config->d_model}));
}

// ImportWeights: the message checks, then the tensor against a layer of `config`.
void Weights(const std::string& bytes, const absl::StatusOr<moe::LayerConfig>& config,
             const std::string& layer) {
  moe::v1::WeightChunk chunk;
  if (!chunk.ParseFromString(bytes)) return;
  CheckRefusal(moe::server::ValidateWeightChunk(chunk, layer));
  CheckRefusal(moe::server::ValidateImportStream(chunk.layer()));
  moe::wire::TensorAssembler a("tensor",
                               moe::wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived);
  CheckRefusal(a.Add(chunk.tensor()));
  absl::StatusOr<moe::Tensor> t = a.Finish();
  CheckRefusal(t.status());
  if (!t.ok() || !config.ok()) return;
  const moe::LayerConfig& c = *config;
  // The parameter shapes of engine/layer.h; the config's validation bounds their products.
  const std::vector<int64_t> w1 = {c.local_experts(), c.d_hidden, c.d_model};
  const std::vector<int64_t> w2 = {c.local_experts(), c.d_model, c.d_hidden};
  const std::vector<int64_t> router = {c.d_model, c.num_experts};
  const auto shape_of = [&](const std::string& p) -> const std::vector<int64_t>* {
    if (p == "w1" || (p == "w3" && c.gated())) return &w1;
    if (p == "w2") return &w2;
    if (p == "router" && c.routing == moe::RoutingMode::kServer) return &router;
    return nullptr;
  };
  const absl::Status st = moe::ValidateStateTensor(c, chunk.name(), *t, shape_of);
  CheckRefusal(st);
  if (st.ok() && chunk.name() != "step") {
    const std::vector<int64_t>* shape = shape_of(moe::ParseStateName(chunk.name()).param);
    Check(shape != nullptr && t->shape == *shape);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  const uint8_t kind = in.Byte();
  moe::v1::LayerConfig config_proto;
  const bool parsed = config_proto.ParseFromString(in.Bytes(255));
  const absl::StatusOr<moe::LayerConfig> config =
      parsed ? moe::wire::LayerConfigFromProto(config_proto)
             : absl::StatusOr<moe::LayerConfig>(absl::InvalidArgumentError("no config"));
  CheckRefusal(config.status());
  const int64_t tokens = in.Extent();
  const std::string layer = in.Bytes(8);
  const std::string rest = in.Rest();
  switch (kind % 4) {
    case 0:
      CreateLayer(rest);
      break;
    case 1:
      Forward(rest, config);
      break;
    case 2:
      Backward(rest, config, tokens);
      break;
    default:
      Weights(rest, config, layer);
      break;
  }
  return 0;
}
