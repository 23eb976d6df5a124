#!/usr/bin/env bash
# Makes a development CA, a member certificate for the ragcluster processes, and a bootstrap
# admin API key, for TLS/mTLS on one machine, in Docker compose or in a test cluster.
#
#   scripts/dev-certs.sh OUT_DIR [DNS_NAME ...]
#
# OUT_DIR/ca.pem, ca.key      the cluster CA (kept: a rerun issues new certificates from it)
# OUT_DIR/NAME.pem, NAME.key  a certificate for serverAuth + clientAuth, valid for localhost,
#                             127.0.0.1, ::1 and every DNS_NAME given (NAME: $CERT_NAME,
#                             default "member"); every process may share it
# OUT_DIR/admin.key           a random bootstrap admin key (coordinator.auth.admin_key_file)
#
# Rotation: rerun the script; running processes reload changed files within
# tls.reload_interval. Production clusters should use their own PKI (e.g. cert-manager).
set -euo pipefail
out=${1:?usage: scripts/dev-certs.sh OUT_DIR [DNS_NAME ...]}
shift
name=${CERT_NAME:-member}
days=${CERT_DAYS:-825}
mkdir -p "$out"
cd "$out"
umask 077
if [ ! -f ca.pem ] || [ ! -f ca.key ]; then
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ca.key 2>/dev/null
  openssl req -x509 -new -key ca.key -sha256 -days 3650 \
    -subj "/CN=ragcluster development CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem
fi
san="DNS:localhost,IP:127.0.0.1,IP:0:0:0:0:0:0:0:1"
for n in "$@"; do san="$san,DNS:$n"; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tmp/key.pem" 2>/dev/null
openssl req -new -key "$tmp/key.pem" -subj "/CN=ragcluster $name" -out "$tmp/req.csr"
cat > "$tmp/ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san
EXT
openssl x509 -req -in "$tmp/req.csr" -CA ca.pem -CAkey ca.key -CAcreateserial \
  -days "$days" -sha256 -extfile "$tmp/ext" -out "$tmp/cert.pem" 2>/dev/null
# Replace atomically, key first: a reload never pairs a new certificate with an old key for
# long (and a failed pairing keeps the previous set).
mv "$tmp/key.pem" "$name.key"
mv "$tmp/cert.pem" "$name.pem"
if [ ! -f admin.key ]; then
  openssl rand -hex 32 > admin.key
fi
chmod 644 ca.pem "$name.pem"
echo "CA: $out/ca.pem  certificate: $out/$name.pem ($san)  admin key: $out/admin.key"
