// The /metrics HTTP endpoint (see metrics_http.h): HTTP/1.0-style, one request per connection,
// "Connection: close". A slow or silent client is dropped after a 2 s read timeout so it cannot
// stall later scrapes.
#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace moe::server {
namespace {

constexpr int kReadTimeoutMs = 2000;

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the scraper went away; nothing to report to anyone
    done += static_cast<size_t>(n);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->registry_ = std::move(registry);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_host: cannot resolve \"", host, "\": ", ::gai_strerror(rc)));
  }
  std::string error = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      s->listen_fd_ = fd;
      break;
    }
    error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (s->listen_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics_port: cannot listen on ", host, ":", port, ": ", error));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (::pipe2(s->wake_fds_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("metrics endpoint: pipe: ", std::strerror(errno)));
  }
  s->thread_ = std::thread([p = s.get()] { p->Run(); });
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (thread_.joinable()) {
    char b = 1;
    (void)!::write(wake_fds_[1], &b, 1);
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_fds_[0], wake_fds_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void MetricsHttpServer::Run() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    if (fds[0].revents & POLLIN) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        Serve(fd);
        ::close(fd);
      }
    }
  }
}

void MetricsHttpServer::Serve(int fd) {
  // Read until the end of the request headers (or 8 KiB, or the timeout).
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos && request.size() < 8192) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, kReadTimeoutMs) <= 0) return;
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const size_t line_end = request.find_first_of("\r\n");
  const std::string line = request.substr(0, line_end);
  std::string path;
  if (line.rfind("GET ", 0) == 0) {
    path = line.substr(4, line.find(' ', 4) - 4);
    if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  }
  if (path != "/metrics") {
    const std::string body = "moe-server: metrics are at /metrics\n";
    WriteAll(fd, absl::StrCat("HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
                              "Content-Length: ",
                              body.size(), "\r\nConnection: close\r\n\r\n", body));
    return;
  }
  std::ostringstream body;
  prometheus::TextSerializer().Serialize(body, registry_->Collect());
  const std::string text = body.str();
  WriteAll(fd, absl::StrCat("HTTP/1.1 200 OK\r\n"
                            "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                            "Content-Length: ",
                            text.size(), "\r\nConnection: close\r\n\r\n", text));
}

}  // namespace moe::server
