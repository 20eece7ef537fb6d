// server/auth: the tokens file's grammar, principal names, and which principal a call's
// authorization metadata and client certificate give (the Authenticator without a server).
#include "server/auth.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::server {
namespace {

constexpr char kAliceToken[] = "alice-token-0123456789abcdef";
constexpr char kBobToken[] = "bob-token-0123456789abcdefgh";

std::string WriteFile(const std::string& name, const std::string& text) {
  static int counter = 0;
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/moe_auth_", name, "_", ::getpid(), "_", counter++);
  std::ofstream(path) << text;
  return path;
}

std::shared_ptr<Authenticator> Make(const std::string& tokens_text, bool certificates = false,
                                    std::vector<std::string> admins = {}) {
  AuthOptions o;
  if (!tokens_text.empty()) o.tokens_file = WriteFile("tokens", tokens_text);
  o.client_certificates = certificates;
  o.admin_principals = std::move(admins);
  auto auth = Authenticator::Create(o);
  EXPECT_TRUE(auth.ok()) << auth.status();
  return auth.ok() ? *auth : nullptr;
}

std::string Bearer(const std::string& token) { return absl::StrCat("Bearer ", token); }

TEST(ParseTokensTest, ReadsPairsCommentsAndBlankLines) {
  auto parsed = ParseTokens(
      absl::StrCat("# who may call\n\n  alice   ", kAliceToken, "  # trailing comment\n\tbob\t",
                   kBobToken, "\r\nalice ", kBobToken, "x\n"),
      "t");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 3u);
  EXPECT_EQ((*parsed)[0].principal, "alice");
  EXPECT_EQ((*parsed)[0].token, kAliceToken);
  EXPECT_EQ((*parsed)[1].principal, "bob");
  EXPECT_EQ((*parsed)[1].token, kBobToken);
  EXPECT_EQ((*parsed)[2].principal, "alice");  // a second token of one principal (rotation)
}

TEST(ParseTokensTest, EmptyFileHasNoTokens) {
  auto parsed = ParseTokens("# nobody yet\n\n", "t");
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->empty());
}

TEST(ParseTokensTest, RefusesBadLinesNamingTheLineButNeverTheToken) {
  struct Case {
    std::string text;
    std::string want;  // in the message
  };
  const std::vector<Case> cases = {
      {absl::StrCat("alice\n"), "t:1: expected \"PRINCIPAL TOKEN\", found 1 fields"},
      {absl::StrCat("\nalice ", kAliceToken, " extra\n"), "t:2: expected"},
      {"alice short\n", "t:1: the token of \"alice\" must be 16 to 4096 characters"},
      {absl::StrCat("alice ", std::string(4097, 'a'), "\n"), "must be 16 to 4096"},
      {"alice abcdefghijklmnop=q\n", "may hold only A-Z a-z 0-9"},
      {"alice abcdefghijklmnop\"q\n", "may hold only A-Z a-z 0-9"},
      {absl::StrCat("anonymous ", kAliceToken, "\n"), "\"anonymous\" is reserved"},
      {absl::StrCat(".. ", kAliceToken, "\n"), "\"..\" is reserved"},
      {absl::StrCat("a,b ", kAliceToken, "\n"), "principal \"a,b\" may hold only"},
      {absl::StrCat("a\\b ", kAliceToken, "\n"), "may hold only"},
      {absl::StrCat(std::string(257, 'p'), " ", kAliceToken, "\n"), "1 to 256 characters"},
      {absl::StrCat("alice ", kAliceToken, "\nbob ", kAliceToken, "\n"),
       "t:2: the token of \"bob\" is already on an earlier line"},
  };
  for (const Case& c : cases) {
    auto parsed = ParseTokens(c.text, "t");
    ASSERT_FALSE(parsed.ok()) << c.text;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(parsed.status().message().find(c.want), std::string::npos)
        << c.text << " -> " << parsed.status();
    EXPECT_EQ(parsed.status().message().find(kAliceToken), std::string::npos) << parsed.status();
  }
}

TEST(PrincipalTest, ValidNamesAndDirectoryNames) {
  for (const char* p :
       {"alice", "trainer-0", "svc@corp.example", "spiffe://c/ns/moe/sa/t", "a+b=c", "A.b_C-9:x"}) {
    EXPECT_TRUE(ValidatePrincipal(p, "f").ok()) << p;
  }
  EXPECT_EQ(PrincipalDirectoryName("alice"), "alice");
  EXPECT_EQ(PrincipalDirectoryName("spiffe://c/x"), "spiffe:%2F%2Fc%2Fx");
  EXPECT_EQ(PrincipalDirectoryName("a%2Fb"), "a%252Fb");  // no two principals share a name
  EXPECT_EQ(PrincipalDirectoryName("x$y"), "x%24y");
}

// The properties a TLS handshake leaves in a call's AuthContext, without the handshake.
class FakeAuthContext final : public grpc::AuthContext {
 public:
  explicit FakeAuthContext(std::multimap<std::string, std::string> properties)
      : properties_(std::move(properties)) {}
  bool IsPeerAuthenticated() const override { return !properties_.empty(); }
  std::vector<grpc::string_ref> GetPeerIdentity() const override { return {}; }
  std::string GetPeerIdentityPropertyName() const override { return ""; }
  std::vector<grpc::string_ref> FindPropertyValues(const std::string& name) const override {
    std::vector<grpc::string_ref> out;
    for (auto [it, end] = properties_.equal_range(name); it != end; ++it) {
      out.emplace_back(it->second);
    }
    return out;
  }
  grpc::AuthPropertyIterator begin() const override { return NoProperties(); }
  grpc::AuthPropertyIterator end() const override { return NoProperties(); }
  void AddProperty(const std::string&, const grpc::string_ref&) override {}
  bool SetPeerIdentityPropertyName(const std::string&) override { return false; }

 private:
  struct NoProperties : grpc::AuthPropertyIterator {};
  std::multimap<std::string, std::string> properties_;
};

TEST(PrincipalTest, CertificatePrincipalIsTheCommonNameElseTheFirstSubjectAltName) {
  using Props = std::multimap<std::string, std::string>;
  const char* cn = GRPC_X509_CN_PROPERTY_NAME;
  const char* san = GRPC_X509_SAN_PROPERTY_NAME;
  EXPECT_EQ(CertificatePrincipal(FakeAuthContext(Props{{cn, "trainer-0"}, {san, "a.example"}})),
            "trainer-0");
  EXPECT_EQ(CertificatePrincipal(FakeAuthContext(
                Props{{san, "spiffe://c/ns/moe/sa/trainer"}, {san, "trainer.example"}})),
            "spiffe://c/ns/moe/sa/trainer");
  EXPECT_EQ(CertificatePrincipal(FakeAuthContext(Props{{"transport_security_type", "ssl"}})), "");
  EXPECT_EQ(CertificatePrincipal(FakeAuthContext(Props{})), "");
}

TEST(PrincipalTest, CreateRefusesBadAdminsAndAdminsWithoutAuthentication) {
  AuthOptions o;
  o.admin_principals = {"root"};
  auto off = Authenticator::Create(o);
  ASSERT_FALSE(off.ok());
  EXPECT_NE(off.status().message().find("admin_principals: needs tokens_file"), std::string::npos);
  o.tokens_file = WriteFile("tokens", absl::StrCat("alice ", kAliceToken, "\n"));
  o.admin_principals = {"root", "has space"};
  auto bad = Authenticator::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("admin_principals: principal \"has space\""),
            std::string::npos);
}

TEST(PrincipalTest, CreateNamesAnUnreadableOrBadTokensFile) {
  AuthOptions o;
  o.tokens_file = "/nonexistent/tokens";
  auto missing = Authenticator::Create(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("tokens_file: cannot read /nonexistent/tokens"),
            std::string::npos);
  o.tokens_file = WriteFile("bad", "alice short\n");
  auto bad = Authenticator::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(absl::StrCat("tokens_file: ", o.tokens_file, ":1:")),
            std::string::npos)
      << bad.status();
}

TEST(AuthenticatorTest, OffMakesEveryCallerAnonymous) {
  auto auth = Make("");
  ASSERT_NE(auth, nullptr);
  EXPECT_FALSE(auth->enabled());
  EXPECT_EQ(*auth->Authenticate({}, ""), kAnonymousPrincipal);
  const std::string junk = Bearer("whatever");
  EXPECT_EQ(*auth->Authenticate({junk}, "trainer-0"), kAnonymousPrincipal);
}

TEST(AuthenticatorTest, BearerTokensNameTheirPrincipal) {
  auto auth = Make(absl::StrCat("alice ", kAliceToken, "\nbob ", kBobToken, "\n"), false, {"bob"});
  ASSERT_NE(auth, nullptr);
  EXPECT_TRUE(auth->enabled());
  const std::string a = Bearer(kAliceToken), b = Bearer(kBobToken);
  EXPECT_EQ(*auth->Authenticate({a}, ""), "alice");
  EXPECT_EQ(*auth->Authenticate({b}, ""), "bob");
  // RFC 6750: the scheme is case-insensitive.
  const std::string lower = absl::StrCat("bearer ", kAliceToken);
  EXPECT_EQ(*auth->Authenticate({lower}, ""), "alice");
  EXPECT_FALSE(auth->IsAdmin("alice"));
  EXPECT_TRUE(auth->IsAdmin("bob"));
}

TEST(AuthenticatorTest, MissingWrongOrMalformedCredentialsAreUnauthenticated) {
  auto auth = Make(absl::StrCat("alice ", kAliceToken, "\n"));
  ASSERT_NE(auth, nullptr);
  const std::string almost = Bearer(std::string(kAliceToken).substr(0, 27) + "X");
  const std::string prefix = Bearer(std::string(kAliceToken).substr(0, 20));
  const std::string longer = Bearer(absl::StrCat(kAliceToken, "0"));
  const std::string basic = absl::StrCat("Basic ", kAliceToken);
  const std::string bare = kAliceToken;
  const std::string empty = "Bearer ";
  struct Case {
    std::vector<absl::string_view> md;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{}, "authorization: missing"},
      {{almost}, "the bearer token is not valid"},
      {{prefix}, "the bearer token is not valid"},
      {{longer}, "the bearer token is not valid"},
      {{basic}, "expected \"Bearer <token>\""},
      {{bare}, "expected \"Bearer <token>\""},
      {{empty}, "expected \"Bearer <token>\""},
      {{Bearer(kAliceToken), Bearer(kAliceToken)}, "more than one"},
  };
  for (const Case& c : cases) {
    auto p = auth->Authenticate(c.md, "");
    ASSERT_FALSE(p.ok()) << c.want;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_NE(p.status().message().find(c.want), std::string::npos) << p.status();
  }
  // A certificate does not stand in for a token on a server without client certificates.
  EXPECT_FALSE(auth->Authenticate({}, "trainer-0").ok());
}

TEST(AuthenticatorTest, ClientCertificatesNameTheirPrincipalAndTokensWin) {
  auto certs_only = Make("", true);
  ASSERT_NE(certs_only, nullptr);
  EXPECT_TRUE(certs_only->enabled());
  EXPECT_EQ(*certs_only->Authenticate({}, "trainer-0"), "trainer-0");
  auto none = certs_only->Authenticate({}, "");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated);
  // A token on a server that accepts none is refused, not ignored in favour of the certificate.
  const std::string a = Bearer(kAliceToken);
  auto token = certs_only->Authenticate({a}, "trainer-0");
  EXPECT_EQ(token.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(token.status().message().find("accepts no bearer tokens"), std::string::npos);
  // An identity that cannot be a principal is refused.
  auto spaced = certs_only->Authenticate({}, "moe-offload test CA");
  EXPECT_EQ(spaced.status().code(), absl::StatusCode::kUnauthenticated);

  auto both = Make(absl::StrCat("alice ", kAliceToken, "\n"), true);
  ASSERT_NE(both, nullptr);
  EXPECT_EQ(*both->Authenticate({a}, "trainer-0"), "alice");
  EXPECT_EQ(*both->Authenticate({}, "trainer-0"), "trainer-0");
  const std::string wrong = Bearer(kBobToken);
  EXPECT_EQ(both->Authenticate({wrong}, "trainer-0").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthenticatorTest, ReloadReplacesTokensAndKeepsThemOnAnError) {
  const std::string path = WriteFile("reload", absl::StrCat("alice ", kAliceToken, "\n"));
  AuthOptions o;
  o.tokens_file = path;
  auto auth = Authenticator::Create(o);
  ASSERT_TRUE(auth.ok());
  const std::string a = Bearer(kAliceToken), b = Bearer(kBobToken);
  EXPECT_TRUE((*auth)->Authenticate({a}, "").ok());
  EXPECT_FALSE((*auth)->Authenticate({b}, "").ok());

  std::ofstream(path) << "bob " << kBobToken << "\n";
  ASSERT_TRUE((*auth)->Reload().ok());
  EXPECT_FALSE((*auth)->Authenticate({a}, "").ok());
  EXPECT_EQ(*(*auth)->Authenticate({b}, ""), "bob");

  // Unchanged: not read again. Changed: read again, once.
  EXPECT_FALSE(*(*auth)->ReloadIfChanged());
  std::ofstream(path) << "carolyn " << kAliceToken << "\n";  // another size: a new version
  EXPECT_TRUE(*(*auth)->ReloadIfChanged());
  EXPECT_EQ(*(*auth)->Authenticate({a}, ""), "carolyn");
  EXPECT_FALSE(*(*auth)->ReloadIfChanged());
  std::ofstream(path) << "bob " << kBobToken << "\n";
  ASSERT_TRUE(*(*auth)->ReloadIfChanged());

  std::ofstream(path) << "bob short\n";
  EXPECT_FALSE((*auth)->ReloadIfChanged().ok());  // the broken version fails once
  EXPECT_FALSE(*(*auth)->ReloadIfChanged());
  EXPECT_FALSE((*auth)->Reload().ok());
  EXPECT_EQ(*(*auth)->Authenticate({b}, ""), "bob");  // the tokens in use stay
  ::unlink(path.c_str());
  EXPECT_FALSE((*auth)->Reload().ok());
  EXPECT_EQ(*(*auth)->Authenticate({b}, ""), "bob");
}

}  // namespace
}  // namespace moe::server
