// grpc_health_probe: asks a gRPC server's grpc.health.v1.Health/Check for one service and exits
// 0 only when the answer is SERVING, exactly the question the kubelet's native gRPC probe asks
// (deploy/kubernetes/deployment.yaml). The deploy tests use it to show that the probes the
// manifests configure succeed against a real moe-server.
//
// Debian ships no health.proto, so the two one-field messages are encoded by hand and sent
// through grpc::GenericStub: HealthCheckRequest{string service = 1} and
// HealthCheckResponse{ServingStatus status = 1}, SERVING = 1.
//
// Usage: grpc_health_probe HOST:PORT [SERVICE]      (SERVICE "" asks about the whole server)
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>

namespace {

constexpr int kServing = 1;
constexpr auto kDeadline = std::chrono::seconds(5);

grpc::ByteBuffer EncodeRequest(const std::string& service) {
  std::string bytes;
  if (!service.empty()) {
    // A proto3 string field: tag (1 << 3 | wire type 2), varint length, bytes.
    bytes.push_back(0x0a);
    size_t n = service.size();
    do {
      unsigned char b = n & 0x7f;
      n >>= 7;
      bytes.push_back(static_cast<char>(n ? (b | 0x80) : b));
    } while (n);
    bytes += service;
  }
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Returns the status field, 0 (UNKNOWN) when absent as proto3 encodes the default, or -1 when
// the bytes are not a HealthCheckResponse.
int DecodeStatus(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.empty()) return 0;
  if (bytes.size() < 2 || bytes[0] != 0x08) return -1;
  return static_cast<unsigned char>(bytes[1]) & 0x7f;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s HOST:PORT [SERVICE]\n", argv[0]);
    return 2;
  }
  const std::string address = argv[1];
  const std::string service = argc == 3 ? argv[2] : "";
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kDeadline);
  grpc::ByteBuffer request = EncodeRequest(service);
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                 &response, [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = std::move(s);
                   done = true;
                   cv.notify_one();
                 });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  if (!status.ok()) {
    std::fprintf(stderr, "health check of \"%s\" at %s failed: code %d: %s\n", service.c_str(),
                 address.c_str(), static_cast<int>(status.error_code()),
                 status.error_message().c_str());
    return 1;
  }
  const int serving = DecodeStatus(response);
  std::printf("%s \"%s\": status %d%s\n", address.c_str(), service.c_str(), serving,
              serving == kServing ? " (SERVING)" : "");
  return serving == kServing ? 0 : 1;
}
