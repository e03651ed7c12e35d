#!/usr/bin/env bash
# Submit a run to the running compose deployment with the `flwr` CLI of the
# image (service "submit"), streaming its logs until the run finishes.
#
# Usage: docker/submit.sh 'RUN_CONFIG' [COMPOSE_FILE ...]
#   docker/submit.sh 'method="nadp" num-rounds=3 out-dir="/outputs/nadp"'
#   docker/submit.sh 'method="ddpsa" ddpsa-servers="127.0.0.1:19101,127.0.0.1:19102,127.0.0.1:19103"'
# A run naming ddpsa-servers gets the compose deployment's ddpsa-ca (/certs/ca.crt)
# and ddpsa-server-key (/identity/parameter-server.key) unless it sets them.
# out-dir is a path in the SuperLink container: /outputs/... is the host's
# CANCELFL_OUTPUT_DIR (default: outputs/ at the repository root).
# Extra compose files (e.g. docker/docker-compose.ci.yml) follow the run config.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
export CANCELFL_RUN_CONFIG="${1:?usage: submit.sh RUN_CONFIG [COMPOSE_FILE ...]}"
shift
if [[ "$CANCELFL_RUN_CONFIG" == *ddpsa-servers=* ]]; then
    [[ "$CANCELFL_RUN_CONFIG" == *ddpsa-ca=* ]] || CANCELFL_RUN_CONFIG+=' ddpsa-ca="/certs/ca.crt"'
    [[ "$CANCELFL_RUN_CONFIG" == *ddpsa-server-key=* ]] ||
        CANCELFL_RUN_CONFIG+=' ddpsa-server-key="/identity/parameter-server.key"'
fi
files=(-f "$HERE/docker-compose.yml")
for f in "$@"; do files+=(-f "$f"); done
exec docker compose "${files[@]}" --profile submit run --rm submit
