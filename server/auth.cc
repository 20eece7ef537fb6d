// Tokens file, principals and the per-call check (see auth.h).
#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace moe::server {
namespace {

constexpr size_t kMaxTokenLength = 4096;
constexpr size_t kMaxPrincipalLength = 256;
constexpr char kBearer[] = "bearer";

bool Token68Char(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' ||
         c == '~' || c == '+' || c == '/';
}

// RFC 6750's b64token: token68 characters, then only '='.
bool IsToken68(absl::string_view t) {
  size_t i = 0;
  while (i < t.size() && Token68Char(t[i])) ++i;
  if (i == 0) return false;
  while (i < t.size() && t[i] == '=') ++i;
  return i == t.size();
}

std::array<unsigned char, 32> Sha256(absl::string_view bytes) {
  std::array<unsigned char, 32> out{};
  unsigned int n = 0;
  // EVP_Digest fails only without memory; an all-zero digest then matches no entry, since
  // entries are hashed the same way and a failed entry hash is refused at load.
  if (EVP_Digest(bytes.data(), bytes.size(), out.data(), &n, EVP_sha256(), nullptr) != 1 ||
      n != out.size()) {
    out.fill(0);
  }
  return out;
}

absl::StatusOr<std::string> ReadTokensFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens_file: cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("tokens_file: cannot read ", path));
  }
  return text.str();
}

}  // namespace

absl::Status ValidatePrincipal(absl::string_view principal, absl::string_view field) {
  if (principal.empty() || principal.size() > kMaxPrincipalLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": a principal is 1 to ", kMaxPrincipalLength, " characters"));
  }
  for (char c : principal) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f || c == '"' || c == '#' || c == ',' || c == '\\') {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": principal \"", absl::CHexEscape(principal),
          "\" may hold only printable ASCII other than space, '\"', '#', ',' and '\\'"));
    }
  }
  if (principal == kAnonymousPrincipal || principal == "." || principal == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", principal, "\" is reserved and cannot name a principal"));
  }
  return absl::OkStatus();
}

std::string PrincipalDirectoryName(absl::string_view principal) {
  std::string out;
  for (char c : principal) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (absl::ascii_isalnum(u) || c == '.' || c == '_' || c == '@' || c == ':' || c == '+' ||
        c == '=' || c == '-') {
      out.push_back(c);
    } else {
      static constexpr char kHex[] = "0123456789ABCDEF";
      out.push_back('%');
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 15]);
    }
  }
  return out;
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokens(absl::string_view text,
                                                    absl::string_view source) {
  std::vector<TokenEntry> out;
  std::set<std::string> seen;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const std::string where = absl::StrCat(source, ":", line_no);
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r\f\v"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected \"PRINCIPAL TOKEN\", found ", fields.size(), " fields"));
    }
    MOE_RETURN_IF_ERROR(ValidatePrincipal(fields[0], where));
    const absl::string_view token = fields[1];
    if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token of \"", fields[0],
                                                     "\" must be ", kMinTokenLength, " to ",
                                                     kMaxTokenLength, " characters"));
    }
    if (!IsToken68(token)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token of \"", fields[0],
                       "\" may hold only A-Z a-z 0-9 - . _ ~ + / followed by any '='"));
    }
    if (!seen.insert(std::string(token)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token of \"", fields[0],
                       "\" is already on an earlier line (a token names one principal)"));
    }
    out.push_back({std::string(fields[0]), std::string(token)});
  }
  return out;
}

std::string CertificatePrincipal(const grpc::AuthContext& auth) {
  for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
    std::vector<grpc::string_ref> values = auth.FindPropertyValues(property);
    if (!values.empty()) return std::string(values.front().data(), values.front().size());
  }
  return "";
}

absl::StatusOr<std::shared_ptr<Authenticator>> Authenticator::Create(const AuthOptions& options) {
  std::shared_ptr<Authenticator> auth(new Authenticator());
  auth->tokens_file_ = options.tokens_file;
  auth->client_certificates_ = options.client_certificates;
  auth->enabled_ = !options.tokens_file.empty() || options.client_certificates;
  for (const std::string& p : options.admin_principals) {
    MOE_RETURN_IF_ERROR(ValidatePrincipal(p, "admin_principals"));
    auth->admins_.insert(p);
  }
  if (!auth->admins_.empty() && !auth->enabled_) {
    return absl::InvalidArgumentError(
        "admin_principals: needs tokens_file or tls_client_ca_file (without authentication "
        "every caller is \"anonymous\" and nobody is an admin)");
  }
  auth->tokens_ = std::make_shared<const std::vector<Entry>>();
  if (!auth->tokens_file_.empty()) {
    MOE_RETURN_IF_ERROR(auth->Reload());
  }
  return auth;
}

Authenticator::FileStamp Authenticator::Stamp() const {
  FileStamp stamp;
  struct stat st;
  if (::stat(tokens_file_.c_str(), &st) != 0) return stamp;
  stamp.device = st.st_dev;
  stamp.inode = st.st_ino;
  stamp.size = st.st_size;
  stamp.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  return stamp;
}

absl::StatusOr<bool> Authenticator::ReloadIfChanged() {
  if (tokens_file_.empty()) return false;
  {
    std::lock_guard<std::mutex> lock(reload_mu_);
    if (Stamp() == loaded_) return false;
  }
  MOE_RETURN_IF_ERROR(Reload());
  return true;
}

absl::Status Authenticator::Reload() {
  if (tokens_file_.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> reload_lock(reload_mu_);
  loaded_ = Stamp();
  MOE_ASSIGN_OR_RETURN(const std::string text, ReadTokensFile(tokens_file_));
  MOE_ASSIGN_OR_RETURN(const std::vector<TokenEntry> parsed,
                       ParseTokens(text, absl::StrCat("tokens_file: ", tokens_file_)));
  auto entries = std::make_shared<std::vector<Entry>>();
  for (const TokenEntry& t : parsed) {
    Entry e{t.principal, Sha256(t.token)};
    if (e.digest == Digest{}) return absl::InternalError("tokens_file: SHA-256 failed");
    entries->push_back(std::move(e));
  }
  std::lock_guard<std::mutex> lock(mu_);
  tokens_ = std::move(entries);
  return absl::OkStatus();
}

std::optional<std::string> Authenticator::Match(absl::string_view token) const {
  std::shared_ptr<const std::vector<Entry>> tokens;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tokens = tokens_;
  }
  const Digest presented = Sha256(token);
  // Every entry is compared in full, whether or not an earlier one matched, so the time taken
  // says nothing about which entry or how many bytes of one matched.
  const std::string* found = nullptr;
  for (const Entry& e : *tokens) {
    const bool same = CRYPTO_memcmp(presented.data(), e.digest.data(), presented.size()) == 0;
    if (same && found == nullptr) found = &e.principal;
  }
  if (found == nullptr || presented == Digest{}) return std::nullopt;
  return *found;
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    const std::vector<absl::string_view>& authorization,
    const std::string& certificate_principal) const {
  if (!enabled_) return std::string(kAnonymousPrincipal);
  if (authorization.size() > 1) {
    return absl::UnauthenticatedError(
        "authorization: the call carries more than one authorization metadata value");
  }
  if (authorization.size() == 1) {
    if (tokens_file_.empty()) {
      return absl::UnauthenticatedError(
          "authorization: this server accepts no bearer tokens (it was started without "
          "--tokens_file); authenticate with a client certificate");
    }
    absl::string_view value = absl::StripAsciiWhitespace(authorization[0]);
    const size_t space = value.find(' ');
    if (space == absl::string_view::npos ||
        !absl::EqualsIgnoreCase(value.substr(0, space), kBearer)) {
      return absl::UnauthenticatedError(
          "authorization: expected \"Bearer <token>\" (another scheme, or no token)");
    }
    const absl::string_view token = absl::StripLeadingAsciiWhitespace(value.substr(space + 1));
    std::optional<std::string> principal = Match(token);
    if (!principal) {
      return absl::UnauthenticatedError("authorization: the bearer token is not valid");
    }
    return *principal;
  }
  if (client_certificates_ && !certificate_principal.empty()) {
    if (absl::Status st = ValidatePrincipal(certificate_principal, "client certificate");
        !st.ok()) {
      return absl::UnauthenticatedError(st.message());
    }
    return certificate_principal;
  }
  return absl::UnauthenticatedError(
      tokens_file_.empty()
          ? "the call carries no client certificate identity"
          : "authorization: missing; send the metadata \"authorization: Bearer <token>\"");
}

absl::StatusOr<std::string> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (!enabled_) return std::string(kAnonymousPrincipal);
  std::vector<absl::string_view> authorization;
  const auto& md = ctx.client_metadata();
  for (auto [it, end] = md.equal_range(kAuthorizationMetadataKey); it != end; ++it) {
    authorization.emplace_back(it->second.data(), it->second.size());
  }
  std::string certificate;
  if (client_certificates_) {
    std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated()) certificate = CertificatePrincipal(*auth);
  }
  return Authenticate(authorization, certificate);
}

grpc::CallbackServerContext* AuthContextAllocator::NewCallbackServerContext() {
  return new grpc::CallbackServerContext();
}

void AuthContextAllocator::Release(grpc::CallbackServerContext* ctx) { delete ctx; }

std::string CallerPrincipal(const grpc::CallbackServerContext* ctx) {
  const auto* allocator = dynamic_cast<const AuthContextAllocator*>(ctx->context_allocator());
  if (allocator == nullptr) return "";
  absl::StatusOr<std::string> principal = allocator->authenticator().Authenticate(*ctx);
  return principal.ok() ? *principal : "";
}

}  // namespace moe::server
