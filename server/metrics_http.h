// The HTTP endpoint Prometheus scrapes: GET /metrics answers the registry in the text
// exposition format (prometheus-cpp's TextSerializer); anything else is 404.
//
// Why not prometheus-cpp's Exposer: it runs on civetweb, whose threads are created with a fixed
// ~100 KiB stack. glibc places every initially loaded library's static TLS on each thread's
// stack, and the CUDA engine links cuBLASLt, whose static TLS alone is ~94 KiB; civetweb's
// pthread_create then fails with EINVAL and the exposer cannot start in a CUDA build. One thread
// with a default-sized stack serving scrapes one at a time is all a scrape endpoint needs.
#ifndef MOE_SERVER_METRICS_HTTP_H_
#define MOE_SERVER_METRICS_HTTP_H_

#include <prometheus/registry.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace moe::server {

class MetricsHttpServer {
 public:
  // Listens on host:port (port 0 picks a free one). InvalidArgument naming "metrics_host" if
  // the host does not resolve; Unavailable naming "metrics_port" if it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsHttpServer();  // stops accepting and joins within one poll interval
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Run();
  void Serve(int fd);

  std::shared_ptr<prometheus::Registry> registry_;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a pipe: writing to it ends Run()
  int port_ = 0;
  std::thread thread_;
};

}  // namespace moe::server

#endif  // MOE_SERVER_METRICS_HTTP_H_
