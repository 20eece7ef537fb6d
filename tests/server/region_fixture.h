// What the service tests of registered memory regions share: a POSIX shared memory region
// registered in a connection's session through the plain stub, with tensors laid out in it
// (RegionArena); proto tensors sent inline or by reference; Forward and Backward streams and
// region calls whose metadata names any session; and the server's metrics as text.
#ifndef MOE_TESTS_SERVER_REGION_FIXTURE_H_
#define MOE_TESTS_SERVER_REGION_FIXTURE_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/shared_memory_region.h"
#include "common/tensor.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/server.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {

// One-message micro-batches without tensors: a training Forward of `layer` keeping
// `context_id`, and its Backward.
v1::ForwardRequest ForwardOf(const std::string& layer, uint64_t context_id);
v1::BackwardRequest BackwardOf(const std::string& layer, uint64_t context_id);
// A tensor with its bytes in the message.
v1::Tensor Inline(const Tensor& t);
// A tensor of `t`'s dtype and shape by reference, no bytes.
v1::Tensor ByRef(const Tensor& t, uint64_t region_id, int64_t offset);
v1::TensorRef RefTo(uint64_t region_id, int64_t offset);
// A tensor of the response: its bytes (in one message), dtype and shape.
Tensor FromProto(const v1::Tensor& t);

// A ClientContext with a 20 s deadline, `token` (unless empty) and the metadata
// "moe-session-id: <session>" (unless empty): a call of any client in any session.
void PrepareAs(grpc::ClientContext* ctx, const std::string& token, const std::string& session);

// Unary region calls through `conn`'s stub, in `conn`'s session.
grpc::Status RegisterRegion(client::Connection& conn, const v1::RegisterRegionRequest& req,
                            v1::RegisterRegionResponse* resp);
grpc::Status UnregisterRegion(client::Connection& conn, uint64_t region_id);

// One Forward (Backward) stream of `requests`, naming `session` in its metadata.
Answer<v1::ForwardResponse> ForwardAs(client::Connection& conn, const std::string& session,
                                      const std::vector<v1::ForwardRequest>& requests);

// A shared memory region of `size_bytes` registered in `conn`'s session, and where its tensors
// are: Put copies a tensor in and Room sets bytes aside for an output (poisoned with 0xA5, so
// bytes the server leaves unwritten show), each at the next multiple of 64 bytes.
class RegionArena {
 public:
  // ASSERTs: call under ASSERT_NO_FATAL_FAILURE.
  void Create(client::Connection& conn, int64_t size_bytes);
  uint64_t id() const { return id_; }
  client::SharedMemoryRegion& shm() { return *shm_; }
  int64_t Put(const Tensor& t);
  int64_t Room(int64_t bytes);
  // The bytes at `offset` as a tensor of `dtype` and `shape`.
  Tensor Read(DType dtype, const std::vector<int64_t>& shape, int64_t offset) const;

 private:
  std::unique_ptr<client::SharedMemoryRegion> shm_;
  uint64_t id_ = 0;
  int64_t next_ = 0;
};

// The server's metrics in the Prometheus text format, as its endpoint serves them (read them
// with MetricValue).
std::string MetricsText(server::Server& server);

}  // namespace moe::server_test

#endif  // MOE_TESTS_SERVER_REGION_FIXTURE_H_
