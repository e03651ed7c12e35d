"""The cancelfl ServerApp: builds the configured method's strategy and runs it."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from server.config import RunConfig
from server.runner import run_federation
from strategies.registry import build_strategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config (fails fast naming the bad key), then run all rounds."""
    cfg = RunConfig.from_mapping(context.run_config)
    strategy = build_strategy(cfg)
    try:
        run_federation(strategy, grid, cfg)
    finally:
        close = getattr(strategy, "close", None)  # e.g. DDP-SA stops its intermediate servers
        if close:
            close()
