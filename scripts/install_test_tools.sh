#!/usr/bin/env bash
# Install the tools the deployment tests need that pip cannot bring:
# Debian's docker-compose (v1), used to validate deploy/docker-compose.yml.
# Idempotent: does nothing when docker-compose is already on PATH; installs only as root.
set -euo pipefail

if command -v docker-compose >/dev/null 2>&1; then
    echo "docker-compose present: $(docker-compose version --short 2>/dev/null || echo unknown)"
    exit 0
fi
if [ "${EUID:-$(id -u)}" -ne 0 ]; then
    echo "docker-compose missing and not running as root: install it with" >&2
    echo "  apt-get update && apt-get install -y --no-install-recommends docker-compose" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "docker-compose missing and apt-get not found (not a Debian-family system)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends docker-compose
echo "docker-compose installed: $(docker-compose version --short)"
