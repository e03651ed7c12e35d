"""The cancelfl ServerApp: builds the configured method's strategy and runs it."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from protocols.config import RunConfig
from server.intermediate.launcher import local_intermediate_servers
from server.runner import run_federation
from strategies.registry import build_strategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config (fails fast naming the bad key), then run all rounds."""
    cfg = RunConfig.from_mapping(context.run_config)
    with local_intermediate_servers(cfg) as cfg:
        strategy = build_strategy(cfg)
        try:
            run_federation(strategy, grid, cfg)
        finally:
            strategy.close()
