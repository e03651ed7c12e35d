#!/usr/bin/env bash
# Create a private CA and a SuperLink server certificate (openssl) for TLS
# between the SuperNodes / the `flwr` CLI and the SuperLink.
#
# Usage: docker/certs/make_certs.sh [OUT_DIR]
#   OUT_DIR            default: docker/certs/generated (git-ignored)
#   CANCELFL_CERT_SANS extra subjectAltNames for the SuperLink certificate,
#                      comma separated, e.g. "DNS:superlink.example.org,IP:10.0.0.5"
#                      (needed when SuperNodes reach the SuperLink by another
#                      name than 127.0.0.1/localhost).
#   FORCE=1            overwrite existing files.
# Output: ca.crt (give to SuperNodes and to the flwr CLI as root certificate),
#         ca.key (keep private), server.pem + server.key (SuperLink only).
set -euo pipefail

OUT="${1:-$(cd "$(dirname "$0")" && pwd)/generated}"
mkdir -p "$OUT"
if [[ -s "$OUT/server.pem" && "${FORCE:-0}" != 1 ]]; then
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

# SuperLink server key + CSR, signed by the CA with the SANs above.
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$OUT/server.key" -out "$OUT/server.csr" \
    -subj "/CN=cancelfl-superlink" 2>/dev/null
EXT=$(mktemp)
trap 'rm -f "$EXT"' EXIT
cat >"$EXT" <<EXTEOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$SANS
EXTEOF
openssl x509 -req -in "$OUT/server.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" \
    -CAcreateserial -out "$OUT/server.pem" -days "$DAYS" -sha256 \
    -extfile "$EXT" 2>/dev/null
rm -f "$OUT/server.csr" "$OUT/ca.srl"
# Containers read these as root; the CA certificate is public.
chmod 644 "$OUT/ca.crt" "$OUT/server.pem"
openssl verify -CAfile "$OUT/ca.crt" "$OUT/server.pem" >/dev/null
echo "certificates written to $OUT (SANs: $SANS)"
