#!/usr/bin/env bash
# Stop the engine started by start_dockerd.sh (by its PID, nothing else) and
# delete its state folder (with the images, containers and volumes of that
# engine, unless they live in a DOCKERD_DATA_ROOT outside it).
# Usage: docker/ci/stop_dockerd.sh STATE_DIR [--keep]
set -euo pipefail

DIR="${1:?usage: stop_dockerd.sh STATE_DIR [--keep]}"
PIDFILE="$DIR/dockerd.pid"
if [[ -s "$PIDFILE" ]]; then
    PID=$(cat "$PIDFILE")
    if kill -0 "$PID" 2>/dev/null; then
        # Remove what is still running so that dockerd can exit quickly.
        if [[ -S "$DIR/docker.sock" ]]; then
            ids=$(DOCKER_HOST="unix://$DIR/docker.sock" docker ps -q 2>/dev/null || true)
            if [[ -n "$ids" ]]; then
                # shellcheck disable=SC2086
                DOCKER_HOST="unix://$DIR/docker.sock" docker rm -f $ids >/dev/null 2>&1 || true
            fi
        fi
        kill -TERM "$PID"
        for _ in $(seq 1 60); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$PID" 2>/dev/null; then
            echo "dockerd $PID still alive after 30 s; sending SIGKILL" >&2
            kill -KILL "$PID" || true
        fi
    fi
fi
# Overlay mounts are gone once dockerd has exited; unmount leftovers (after a
# SIGKILL) under the state folder and the data root anyway.
DATA_ROOT=$(cat "$DIR/data-root" 2>/dev/null || echo "$DIR/data")
for root in "$DIR" "$DATA_ROOT"; do
    { grep -o " $root/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done
done
if [[ "${2:-}" != "--keep" ]]; then
    rm -rf "$DIR"   # a DOCKERD_DATA_ROOT outside it is kept
fi
echo "dockerd stopped"
