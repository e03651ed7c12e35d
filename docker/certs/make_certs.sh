#!/usr/bin/env bash
# Create a private CA, a SuperLink server certificate and one certificate per
# DDP-SA intermediate server (openssl): TLS between the SuperNodes / the `flwr` CLI and
# the SuperLink, and between the clients / the ServerApp and the DDP-SA servers.
#
# Usage: docker/certs/make_certs.sh [OUT_DIR]
#   OUT_DIR            default: docker/certs/generated (git-ignored)
#   CANCELFL_CERT_SANS extra subjectAltNames for both server certificates,
#                      comma separated, e.g. "DNS:superlink.example.org,IP:10.0.0.5"
#                      (needed when SuperNodes reach the SuperLink by another
#                      name than 127.0.0.1/localhost).
#   CANCELFL_DDPSA_SERVERS  number of DDP-SA intermediate servers (default 3).
#   FORCE=1            overwrite existing files.
# Output: ca.crt (give to SuperNodes and to the flwr CLI as root certificate,
#         and as run-config ddpsa-ca), ca.key (keep private), server.pem +
#         server.key (SuperLink only), intermediate-i.pem + intermediate-i.key
#         (DDP-SA intermediate server i only: each server its own key).
set -euo pipefail

OUT="${1:-$(cd "$(dirname "$0")" && pwd)/generated}"
mkdir -p "$OUT"
SERVERS="${CANCELFL_DDPSA_SERVERS:-3}"
LAST="$OUT/intermediate-$((SERVERS - 1)).pem"
if [[ -s "$OUT/server.pem" && -s "$LAST" && "${FORCE:-0}" != 1 ]]; then
    echo "certificates already in $OUT (FORCE=1 to recreate)"
    exit 0
fi
command -v openssl >/dev/null || { echo "openssl not installed" >&2; exit 1; }

SANS="DNS:localhost,IP:127.0.0.1"
[[ -n "${CANCELFL_CERT_SANS:-}" ]] && SANS="$SANS,$CANCELFL_CERT_SANS"
DAYS="${CANCELFL_CERT_DAYS:-365}"

umask 077
# CA: self-signed, P-256 ECDSA.
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$OUT/ca.key" -out "$OUT/ca.crt" -days "$DAYS" -sha256 \
    -subj "/CN=cancelfl test CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

EXT=$(mktemp)
trap 'rm -f "$EXT"' EXIT
cat >"$EXT" <<EXTEOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$SANS
EXTEOF
# One key + certificate per server, signed by the CA with the SANs above:
# server.* for the SuperLink, intermediate-i.* for DDP-SA intermediate server i.
issue() {
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
        -keyout "$OUT/$1.key" -out "$OUT/$1.csr" -subj "/CN=$2" 2>/dev/null
    openssl x509 -req -in "$OUT/$1.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" \
        -CAcreateserial -out "$OUT/$1.pem" -days "$DAYS" -sha256 \
        -extfile "$EXT" 2>/dev/null
    rm -f "$OUT/$1.csr"
}
issue server cancelfl-superlink
PEMS=("$OUT/server.pem")
for ((i = 0; i < SERVERS; i++)); do
    issue "intermediate-$i" "cancelfl-ddpsa-$i"
    PEMS+=("$OUT/intermediate-$i.pem")
done
rm -f "$OUT/ca.srl"
# Containers read these as root; the CA certificate is public.
chmod 644 "$OUT/ca.crt" "${PEMS[@]}"
openssl verify -CAfile "$OUT/ca.crt" "${PEMS[@]}" >/dev/null
echo "certificates written to $OUT (SANs: $SANS)"
