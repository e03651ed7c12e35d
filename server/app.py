"""The cancelfl ServerApp: builds the configured method's strategy and runs it."""

from __future__ import annotations

from logging import WARNING

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from protocols.adjustments import adjustments
from protocols.config import RunConfig
from protocols.task.data import partitions_for
from server.federation import check_federation
from strategies.run.checkpoint import resolve_out_dir, write_error

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config (fails fast naming the bad key), then run all rounds.

    A failure is recorded in ``<out-dir>/error.json`` before it propagates: ``flwr run`` exits 0 even
    when the ServerApp crashed, so the launcher reads the reason from there and exits non-zero.
    """
    out_dir = str(context.run_config.get("out-dir", ""))
    try:
        cfg = resolve_out_dir(RunConfig.from_mapping(context.run_config))  # "" = a fresh runs/<time>-<method>
        out_dir = cfg.out_dir
        for note in adjustments(cfg):
            log(WARNING, "%s", note)
        # DDP-SA: the ServerApp never starts intermediate servers -- the clients take them from their own
        # configuration, so whoever submits the run names them (`cancelfl run/deploy` start local ones).
        if not cfg.dataset.startswith("hub:"):
            partitions_for(cfg)  # a client without records: stop now, naming 'num-clients' and the dataset's maximum
        check_federation(grid, cfg)  # nodes started for another num-clients: stop now, naming the fix
        from server.runner import run_federation  # torch and the method's modules: after the check (seconds)
        from strategies.registry import build_strategy

        strategy = build_strategy(cfg)
        try:
            run_federation(strategy, grid, cfg)
        finally:
            strategy.close()
    except BaseException as err:
        if out_dir:
            write_error(out_dir, f"{type(err).__name__}: {err}")
        raise
