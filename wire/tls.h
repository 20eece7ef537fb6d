// Transport security for moe.v1.ExpertService: PEM files in, gRPC credentials out, for
// moe-server and moe::client alike (kept here, beside the wire code, so neither end depends on
// the other).
//
// Without TLS every byte of a micro-batch (activations, gradients) and every call that changes
// state (Step, LoadCheckpoint, DeleteLayer) crosses the network in the clear and from anyone who
// can reach the port. With a server certificate the channel is encrypted and the client checks
// whom it talks to; with a client CA as well (mutual TLS) the server serves only clients whose
// certificate that CA signed. docs/OPERATIONS.md, "Transport security", says how to deploy it.
#ifndef MOE_WIRE_TLS_H_
#define MOE_WIRE_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace moe::wire {

// The server's side. All empty: plaintext. cert_file and key_file: TLS. client_ca_file as well:
// mutual TLS, every client must present a certificate that this CA signed.
struct ServerTls {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  // > 0: the files are read again this often and new connections get what they hold then, so
  // a renewed certificate (cert-manager's, say) is served without a restart; an update whose
  // key does not match its certificate is skipped. 0: read once, at start.
  int reload_seconds = 300;
};

// The client's side: TLS when `enabled` or any other field is given. ca_file empty: the server is
// checked against the system's root CAs. cert_file and key_file: the client's own certificate,
// for a mutual-TLS server.
struct ClientTls {
  bool enabled = false;
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  // The name the server's certificate must carry, where it is not the target's host (an IP
  // address, a load balancer's name). Empty: the target's host.
  std::string server_name;
  // > 0: ca_file, cert_file and key_file are read again this often, and connections opened
  // afterwards (a channel reconnecting after the server closed it, say) use what they hold
  // then, so a trainer's renewed client certificate, or a rotated CA, is used without building
  // a new client. 0: read once, when the client connects.
  int reload_seconds = 300;
};

// Whether `tls` asks for TLS: `enabled`, or any other field given.
bool UsesTls(const ClientTls& tls);

// InsecureServerCredentials when `tls`'s files are all empty. InvalidArgument names the field
// (`prefix` + "cert_file", ...) for a half-given pair, a CA without a certificate, a file that
// cannot be read or holds no PEM block, a key that is not the certificate's, a client CA that
// is no certificate, or a negative reload_seconds. The files are checked by listening with them
// once, on a free loopback port.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTls& tls, absl::string_view prefix);

// InsecureChannelCredentials unless TLS is asked for (above); errors as above, the client's
// certificate and key checked as the server's are (a key that is not the certificate's is
// InvalidArgument naming key_file, not a refused handshake later).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls, absl::string_view prefix);

// The file's contents if it is readable and holds a PEM block, else InvalidArgument naming
// `field` and the path.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view field);

}  // namespace moe::wire

#endif  // MOE_WIRE_TLS_H_
