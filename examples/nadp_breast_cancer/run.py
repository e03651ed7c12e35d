"""Run the example with flwr.simulation.run_simulation (no SuperLink, no run config): ``python run.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flwr.simulation import run_simulation  # noqa: E402
from nadp_app.client_app import app as client_app  # noqa: E402
from nadp_app.server_app import app as server_app  # noqa: E402
from nadp_app.task import settings  # noqa: E402

if __name__ == "__main__":
    run_simulation(server_app, client_app, num_supernodes=int(settings({})["num-clients"]),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
