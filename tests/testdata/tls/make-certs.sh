#!/usr/bin/env bash
# Writes the test PKI the TLS tests use (tests/client/tls_test.cc, tests/wire/tls_test.cc):
#   ca.pem            a test certificate authority
#   server.pem/-key   moe-server's certificate for localhost, 127.0.0.1 and moe-server.moe.svc
#                     (the name deploy/kubernetes/tls's probes check), signed by ca.pem
#   client.pem/-key   a trainer's client certificate, signed by ca.pem
#   other-ca.pem, other-client.pem/-key   a second authority and a client certificate it
#                     signed, which a server trusting only ca.pem must refuse
#   other-server.pem/-key   a server certificate for the same names signed by other-ca.pem
#                     (the renewed certificate of the reload test)
# Keys are EC P-256 and certificates valid for 100 years, so the checked-in files do not expire
# under the tests. For tests only: these private keys are public.
set -euo pipefail
cd "$(dirname "$0")"
days=36500
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
ca() {  # ca NAME CN
  key "$1-key.pem"
  openssl req -x509 -new -key "$1-key.pem" -days $days -subj "/CN=$2" -out "$1.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}
leaf() {  # leaf NAME CA CN EXTENSIONS
  key "$1-key.pem"
  openssl req -new -key "$1-key.pem" -subj "/CN=$3" -out "$1.csr"
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2-key.pem" -CAcreateserial -days $days \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca ca "moe-offload test CA"
ca other-ca "some other CA"
leaf server ca localhost "subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:moe-server.moe.svc
extendedKeyUsage=serverAuth"
leaf client ca "trainer-0" "extendedKeyUsage=clientAuth"
leaf other-client other-ca "trainer-x" "extendedKeyUsage=clientAuth"
leaf other-server other-ca localhost "subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:moe-server.moe.svc
extendedKeyUsage=serverAuth"
rm -f ca-key.pem other-ca-key.pem ./*.srl
