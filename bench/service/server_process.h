// A moe-server in a child process of moe-service-bench, for --transport=cuda_ipc: CUDA IPC
// cannot open a handle in the process that exported it, so the server the trainer's device
// tensors go to must be another process on this host.
//
// The child is forked, not exec'd, so it is the same binary and needs no moe-server next to it;
// hence the fork must come before this process starts any thread or touches a GPU (main.cc forks
// right after parsing its flags). The child starts the server on loopback with free ports,
// reports them through a pipe, and serves until the parent closes its end of a second pipe
// (ServerProcess's destructor) or dies.
#ifndef MOE_BENCH_SERVICE_SERVER_PROCESS_H_
#define MOE_BENCH_SERVICE_SERVER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/options.h"

namespace moe::bench {

class ServerProcess {
 public:
  // Forks the child and waits until its server serves (or failed to start: its error).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Fork(const server::ServerOptions& options);
  // Tells the child to stop and waits for it.
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  const std::string& target() const { return target_; }    // "127.0.0.1:port"
  const std::string& metrics() const { return metrics_; }  // its /metrics, "127.0.0.1:port"
  const std::string& device() const { return device_; }    // the server's engine
  pid_t pid() const { return pid_; }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int stop_fd_ = -1;  // the write end the child watches: closing it stops the child
  std::string target_, metrics_, device_;
};

}  // namespace moe::bench

#endif  // MOE_BENCH_SERVICE_SERVER_PROCESS_H_
