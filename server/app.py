"""The cancelfl ServerApp: builds the configured method's strategy and runs it."""

from __future__ import annotations

import os
from logging import INFO, WARNING

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from protocols.config import RunConfig
from protocols.federation import num_clients_left_auto
from protocols.start_checks import START_NOTES_SHOWN_ENV, start_checks
from protocols.task.data import partitions_for
from server.federation import fit_federation
from server.flower_tuning import tune_serverapp
from server.local_superlink import managed_superlink, stop_hint
from strategies.run.checkpoint import resolve_out_dir, write_error

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config (fails fast naming the bad key), then run all rounds.

    A failure is recorded in ``<out-dir>/error.json`` before it propagates: ``flwr run`` exits 0 even
    when the ServerApp crashed, so the launcher reads the reason from there and exits non-zero.  Under
    the SuperLink that ``flwr run`` starts (``:local:``), the last line names it and how to stop it.
    """
    out_dir = str(context.run_config.get("out-dir", ""))
    tune_serverapp()  # Flower's object transfers: short retries, several requests at once
    try:
        cfg = resolve_out_dir(RunConfig.from_mapping(context.run_config))  # "" = a fresh runs/<time>-<method>
        out_dir = cfg.out_dir
        if not cfg.dataset.startswith("hub:") and not num_clients_left_auto(context.run_config):
            partitions_for(cfg)  # a client without records: stop before asking any node, naming the maximum
        # num-clients "auto": the federation's size; a num-clients the nodes were not started for: stop, naming the fix
        cfg = fit_federation(grid, cfg, context.run_config)
        notes = start_checks(cfg)  # the clip floor and the method's rules against the clients' record counts
        if os.environ.get(START_NOTES_SHOWN_ENV) != "1":  # the cancelfl launcher showed them before it started Flower
            for note in notes:
                log(WARNING, "%s", note)
        # DDP-SA: the ServerApp never starts intermediate servers -- the clients take them from their own
        # configuration, so whoever submits the run names them (`cancelfl run/deploy` start local ones).
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
    finally:
        link = managed_superlink()  # plain `flwr run`: say what it left running and how to stop it
        if link is not None:
            log(INFO, "cancelfl: %s", stop_hint(link))
