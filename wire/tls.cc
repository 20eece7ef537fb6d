// PEM files -> gRPC credentials (see tls.h).
#include "wire/tls.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::wire {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  std::string pem = contents.str();
  // A wrong path that happens to exist (a directory, a DER file) fails here, with the field's
  // name, rather than as an opaque handshake failure on the first call.
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " holds no PEM block"));
  }
  return pem;
}

namespace {

// gRPC checks a certificate and key only when a port is opened with them, and fails that port
// the same way for a key that is not the certificate's as for an address it cannot bind; so the
// files are tried once on a free loopback port, where only the files can be at fault.
bool CanListenWith(const std::shared_ptr<grpc::ServerCredentials>& credentials) {
  grpc::ServerBuilder probe;
  grpc::CallbackGenericService nothing;  // a server must serve something to be built
  probe.RegisterCallbackGenericService(&nothing);
  int port = 0;
  probe.AddListeningPort("127.0.0.1:0", credentials, &port);
  std::unique_ptr<grpc::Server> server = probe.BuildAndStart();
  if (server) server->Shutdown();
  return server != nullptr && port != 0;
}

// What both ends say when only one of a certificate and its key is given.
absl::Status HalfPair(absl::string_view prefix, bool cert_missing) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, cert_missing ? "cert_file" : "key_file",
                                                 ": needed with ", prefix,
                                                 cert_missing ? "key_file" : "cert_file"));
}

// What both ends say when gRPC refuses a certificate with its key.
absl::Status KeyRefused(absl::string_view prefix, const std::string& key_file,
                        const std::string& cert_file) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, "key_file: gRPC refused ", key_file,
                                                 " with ", cert_file,
                                                 " (is it that certificate's key?)"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTls& tls, absl::string_view prefix) {
  if (tls.reload_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "reload_seconds: must be >= 0"));
  }
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "client_ca_file: needs ", prefix,
                                                     "cert_file and ", prefix, "key_file"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return HalfPair(prefix, tls.cert_file.empty());
  }
  absl::StatusOr<std::string> cert = ReadPemFile(tls.cert_file, absl::StrCat(prefix, "cert_file"));
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(tls.key_file, absl::StrCat(prefix, "key_file"));
  if (!key.ok()) return key.status();
  const grpc_ssl_client_certificate_request_type client_certificates =
      tls.client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  grpc::SslServerCredentialsOptions options(client_certificates);
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadPemFile(tls.client_ca_file, absl::StrCat(prefix, "client_ca_file"));
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  std::shared_ptr<grpc::ServerCredentials> once = grpc::SslServerCredentials(options);
  if (!CanListenWith(once)) {
    // Which file: without the client CA, only the pair is left to refuse.
    grpc::SslServerCredentialsOptions pair_only(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    pair_only.pem_key_cert_pairs = options.pem_key_cert_pairs;
    if (!tls.client_ca_file.empty() && CanListenWith(grpc::SslServerCredentials(pair_only))) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "client_ca_file: gRPC refused ", tls.client_ca_file, " as a CA"));
    }
    return KeyRefused(prefix, tls.key_file, tls.cert_file);
  }
  if (tls.reload_seconds == 0) return once;
  // gRPC's file watcher (experimental in gRPC 1.51, the API Debian ships) rereads the files
  // every reload_seconds and keeps the last pair whose key matches its certificate.
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key_file, tls.cert_file, tls.client_ca_file, tls.reload_seconds);
  grpc::experimental::TlsServerCredentialsOptions watched(provider);
  watched.watch_identity_key_cert_pairs();
  if (!tls.client_ca_file.empty()) watched.watch_root_certs();
  watched.set_cert_request_type(client_certificates);
  return grpc::experimental::TlsServerCredentials(watched);
}

bool UsesTls(const ClientTls& tls) {
  return tls.enabled || !tls.ca_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty() ||
         !tls.server_name.empty();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls, absl::string_view prefix) {
  if (!UsesTls(tls)) return grpc::InsecureChannelCredentials();
  if (tls.reload_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "reload_seconds: must be >= 0"));
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return HalfPair(prefix, tls.cert_file.empty());
  }
  grpc::SslCredentialsOptions options;
  if (!tls.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(tls.ca_file, absl::StrCat(prefix, "ca_file"));
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert =
        ReadPemFile(tls.cert_file, absl::StrCat(prefix, "cert_file"));
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(tls.key_file, absl::StrCat(prefix, "key_file"));
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
    // gRPC would otherwise find a key that is not this certificate's only at the handshake,
    // where the server sees an anonymous refused connection and the trainer an UNAVAILABLE
    // that names no file. Listening with the pair once checks it here (the server's check).
    grpc::SslServerCredentialsOptions pair(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    pair.pem_key_cert_pairs.push_back({*key, *cert});
    if (!CanListenWith(grpc::SslServerCredentials(pair))) {
      return KeyRefused(prefix, tls.key_file, tls.cert_file);
    }
  }
  const bool has_files = !tls.ca_file.empty() || !tls.cert_file.empty();
  if (tls.reload_seconds == 0 || !has_files) return grpc::SslCredentials(options);
  // The files were read above only to name a bad one now; from here gRPC's file watcher
  // (experimental in gRPC 1.51, as on the server) rereads them every reload_seconds. Without
  // ca_file the system's roots stay in use, as with SslCredentials.
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider;
  if (tls.cert_file.empty()) {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        tls.ca_file, tls.reload_seconds);
  } else {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        tls.key_file, tls.cert_file, tls.ca_file, tls.reload_seconds);
  }
  grpc::experimental::TlsChannelCredentialsOptions watched;
  watched.set_certificate_provider(provider);
  if (!tls.cert_file.empty()) watched.watch_identity_key_cert_pairs();
  if (!tls.ca_file.empty()) watched.watch_root_certs();
  // The server's certificate must name the target's host (or server_name), as SslCredentials
  // checks it.
  watched.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(watched);
}

}  // namespace moe::wire
