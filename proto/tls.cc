// PEM files -> gRPC credentials (see tls.h).
#include "proto/tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

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

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTls& tls, absl::string_view prefix) {
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "client_ca_file: needs ", prefix,
                                                     "cert_file and ", prefix, "key_file"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, tls.cert_file.empty() ? "cert_file" : "key_file", ": needed with ",
                     prefix, tls.cert_file.empty() ? "key_file" : "cert_file"));
  }
  absl::StatusOr<std::string> cert = ReadPemFile(tls.cert_file, absl::StrCat(prefix, "cert_file"));
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(tls.key_file, absl::StrCat(prefix, "key_file"));
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadPemFile(tls.client_ca_file, absl::StrCat(prefix, "client_ca_file"));
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

bool UsesTls(const ClientTls& tls) {
  return tls.enabled || !tls.ca_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty() ||
         !tls.server_name.empty();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls, absl::string_view prefix) {
  if (!UsesTls(tls)) return grpc::InsecureChannelCredentials();
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, tls.cert_file.empty() ? "cert_file" : "key_file", ": needed with ",
                     prefix, tls.cert_file.empty() ? "key_file" : "cert_file"));
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
  }
  return grpc::SslCredentials(options);
}

}  // namespace moe::wire
