// The registered-region helpers of tests/server (region_fixture.h).
#include "tests/server/region_fixture.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <cstring>
#include <utility>

#include "server/metrics.h"
#include "server/service.h"
#include "wire/wire.h"

namespace moe::server_test {

v1::ForwardRequest ForwardOf(const std::string& layer, uint64_t context_id) {
  v1::ForwardRequest r;
  r.set_layer(layer);
  r.set_context_id(context_id);
  r.set_training(true);
  r.set_last_chunk(true);
  return r;
}

v1::BackwardRequest BackwardOf(const std::string& layer, uint64_t context_id) {
  v1::BackwardRequest r;
  r.set_layer(layer);
  r.set_context_id(context_id);
  r.set_last_chunk(true);
  return r;
}

v1::Tensor Inline(const Tensor& t) {
  v1::Tensor p;
  wire::SetTensorHeader(t.dtype, t.shape, &p);
  p.set_data(t.bytes.data(), t.bytes.size());
  return p;
}

v1::Tensor ByRef(const Tensor& t, uint64_t region_id, int64_t offset) {
  v1::Tensor p;
  wire::SetTensorRef(t.dtype, t.shape, region_id, offset, &p);
  return p;
}

v1::TensorRef RefTo(uint64_t region_id, int64_t offset) {
  v1::TensorRef r;
  r.set_region_id(region_id);
  r.set_offset(offset);
  return r;
}

Tensor FromProto(const v1::Tensor& t) {
  absl::StatusOr<DType> dtype = wire::DTypeFromProto(t.dtype(), "tensor");
  EXPECT_TRUE(dtype.ok()) << dtype.status();
  Tensor out =
      Tensor::Zeros(dtype.ok() ? *dtype : DType::kFloat32, {t.shape().begin(), t.shape().end()});
  EXPECT_EQ(out.bytes.size(), t.data().size());
  std::memcpy(out.bytes.data(), t.data().data(), std::min(out.bytes.size(), t.data().size()));
  return out;
}

void PrepareAs(grpc::ClientContext* ctx, const std::string& token, const std::string& session) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  if (!session.empty()) ctx->AddMetadata(server::kSessionMetadataKey, session);
}

grpc::Status RegisterRegion(client::Connection& conn, const v1::RegisterRegionRequest& req,
                            v1::RegisterRegionResponse* resp) {
  grpc::ClientContext ctx;
  conn.Prepare(&ctx);
  return conn.stub()->RegisterRegion(&ctx, req, resp);
}

grpc::Status UnregisterRegion(client::Connection& conn, uint64_t region_id) {
  grpc::ClientContext ctx;
  conn.Prepare(&ctx);
  v1::UnregisterRegionRequest req;
  req.set_region_id(region_id);
  v1::UnregisterRegionResponse resp;
  return conn.stub()->UnregisterRegion(&ctx, req, &resp);
}

Answer<v1::ForwardResponse> ForwardAs(client::Connection& conn, const std::string& session,
                                      const std::vector<v1::ForwardRequest>& requests) {
  grpc::ClientContext ctx;
  PrepareAs(&ctx, conn.options().token, session);
  auto stream = conn.stub()->Forward(&ctx);
  for (const v1::ForwardRequest& r : requests) {
    if (!stream->Write(r)) break;
  }
  stream->WritesDone();
  Answer<v1::ForwardResponse> a;
  v1::ForwardResponse resp;
  while (stream->Read(&resp)) a.responses.push_back(resp);
  a.status = stream->Finish();
  return a;
}

void RegionArena::Create(client::Connection& conn, int64_t size_bytes) {
  auto shm = client::SharedMemoryRegion::Create(size_bytes);
  ASSERT_TRUE(shm.ok()) << shm.status();
  shm_ = std::move(*shm);
  v1::RegisterRegionResponse resp;
  const grpc::Status st = RegisterRegion(conn, shm_->RegisterRequest(), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_NE(resp.region_id(), 0u);
  ASSERT_EQ(resp.size_bytes(), size_bytes);
  id_ = resp.region_id();
}

int64_t RegionArena::Room(int64_t bytes) {
  const int64_t at = next_;
  EXPECT_LE(at + bytes, shm_->size_bytes()) << "the arena is full";
  std::memset(static_cast<char*>(shm_->data()) + at, 0xA5, static_cast<size_t>(bytes));
  next_ = (at + bytes + 63) / 64 * 64;
  return at;
}

int64_t RegionArena::Put(const Tensor& t) {
  const int64_t at = Room(static_cast<int64_t>(t.bytes.size()));
  std::memcpy(static_cast<char*>(shm_->data()) + at, t.bytes.data(), t.bytes.size());
  return at;
}

Tensor RegionArena::Read(DType dtype, const std::vector<int64_t>& shape, int64_t offset) const {
  Tensor t = Tensor::Zeros(dtype, shape);
  std::memcpy(t.bytes.data(), static_cast<const char*>(shm_->data()) + offset, t.bytes.size());
  return t;
}

std::string MetricsText(server::Server& server) {
  return prometheus::TextSerializer().Serialize(server.metrics().registry()->Collect());
}

}  // namespace moe::server_test
