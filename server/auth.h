// Authentication for moe-server: which principal makes a call.
//
// A principal is named by one of two credentials: a bearer token from the tokens file, sent as
// the metadata "authorization: Bearer <token>" on every call, or, on a mutual-TLS port, the
// client certificate's identity (its subject CN, else its first subjectAltName). A token, when
// sent, wins over the certificate, and a token that matches no entry is refused rather than
// ignored. With neither a tokens file nor a client CA, authentication is off and every caller
// is the principal "anonymous".
//
// Checked in one place, but not by grpc::AuthMetadataProcessor: in gRPC 1.51 a processor can
// be set only on secure server credentials (InsecureServerCredentials()->SetAuthMetadataProcessor
// aborts the process), and the plaintext port is both the default and what a pod behind a
// NetworkPolicy serves. So every ExpertService handler asks the service's Authenticator first
// (service.cc, ExpertServiceImpl::Authenticate); gRPC's health and reflection services never
// do, so a Kubernetes probe needs no token. Tokens are compared in constant time: each is
// hashed (SHA-256) once, and a presented token's hash is compared with every entry's in full.
#ifndef MOE_SERVER_AUTH_H_
#define MOE_SERVER_AUTH_H_

#include <grpcpp/grpcpp.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::server {

// Every caller's principal while authentication is off.
inline constexpr char kAnonymousPrincipal[] = "anonymous";
// The metadata key a bearer token travels in (RFC 6750's header, lower-cased as gRPC sends it).
inline constexpr char kAuthorizationMetadataKey[] = "authorization";
// Tokens shorter than this are refused when the file is read: a guessable token is no token.
inline constexpr size_t kMinTokenLength = 16;

struct AuthOptions {
  // One "PRINCIPAL TOKEN" pair per line ('#' starts a comment; ParseTokens). Empty: no tokens.
  std::string tokens_file;
  // The port asks for client certificates (mutual TLS): their identity is a principal.
  bool client_certificates = false;
  // Principals that may do everything on every layer.
  std::vector<std::string> admin_principals;
};

struct TokenEntry {
  std::string principal;
  std::string token;
};

// A tokens file's text, `source` naming it in errors (which never quote a token). Each line
// holds a principal and its token separated by whitespace; blank lines and everything from '#'
// on are ignored. Principals pass ValidatePrincipal and may have several tokens (rotation);
// tokens are 16 to 4096 characters of RFC 6750's token68 alphabet ([A-Za-z0-9-._~+/] then any
// '='), each in at most one line.
absl::StatusOr<std::vector<TokenEntry>> ParseTokens(absl::string_view text,
                                                    absl::string_view source);

// 1 to 256 printable ASCII characters other than space, '"', '#', ',' and '\\' (so a principal
// can be written in the tokens file and in --admin_principals unquoted), not "anonymous"
// (which means authentication is off) and not "." or "..". InvalidArgument naming `field`
// otherwise. Certificate identities must pass it too.
absl::Status ValidatePrincipal(absl::string_view principal, absl::string_view field);

// A valid principal as one path component: every byte outside [A-Za-z0-9._@:+=-] as %XX (so
// "spiffe://a/b" stays one directory and no two principals share one).
std::string PrincipalDirectoryName(absl::string_view principal);

// The identity a verified client certificate gives: its subject CN, else its first
// subjectAltName; empty when the connection carries no certificate.
std::string CertificatePrincipal(const grpc::AuthContext& auth);

class Authenticator {
 public:
  // Reads options.tokens_file; InvalidArgument naming "tokens_file" or "admin_principals".
  static absl::StatusOr<std::shared_ptr<Authenticator>> Create(const AuthOptions& options);

  // A tokens file or client certificates: callers must prove who they are.
  bool enabled() const { return enabled_; }

  // The caller's principal, or Unauthenticated saying what is missing or wrong. Off: always
  // "anonymous".
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The same from the call's parts: the authorization metadata values it carried and the
  // principal of its client certificate ("" for none).
  absl::StatusOr<std::string> Authenticate(const std::vector<absl::string_view>& authorization,
                                           const std::string& certificate_principal) const;

  bool IsAdmin(const std::string& principal) const { return admins_.count(principal) != 0; }

  // Reads the tokens file again (SIGHUP). On any error the tokens in use stay as they are. A
  // no-op without a tokens file.
  absl::Status Reload();
  // The same, only if the file changed since it was last read (another inode, size or
  // modification time: a Kubernetes Secret's update replaces the file). Whether it was read;
  // a changed file that fails to load fails once, not again until it changes.
  absl::StatusOr<bool> ReloadIfChanged();

 private:
  using Digest = std::array<unsigned char, 32>;
  struct Entry {
    std::string principal;
    Digest digest;
  };
  // What identifies one version of the tokens file.
  struct FileStamp {
    uint64_t device = 0, inode = 0;
    int64_t size = -1, mtime_ns = 0;
    bool operator==(const FileStamp& o) const {
      return device == o.device && inode == o.inode && size == o.size && mtime_ns == o.mtime_ns;
    }
  };
  Authenticator() = default;
  std::optional<std::string> Match(absl::string_view token) const;
  FileStamp Stamp() const;  // size -1 when the file cannot be stat'ed

  std::string tokens_file_;
  bool client_certificates_ = false;
  bool enabled_ = false;
  std::set<std::string> admins_;
  mutable std::mutex mu_;
  std::shared_ptr<const std::vector<Entry>> tokens_;  // replaced whole by Reload
  // One reload at a time; guards loaded_, the version of the file last read (or tried).
  std::mutex reload_mu_;
  FileStamp loaded_;
};

// Allocates the server's callback contexts with a link back to the Authenticator, so that
// CallerPrincipal can answer from a context alone (server.cc installs it on the builder).
class AuthContextAllocator final : public grpc::ContextAllocator {
 public:
  explicit AuthContextAllocator(std::shared_ptr<const Authenticator> auth)
      : auth_(std::move(auth)) {}
  grpc::CallbackServerContext* NewCallbackServerContext() override;
  void Release(grpc::CallbackServerContext* ctx) override;
  const Authenticator& authenticator() const { return *auth_; }

 private:
  std::shared_ptr<const Authenticator> auth_;
};

// The principal making the call: "anonymous" when authentication is off, "" when the call did
// not authenticate (every ExpertService handler has refused it by then) or its context was not
// allocated by an AuthContextAllocator. Computed anew each time (a token hash and compare, no
// lock held long). With client certificates, gRPC builds a context's AuthContext on first use
// without a lock: the handler's own Authenticate, first thing on gRPC's thread, builds it, so
// later calls from other threads only read it.
std::string CallerPrincipal(const grpc::CallbackServerContext* ctx);

}  // namespace moe::server

#endif  // MOE_SERVER_AUTH_H_
