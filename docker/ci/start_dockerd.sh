#!/usr/bin/env bash
# Start a private Docker engine for tests/CI, touching nothing of the host's
# network: no bridge, no iptables, no IP forwarding or masquerading. Every
# container must therefore use `network_mode: host` and 127.0.0.1.
#
# Usage: eval "$(docker/ci/start_dockerd.sh [STATE_DIR])"
# Prints shell assignments (DOCKER_HOST, DOCKERD_PID, DOCKERD_DIR,
# DOCKER_CONFIG) and also writes them to STATE_DIR/env. Stop the engine with
# docker/ci/stop_dockerd.sh STATE_DIR (kills exactly DOCKERD_PID).
#   DOCKERD_DATA_ROOT  images/containers/build cache (default STATE_DIR/data,
#                      deleted on stop); point it at a lasting folder to keep
#                      images and build cache between runs (one engine at a time!).
# Needs root, dockerd/containerd/runc (apt: docker.io) and overlayfs.
set -euo pipefail

DIR="${1:-$(mktemp -d "${TMPDIR:-/tmp}/cfl-dockerd.XXXXXX")}"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
# unix socket paths are limited to 108 bytes (containerd's live under exec-root)
if (( ${#DIR} > 60 )); then echo "state dir path too long: $DIR" >&2; exit 1; fi
[[ $(id -u) == 0 ]] || { echo "dockerd needs root" >&2; exit 1; }
command -v dockerd >/dev/null || { echo "dockerd not installed (apt-get install docker.io)" >&2; exit 1; }

SOCK="$DIR/docker.sock"
DATA_ROOT="${DOCKERD_DATA_ROOT:-$DIR/data}"
mkdir -p "$DATA_ROOT"
echo "$DATA_ROOT" >"$DIR/data-root"
dockerd \
    --bridge=none --iptables=false --ip6tables=false \
    --ip-masq=false --ip-forward=false \
    --storage-driver overlay2 \
    --data-root "$DATA_ROOT" --exec-root "$DIR/exec" \
    --pidfile "$DIR/dockerd.pid" -H "unix://$SOCK" \
    >"$DIR/dockerd.log" 2>&1 &
PID=$!

# A private CLI config folder: no credential helpers of the host, and the
# place where the compose plugin is linked (docker/ci/install_engine.sh).
export DOCKER_CONFIG="${DOCKER_CONFIG:-$DIR/docker-config}"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
[[ -f "$DOCKER_CONFIG/config.json" ]] || echo '{}' >"$DOCKER_CONFIG/config.json"
COMPOSE_BIN="${CANCELFL_COMPOSE_BIN:-${CANCELFL_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cancelfl-docker}/tools/compose/docker-compose}"
if [[ -x "$COMPOSE_BIN" && ! -e "$DOCKER_CONFIG/cli-plugins/docker-compose" ]]; then
    ln -s "$COMPOSE_BIN" "$DOCKER_CONFIG/cli-plugins/docker-compose"
fi

for _ in $(seq 1 120); do
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "dockerd exited early; log:" >&2; tail -20 "$DIR/dockerd.log" >&2; exit 1
    fi
    if DOCKER_HOST="unix://$SOCK" docker version >/dev/null 2>&1; then
        {
            echo "export DOCKER_HOST=unix://$SOCK"
            echo "export DOCKERD_PID=$PID"
            echo "export DOCKERD_DIR=$DIR"
            echo "export DOCKER_CONFIG=$DOCKER_CONFIG"
        } | tee "$DIR/env"
        exit 0
    fi
    sleep 0.5
done
echo "dockerd did not answer within 60 s; log:" >&2
tail -20 "$DIR/dockerd.log" >&2
kill "$PID" 2>/dev/null || true
exit 1
