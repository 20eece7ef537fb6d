// The client's NCCL decisions without a GPU (client/nccl_channel.h): when device calls try NCCL
// (WantsNccl), which calls can (NcclCallDevice), and that a channel a server or a client without
// NCCL cannot open is FAILED_PRECONDITION saying why, while host calls on a connection that asked
// for NCCL go on as before.
#include "client/nccl_channel.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tests/client/test_util.h"

namespace moe::client {
namespace {

using testing_util::StartServer;
using testing_util::Target;

TEST(NcclRouteTest, WantsNcclForAnotherHostOrWhenAsked) {
  using R = DeviceTransportRequest;
  EXPECT_TRUE(WantsNccl(R::kAuto, /*nccl_built=*/true, /*local_target=*/false));
  EXPECT_FALSE(WantsNccl(R::kAuto, true, true));    // on this host: CUDA IPC or staged
  EXPECT_FALSE(WantsNccl(R::kAuto, false, false));  // no NCCL in this client
  EXPECT_TRUE(WantsNccl(R::kNccl, true, true));
  EXPECT_FALSE(WantsNccl(R::kNccl, false, true));
  EXPECT_FALSE(WantsNccl(R::kNever, true, false));
}

TEST(NcclRouteTest, OnlyCallsWhollyOnOneDeviceGoOverNccl) {
  const MemoryLocation gpu0 = MemoryLocation::Cuda(0), gpu1 = MemoryLocation::Cuda(1);
  char byte = 0;
  TensorView x{DType::kFloat32, {1, 1}, &byte, 4, gpu0};
  TensorView ids{DType::kInt32, {1, 1}, &byte, 4, gpu0};
  TensorView none;
  MutableTensorView out{DType::kFloat32, {1, 1}, &byte, 4, gpu0};
  MutableTensorView empty;
  const TensorView* in[] = {&x, &ids};
  const MutableTensorView* req[] = {&out};
  EXPECT_EQ(NcclCallDevice(in, req, {}), 0);
  const TensorView* with_absent[] = {&x, &none};
  EXPECT_EQ(NcclCallDevice(with_absent, req, {}), 0);
  const MutableTensorView* opt_empty[] = {&empty};
  EXPECT_EQ(NcclCallDevice(in, req, opt_empty), 0);
  const MutableTensorView* no_dest[] = {&empty};
  EXPECT_EQ(NcclCallDevice(in, no_dest, {}), -1);  // out must be given
  TensorView host_ids = ids;
  host_ids.location = MemoryLocation::Host();
  const TensorView* mixed[] = {&x, &host_ids};
  EXPECT_EQ(NcclCallDevice(mixed, req, {}), -1);
  MutableTensorView other = out;
  other.location = gpu1;
  const MutableTensorView* two_devices[] = {&other};
  EXPECT_EQ(NcclCallDevice(in, two_devices, {}), -1);
}

TEST(NcclRouteTest, AChannelTheServerOrClientCannotHaveIsFailedPrecondition) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  ClientOptions o;
  o.device_transport = DeviceTransportRequest::kNccl;
  auto conn = Connection::Connect(Target(*server), o);
  ASSERT_TRUE(conn.ok()) << conn.status();
  absl::StatusOr<std::shared_ptr<NcclChannel>> ch = NcclChannel::Open(**conn, 0);
  EXPECT_EQ(ch.status().code(), absl::StatusCode::kFailedPrecondition) << ch.status();
  EXPECT_TRUE(absl::StrContains(ch.status().message(), "NCCL")) << ch.status();
  // Host tensors are not NCCL's: they go over TCP as before.
  LayerConfig c = testing_util::ServerRoutedConfig(16, 8);
  auto layer = RemoteLayer::Create(*conn, "host-on-nccl-connection", c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Tensor x = Tensor::Zeros(DType::kFloat32, {4, 16});
  Tensor out = Tensor::Zeros(DType::kFloat32, {4, 16});
  auto r = (*layer)->ForwardInto(x.view(), {}, {}, out.mutable_view()).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE((*conn)->device_transport(), DeviceTransport::kNccl);
}

}  // namespace
}  // namespace moe::client
