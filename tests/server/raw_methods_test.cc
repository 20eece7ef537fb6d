// The server's methods as raw bytes, through grpc's generic stub against a real moe-server on
// loopback: reflection lists the ExpertService and the health service, and Forward and Backward
// (raw methods on the server, wire/raw_message.h) answer bytes that are not a message with
// INVALID_ARGUMENT naming the message type.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "client/client.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

// grpc++ ships no reflection client, so this speaks grpc.reflection.v1alpha by hand through the
// generic stub: a ServerReflectionRequest with list_services = "" (field 7) and a check that the
// answer names moe.v1.ExpertService and the health service.
class RawBidi : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RawBidi(const std::string& request) {
    grpc::Slice slice(request);
    request_ = grpc::ByteBuffer(&slice, 1);
  }
  void Start() {
    StartWrite(&request_);
    StartRead(&response_);
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (ok) StartWritesDone();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    std::vector<grpc::Slice> slices;
    response_.Dump(&slices);
    for (const auto& s : slices) text_.append(reinterpret_cast<const char*>(s.begin()), s.size());
    StartRead(&response_);
  }
  void OnDone(const grpc::Status& status) override { done_.set_value(status); }
  std::future<grpc::Status> done() { return done_.get_future(); }
  const std::string& text() const { return text_; }
  grpc::ClientContext ctx;

 private:
  grpc::ByteBuffer request_, response_;
  std::string text_;
  std::promise<grpc::Status> done_;
};

TEST(ServiceTest, ServesReflectionAndHealth) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  EXPECT_TRUE(lb.conn->Health().ok());
  auto channel = grpc::CreateChannel(lb.target(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  RawBidi call(std::string("\x3a\x00", 2));
  call.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto done = call.done();
  stub.PrepareBidiStreamingCall(
      &call.ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", {}, &call);
  call.Start();
  grpc::Status st = done.get();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_NE(call.text().find("moe.v1.ExpertService"), std::string::npos) << call.text();
  EXPECT_NE(call.text().find("grpc.health.v1.Health"), std::string::npos) << call.text();
}

// Forward and Backward are raw methods on the server (wire/raw_message.h): bytes that are not a
// message get InvalidArgument naming the message type, and the server keeps serving.
TEST(ServiceTest, MalformedMicroBatchBytesAreInvalidArgument) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  auto channel = grpc::CreateChannel(lb.target(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  struct Case {
    const char* method;
    std::string bytes;
    const char* type;
  };
  const Case cases[] = {
      // x: 5 bytes of tensor announcing 16 bytes of data.
      {"/moe.v1.ExpertService/Forward", std::string("\x22\x05\x1a\x10\x61\x62\x63", 7),
       "moe.v1.ForwardRequest"},
      // a stray end of group.
      {"/moe.v1.ExpertService/Backward", std::string("\x0c", 1), "moe.v1.BackwardRequest"}};
  for (const Case& c : cases) {
    RawBidi call(c.bytes);
    call.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto done = call.done();
    stub.PrepareBidiStreamingCall(&call.ctx, c.method, {}, &call);
    call.Start();
    ExpectStatus(done.get(), grpc::StatusCode::INVALID_ARGUMENT, c.type);
  }
  EXPECT_TRUE(lb.conn->Health().ok());
}

}  // namespace
}  // namespace moe::server_test
