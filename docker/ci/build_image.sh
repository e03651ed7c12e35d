#!/usr/bin/env bash
# Build the cancelfl image on a CI machine without an image registry:
#   base   debootstrapped Debian (make_base_image.sh, cached)
#   ci     docker/ci/Dockerfile.ci-base: host CA certificates + local CPU torch wheel
#   app    docker/Dockerfile with BASE_IMAGE=<ci image> (the user-facing Dockerfile)
# Builds run with --network host (the engine has no bridge) and one
# --add-host NAME:IP per package-index host, looked up now with getent.
#
# Usage: DOCKER_HOST=... docker/ci/build_image.sh [APP_DIR] [TAG]
#   APP_DIR  the Flower app (default: repository root); TAG default cancelfl:ci
#   CANCELFL_WHEEL_DIR  folder with torch-<ver>+cpu-*.whl (default: pip's find-links)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
APP_DIR=$(cd "${1:-$REPO}" && pwd)
TAG="${2:-cancelfl:ci}"
BASE_IMAGE="${CANCELFL_BASE_IMAGE:-cancelfl-debian-base:bookworm}"
CI_BASE_TAG="${CANCELFL_CI_BASE_IMAGE:-cancelfl-ci-base:latest}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
export DOCKER_BUILDKIT=0   # buildx is not installed: use the classic builder

"$HERE/make_base_image.sh" "$BASE_IMAGE"

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/cancelfl-build.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT

# --- package-index hosts -> --add-host NAME:IP ------------------------------
ADD_HOSTS=()
while read -r name; do
    ip=$(getent hosts "$name" | awk '{print $1; exit}') || true
    if [[ -n "$ip" ]]; then
        ADD_HOSTS+=(--add-host "$name:$ip")
    else
        echo "warning: cannot resolve package-index host $name" >&2
    fi
done < <(python3 - <<'PY'
import subprocess, sys, urllib.parse
hosts = {"pypi.org", "files.pythonhosted.org"}   # PyPI: index + file host
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                     capture_output=True, text=True).stdout
for line in out.splitlines():
    key, _, val = line.partition("=")
    if key.endswith(("index-url", "extra-index-url")):
        for url in val.strip("'\"").split():
            p = urllib.parse.urlparse(url)
            if p.scheme in ("http", "https") and p.hostname:
                hosts.add(p.hostname)
print("\n".join(sorted(hosts)))
PY
)
echo "package-index hosts: ${ADD_HOSTS[*]}"

# --- stage 1: CI base (CA certificates + local torch CPU wheel) -------------
if ! docker image inspect "$CI_BASE_TAG" >/dev/null 2>&1; then
    mkdir -p "$STAGE/ci/ca-certificates" "$STAGE/ci/wheels"
    # The extra CAs of the host's system trust store (update-ca-certificates
    # takes them from /usr/local/share/ca-certificates).
    find /usr/local/share/ca-certificates -name '*.crt' -type f \
        -exec cp {} "$STAGE/ci/ca-certificates/" \; 2>/dev/null || true
    wheel_dir="${CANCELFL_WHEEL_DIR:-}"
    if [[ -z "$wheel_dir" ]]; then
        wheel_dir=$(python3 -m pip config list 2>/dev/null \
            | sed -n "s/.*find-links='\([^' ]*\).*/\1/p" | head -1)
        wheel_dir="${wheel_dir:-${PIP_FIND_LINKS:-/opt/wheels}}"
    fi
    wheel=$(find "$wheel_dir" -maxdepth 1 -name "torch-${TORCH_VERSION}+cpu-cp311-*.whl" 2>/dev/null | head -1)
    [[ -n "$wheel" ]] || { echo "no torch ${TORCH_VERSION}+cpu cp311 wheel in $wheel_dir" >&2; exit 1; }
    cp -l "$wheel" "$STAGE/ci/wheels/" 2>/dev/null || cp "$wheel" "$STAGE/ci/wheels/"
    cp "$HERE/Dockerfile.ci-base" "$STAGE/ci/Dockerfile"
    t0=$(date +%s)
    docker build --network host "${ADD_HOSTS[@]}" \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
        -t "$CI_BASE_TAG" "$STAGE/ci"
    echo "ci base image built in $(( $(date +%s) - t0 )) s"
fi

# --- stage 2: the user-facing Dockerfile on top of the CI base --------------
# A clean context with only what the Dockerfile copies (no .venv, no .git).
mkdir -p "$STAGE/app"
for f in pyproject.toml README.md; do cp "$APP_DIR/$f" "$STAGE/app/"; done
for d in server client strategies protocols; do
    cp -r "$APP_DIR/$d" "$STAGE/app/$d"
done
find "$STAGE/app" -name __pycache__ -type d -prune -exec rm -rf {} +
t0=$(date +%s)
docker build --network host "${ADD_HOSTS[@]}" \
    --build-arg BASE_IMAGE="$CI_BASE_TAG" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    -f "$REPO/docker/Dockerfile" -t "$TAG" "$STAGE/app"
echo "app image $TAG built in $(( $(date +%s) - t0 )) s"
# The previous build of the tag is now dangling: free its space (matters when
# the engine's data root is kept between runs).
docker image prune -f >/dev/null
