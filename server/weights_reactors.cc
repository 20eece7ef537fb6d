// ExpertService.ExportWeights and ImportWeights: a layer's state streamed out and in as
// WeightChunks.
//
// Export builds every chunk on the device executor (a copy of the state, so the layer trains on)
// and writes them one at a time. Import assembles the chunks as they arrive, charging each to the
// memory ledger before it is copied in, as a micro-batch's tensors are, and hands the whole
// state to the layer on the executor once the client half-closes: ImportState changes nothing
// unless every tensor passes.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/held_bytes.h"
#include "server/request_validation.h"
#include "server/service.h"
#include "server/service_internal.h"
#include "server/status_map.h"
#include "wire/wire.h"

namespace moe::server {
namespace {

class ExportReactor final : public grpc::ServerWriteReactor<v1::WeightChunk> {
 public:
  ExportReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx,
                const v1::ExportWeightsRequest* req)
      : service_(s), ctx_(ctx), req_(*req), caller_(s->Authenticate(ctx)) {
    s->metrics().BytesIn("ExportWeights", static_cast<int64_t>(req->ByteSizeLong()));
    if (!caller_.ok()) {
      Done(caller_.status());
      return;
    }
    s->executor().Submit([this](double queued) {
      const absl::Status st =
          TimedWork(service_->metrics(), "ExportWeights", queued, ctx_, [this] { return Build(); });
      if (!st.ok()) {
        Done(st);
        return;
      }
      send_start_ = Clock::now();
      if (chunks_.empty()) {
        Done(absl::OkStatus());
      } else {
        StartWrite(&chunks_[0]);
      }
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client went away during the export"));
      return;
    }
    service_->metrics().BytesOut("ExportWeights",
                                 static_cast<int64_t>(chunks_[next_].ByteSizeLong()));
    if (++next_ < chunks_.size()) {
      StartWrite(&chunks_[next_]);
      return;
    }
    service_->metrics().Stage("ExportWeights", "send", SecondsSince(send_start_));
    Done(absl::OkStatus());
  }
  void OnDone() override { delete this; }

 private:
  // Executor only: the layer's state, cut into chunks of at most the requested bytes.
  absl::Status Build() {
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, service_->FindLayer(req_.layer()));
    MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(*caller_, *entry, Access::kRead, "layer"));
    MOE_ASSIGN_OR_RETURN(const auto state, entry->layer->ExportState(req_.include_optimizer()));
    const int64_t chunk =
        ExportChunkBytes(req_.max_chunk_bytes(), service_->options().max_message_bytes);
    for (const auto& [name, t] : state) {
      size_t offset = 0;
      do {
        const size_t take = std::min<size_t>(static_cast<size_t>(chunk), t.bytes.size() - offset);
        v1::WeightChunk c;
        c.set_layer(req_.layer());
        c.set_name(name);
        wire::SetTensorHeader(t.dtype, t.shape, c.mutable_tensor());
        c.mutable_tensor()->set_offset(static_cast<int64_t>(offset));
        c.mutable_tensor()->set_data(reinterpret_cast<const char*>(t.bytes.data()) + offset, take);
        offset += take;
        c.set_last_chunk(offset == t.bytes.size());
        chunks_.push_back(std::move(c));
      } while (offset < t.bytes.size());
    }
    return absl::OkStatus();
  }
  void Done(const absl::Status& st) {
    service_->metrics().Request("ExportWeights", GrpcCodeName(ToGrpcStatus(st).error_code()));
    Finish(ToGrpcStatus(st));
  }

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  const v1::ExportWeightsRequest req_;
  const absl::StatusOr<Caller> caller_;
  std::vector<v1::WeightChunk> chunks_;
  size_t next_ = 0;
  Clock::time_point send_start_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::WeightChunk> {
 public:
  ImportReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx,
                v1::ImportWeightsResponse* resp)
      : service_(s),
        ctx_(ctx),
        resp_(resp),
        caller_(s->Authenticate(ctx)),
        charge_(s->ledger().NewRequestCharge()) {
    if (!caller_.ok()) {
      Done(caller_.status());
      return;
    }
    StartRead(&chunk_);
    receive_start_ = Clock::now();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (ctx_->IsCancelled()) {
        Done(absl::CancelledError("import cancelled"));
        return;
      }
      service_->metrics().Stage("ImportWeights", "receive", SecondsSince(receive_start_));
      service_->executor().Submit([this](double queued) {
        Done(TimedWork(service_->metrics(), "ImportWeights", queued, ctx_,
                       [this] { return Apply(); }));
      });
      return;
    }
    service_->metrics().BytesIn("ImportWeights", static_cast<int64_t>(chunk_.ByteSizeLong()));
    if (absl::Status st = Add(); !st.ok()) {
      Done(st);
      return;
    }
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  // The chunk just read: checked, charged to the memory ledger, then copied into its tensor.
  absl::Status Add() {
    MOE_RETURN_IF_ERROR(ValidateWeightChunk(chunk_, layer_));
    if (layer_.empty()) {
      layer_ = chunk_.layer();
      // Refused before any tensor is buffered; Apply checks again on the executor.
      if (auto entry = service_->FindLayer(layer_); entry.ok()) {
        MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(*caller_, **entry, Access::kManage, "layer"));
      }
    }
    auto it = parts_.find(chunk_.name());
    if (it == parts_.end()) {
      it = parts_
               .emplace(chunk_.name(),
                        std::make_unique<wire::TensorAssembler>(
                            absl::StrCat("tensor ", chunk_.name()),
                            wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived))
               .first;
    }
    // Charged to the memory ledger before it is copied in, as a micro-batch's tensors are.
    const absl::string_view data = chunk_.tensor().data();
    held_total_ = SaturatingAdd(
        held_total_, held_[chunk_.name()].Add(chunk_.tensor(), absl::MakeConstSpan(&data, 1)));
    MOE_RETURN_IF_ERROR(charge_.Set(held_total_, absl::StrCat("tensor ", chunk_.name())));
    return it->second->Add(chunk_.tensor());
  }

  // Executor only: the assembled state into the layer, whole or not at all.
  absl::Status Apply() {
    MOE_RETURN_IF_ERROR(ValidateImportStream(layer_));
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, service_->FindLayer(layer_));
    MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(*caller_, *entry, Access::kManage, "layer"));
    std::map<std::string, Tensor> state;
    for (auto& [name, assembler] : parts_) {
      MOE_ASSIGN_OR_RETURN(state[name], assembler->Finish());
    }
    MOE_RETURN_IF_ERROR(entry->layer->ImportState(state));
    service_->RefreshLayer(*entry);
    resp_->set_tensors(static_cast<int64_t>(state.size()));
    return absl::OkStatus();
  }
  void Done(const absl::Status& st) {
    service_->metrics().Request("ImportWeights", GrpcCodeName(ToGrpcStatus(st).error_code()));
    if (st.ok())
      service_->metrics().BytesOut("ImportWeights", static_cast<int64_t>(resp_->ByteSizeLong()));
    Finish(ToGrpcStatus(st));
  }

  ExpertServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  v1::ImportWeightsResponse* resp_;
  const absl::StatusOr<Caller> caller_;
  v1::WeightChunk chunk_;
  std::string layer_;
  std::map<std::string, std::unique_ptr<wire::TensorAssembler>> parts_;
  std::map<std::string, HeldBytes> held_;  // what each part holds, for the ledger
  int64_t held_total_ = 0;
  MemoryLedger::RequestCharge charge_;
  Clock::time_point receive_start_;
};

}  // namespace

grpc::ServerWriteReactor<v1::WeightChunk>* ExpertServiceImpl::ExportWeights(
    grpc::CallbackServerContext* ctx, const v1::ExportWeightsRequest* req) {
  return new ExportReactor(this, ctx, req);
}

grpc::ServerReadReactor<v1::WeightChunk>* ExpertServiceImpl::ImportWeights(
    grpc::CallbackServerContext* ctx, v1::ImportWeightsResponse* resp) {
  return new ImportReactor(this, ctx, resp);
}

}  // namespace moe::server
