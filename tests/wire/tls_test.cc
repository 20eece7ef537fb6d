// wire/tls.h on its own: which options mean plaintext, TLS and mutual TLS, and every bad option
// refused with InvalidArgument naming the field (and the path, for a file).
#include "wire/tls.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

namespace moe::wire {
namespace {

std::string Pem(const std::string& name) { return std::string(MOE_TLS_TESTDATA) + "/" + name; }

void ExpectNamed(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().substr(0, field.size() + 1), field + ":") << st;
}

TEST(TlsCredentialsTest, ServerCredentialsFromFiles) {
  EXPECT_TRUE(MakeServerCredentials({}, "tls_").ok());  // plaintext
  ServerTls tls{Pem("server.pem"), Pem("server-key.pem"), ""};
  EXPECT_TRUE(MakeServerCredentials(tls, "tls_").ok());
  tls.client_ca_file = Pem("ca.pem");
  EXPECT_TRUE(MakeServerCredentials(tls, "tls_").ok());

  ExpectNamed(MakeServerCredentials({Pem("server.pem"), "", ""}, "tls_").status(), "tls_key_file");
  ExpectNamed(MakeServerCredentials({"", Pem("server-key.pem"), ""}, "tls_").status(),
              "tls_cert_file");
  ExpectNamed(MakeServerCredentials({"", "", Pem("ca.pem")}, "tls_").status(),
              "tls_client_ca_file");
  ExpectNamed(
      MakeServerCredentials({Pem("server.pem"), Pem("server-key.pem"), Pem("nope.pem")}, "tls_")
          .status(),
      "tls_client_ca_file");
  // Another certificate's key: gRPC would refuse it only when a port opens.
  absl::Status wrong_key =
      MakeServerCredentials({Pem("server.pem"), Pem("client-key.pem"), ""}, "tls_").status();
  ExpectNamed(wrong_key, "tls_key_file");
  EXPECT_NE(wrong_key.message().find("client-key.pem"), std::string::npos) << wrong_key;
  // A PEM block that is no certificate, as the client CA.
  const std::string garbage = ::testing::TempDir() + "/garbage_ca.pem";
  std::ofstream(garbage) << "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n";
  ExpectNamed(
      MakeServerCredentials({Pem("server.pem"), Pem("server-key.pem"), garbage}, "tls_").status(),
      "tls_client_ca_file");
  tls.reload_seconds = 0;  // read once
  EXPECT_TRUE(MakeServerCredentials(tls, "tls_").ok());
  tls.reload_seconds = -1;
  ExpectNamed(MakeServerCredentials(tls, "tls_").status(), "tls_reload_seconds");
}

TEST(TlsCredentialsTest, ChannelCredentialsFromFiles) {
  EXPECT_FALSE(UsesTls({}));
  EXPECT_TRUE(MakeChannelCredentials({}, "tls.").ok());  // plaintext
  ClientTls tls;
  tls.enabled = true;  // system roots
  EXPECT_TRUE(UsesTls(tls));
  EXPECT_TRUE(MakeChannelCredentials(tls, "tls.").ok());
  tls = {};
  tls.server_name = "localhost";  // any field asks for TLS
  EXPECT_TRUE(UsesTls(tls));
  tls.ca_file = Pem("ca.pem");
  tls.cert_file = Pem("client.pem");
  tls.key_file = Pem("client-key.pem");
  EXPECT_TRUE(MakeChannelCredentials(tls, "tls.").ok());
  tls.key_file.clear();
  ExpectNamed(MakeChannelCredentials(tls, "tls.").status(), "tls.key_file");
  // Another certificate's key, with and without the file watcher: refused here, not at the
  // handshake.
  tls.key_file = Pem("server-key.pem");
  for (int reload_seconds : {300, 0}) {
    tls.reload_seconds = reload_seconds;
    absl::Status wrong_key = MakeChannelCredentials(tls, "tls.").status();
    ExpectNamed(wrong_key, "tls.key_file");
    EXPECT_NE(wrong_key.message().find("server-key.pem"), std::string::npos) << wrong_key;
  }
  tls.key_file = Pem("client-key.pem");
  tls.ca_file = Pem("nope.pem");
  ExpectNamed(MakeChannelCredentials(tls, "tls.").status(), "tls.ca_file");
}

TEST(TlsCredentialsTest, ReadPemFileNamesTheFieldAndThePath) {
  absl::StatusOr<std::string> pem = ReadPemFile(Pem("ca.pem"), "f");
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_NE(pem->find("-----BEGIN CERTIFICATE-----"), std::string::npos);

  absl::Status missing = ReadPemFile(Pem("nope.pem"), "f").status();
  ExpectNamed(missing, "f");
  EXPECT_NE(missing.message().find("nope.pem"), std::string::npos) << missing;

  const std::string not_pem = ::testing::TempDir() + "/not_a_pem.der";
  std::ofstream(not_pem) << "\x30\x82 not base64";
  absl::Status wrong = ReadPemFile(not_pem, "f").status();
  ExpectNamed(wrong, "f");
  EXPECT_NE(wrong.message().find("no PEM block"), std::string::npos) << wrong;
  ExpectNamed(ReadPemFile(::testing::TempDir(), "f").status(), "f");  // a directory
}

}  // namespace
}  // namespace moe::wire
