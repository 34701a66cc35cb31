#!/usr/bin/env bash
# One command for the certificates of a specsplit deployment (mutual TLS between every service):
#
#   deploy/make-certs.sh [OUT_DIR] [--key-mode MODE] [--days N] [--force]
#
# OUT_DIR (default deploy/certs) receives a small CA and, signed by it, one certificate per
# service plus two client certificates, with the common names the configurations expect:
#
#   ca.pem / ca.key                         specsplit-ca      the CA (keep ca.key offline)
#   specsplit-draft.{pem,key}               specsplit-draft   draft server (+ client, for its healthcheck)
#   specsplit-target.{pem,key}              specsplit-target  target server (+ client, for its healthcheck)
#   specsplit-orchestrator.{pem,key}        specsplit-orchestrator
#                                                             orchestrator server, and its client certificate
#                                                             to the workers (an admin CN there)
#   specsplit-admin.{pem,key}               specsplit-admin   operators: admin RPCs on every service
#   specsplit-client.{pem,key}              specsplit-client  applications: Generate / GetStatus
#
# Server certificates carry the names clients dial: the compose service names (draft, target,
# orchestrator), the Kubernetes Service names (specsplit-draft, specsplit-target, specsplit,
# with .<namespace>.svc forms for $SPECSPLIT_K8S_NAMESPACE, default "default"), localhost
# and 127.0.0.1. Keys are written with mode 600 (--key-mode 644 when the containers' user,
# uid 10001, must read a bind mount on a single-user host; or chown the directory to 10001).
#
# Needs only openssl. Refuses to overwrite an existing CA unless --force.
set -euo pipefail

out="deploy/certs"
key_mode="600"
days="825"
force=0
while [ $# -gt 0 ]; do
    case "$1" in
        --key-mode) key_mode="$2"; shift 2 ;;
        --days) days="$2"; shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        -*) echo "make-certs.sh: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
command -v openssl >/dev/null || { echo "make-certs.sh: openssl is not installed" >&2; exit 2; }
if [ -e "$out/ca.pem" ] && [ "$force" -ne 1 ]; then
    echo "make-certs.sh: $out/ca.pem exists; pass --force to replace every certificate" >&2
    exit 2
fi
ns="${SPECSPLIT_K8S_NAMESPACE:-default}"
umask 077
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days "$days" \
    -subj "/CN=specsplit-ca" -keyout "$out/ca.key" -out "$out/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

leaf() {  # leaf NAME "SAN list"
    local name="$1" san="$2"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
        -subj "/CN=$name" -keyout "$out/$name.key" -out "$tmp/$name.csr" 2>/dev/null
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        echo "subjectAltName=$san"
    } > "$tmp/$name.ext"
    openssl x509 -req -in "$tmp/$name.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" -CAcreateserial \
        -CAserial "$tmp/ca.srl" -days "$days" -sha256 -extfile "$tmp/$name.ext" -out "$out/$name.pem" 2>/dev/null
    chmod "$key_mode" "$out/$name.key"
    chmod 644 "$out/$name.pem"
}

local_names="DNS:localhost,IP:127.0.0.1,IP:::1"
leaf specsplit-draft "DNS:draft,DNS:specsplit-draft,DNS:specsplit-draft.$ns.svc,DNS:specsplit-draft.$ns.svc.cluster.local,$local_names"
leaf specsplit-target "DNS:target,DNS:specsplit-target,DNS:specsplit-target.$ns.svc,DNS:specsplit-target.$ns.svc.cluster.local,$local_names"
leaf specsplit-orchestrator "DNS:orchestrator,DNS:specsplit,DNS:specsplit.$ns.svc,DNS:specsplit.$ns.svc.cluster.local,$local_names"
leaf specsplit-admin "DNS:specsplit-admin"
leaf specsplit-client "DNS:specsplit-client"
chmod 644 "$out/ca.pem"
chmod 700 "$out" 2>/dev/null || true
[ "$key_mode" = "600" ] || chmod 755 "$out"
echo "certificates for specsplit written to $out (CA specsplit-ca, valid $days days)"
