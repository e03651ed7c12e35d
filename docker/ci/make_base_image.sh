#!/usr/bin/env bash
# Build a minimal Debian bookworm base image (python3, venv, pip, CA store)
# with debootstrap and `docker import`, so that CI needs no image registry.
#
# Usage: DOCKER_HOST=... docker/ci/make_base_image.sh [IMAGE_NAME]
#   IMAGE_NAME              default: cancelfl-debian-base:bookworm
#   CANCELFL_DOCKER_CACHE   folder where the root filesystem tarball is kept
#                           between runs (default: ~/.cache/cancelfl-docker);
#                           delete the tarball there to rebuild from scratch.
#   DEBIAN_MIRROR           default: the bookworm mirror apt is configured with.
# Needs root (debootstrap) and a running Docker engine.
set -euo pipefail

IMAGE="${1:-cancelfl-debian-base:bookworm}"
SUITE=bookworm
CACHE_DIR="${CANCELFL_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cancelfl-docker}"
TARBALL="$CACHE_DIR/debian-$SUITE-minbase-python3.tar"

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE already present"
    exit 0
fi

mirror() {
    # The mirror apt uses for "<suite>/main" (works for sources.list and
    # deb822 .sources files alike), e.g. http://deb.debian.org/debian.
    if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
    local m
    m=$(apt-cache policy 2>/dev/null \
        | awk -v s=" $SUITE/main " '$0 ~ s && $2 ~ /^https?:/ {print $2; exit}')
    echo "${m:-http://deb.debian.org/debian}"
}

if [[ ! -s "$TARBALL" ]]; then
    command -v debootstrap >/dev/null || { echo "debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }
    mkdir -p "$CACHE_DIR"
    ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/cancelfl-rootfs.XXXXXX")
    trap 'rm -rf "$ROOTFS"' EXIT
    MIRROR=$(mirror)
    echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
    debootstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,ca-certificates \
        "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
        || { tail -20 "$ROOTFS.log" >&2; exit 1; }
    rm -f "$ROOTFS.log"
    # Smaller image: no apt caches or package lists.
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
           "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/tmp/*
    tar -C "$ROOTFS" -cf "$TARBALL.partial" .
    mv "$TARBALL.partial" "$TARBALL"
fi

echo "importing $TARBALL as $IMAGE"
docker import --change 'CMD ["/bin/bash"]' "$TARBALL" "$IMAGE" >/dev/null
docker image ls "$IMAGE"
