// ServerProcess (see server_process.h): fork, a report pipe (child -> parent: one line, "ok
// PORT METRICS_PORT DEVICE" or "error MESSAGE") and a stop pipe (parent -> child: EOF stops it).
#include "bench/service/server_process.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/server.h"

namespace moe::bench {
namespace {

void WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// The child: serve until the stop pipe reports EOF. Never returns.
[[noreturn]] void RunChild(const server::ServerOptions& options, int report_fd, int stop_fd) {
  // Also go when the parent dies without closing the pipe cleanly.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  absl::StatusOr<std::unique_ptr<server::Server>> s = server::Server::Start(options);
  if (!s.ok()) {
    WriteAll(report_fd, absl::StrCat("error ", s.status().ToString(), "\n"));
    _exit(1);
  }
  WriteAll(report_fd, absl::StrCat("ok ", (*s)->port(), " ", (*s)->metrics_port(), " ",
                                   (*s)->device(), "\n"));
  close(report_fd);
  char c;
  while (true) {
    const ssize_t n = read(stop_fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the parent is done (or gone)
  }
  (*s)->Shutdown();
  s->reset();
  _exit(0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Fork(
    const server::ServerOptions& options) {
  int report[2], stop[2];
  if (pipe(report) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  if (pipe(stop) != 0) {
    close(report[0]);
    close(report[1]);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t pid = fork();
  if (pid < 0) {
    for (int fd : {report[0], report[1], stop[0], stop[1]}) close(fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    close(report[0]);
    close(stop[1]);
    RunChild(options, report[1], stop[0]);
  }
  close(report[1]);
  close(stop[0]);
  std::unique_ptr<ServerProcess> p(new ServerProcess());
  p->pid_ = pid;
  p->stop_fd_ = stop[1];
  std::string line;
  char buf[256];
  while (line.find('\n') == std::string::npos) {
    const ssize_t n = read(report[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  close(report[0]);
  line = line.substr(0, line.find('\n'));
  std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(' ', 3));
  int port = 0, metrics_port = 0;
  if (f.size() != 4 || f[0] != "ok" || !absl::SimpleAtoi(f[1], &port) ||
      !absl::SimpleAtoi(f[2], &metrics_port)) {
    // The destructor stops and reaps the child.
    return absl::UnavailableError(absl::StrCat(
        "the moe-server child process did not start: ",
        line.empty() ? "it exited without a word" : line.substr(line.find(' ') + 1)));
  }
  p->target_ = absl::StrCat("127.0.0.1:", port);
  p->metrics_ = metrics_port > 0 ? absl::StrCat("127.0.0.1:", metrics_port) : "";
  p->device_ = f[3];
  return p;
}

ServerProcess::~ServerProcess() {
  if (stop_fd_ >= 0) close(stop_fd_);
  if (pid_ > 0) {
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

}  // namespace moe::bench
