"""``cancelfl`` command line: run a method in-process, in Flower's simulation, or on real processes.

    cancelfl run [--engine inprocess|simulation] [--run-config 'method="nadp" num-rounds=5']
    cancelfl deploy --supernodes 4 [--run-config ...]     # SuperLink + SuperNodes as OS processes
    cancelfl keys gen --out DIR --node NAME; cancelfl keys roster --out roster.json DIR/*.pub   # identities
    cancelfl compare [--engine simulation] [--methods fedavg,ldp,cdp,nadp] [--epsilon 1]   # side by side + report

``inprocess`` drives the same ServerApp strategy and ClientApp code through
:class:`server.local_grid.LocalGrid` (no SuperLink, no Ray: seconds instead of
tens of seconds; used by tests and benchmarks).  ``simulation`` starts a private
SuperLink in simulation mode on a free loopback port with its own ``FLWR_HOME``
and submits the app with ``flwr run``; ``deploy`` does the same with real
``flower-supernode`` processes (see :mod:`server.deploy`).
"""

from __future__ import annotations

import argparse
import os
import sys

from protocols.config import RunConfig
from server.defaults import app_defaults

# Flower must not phone home from tests, CI or user runs started here.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def parse_run_config(text: str | None) -> dict:
    """Parse Flower's ``--run-config`` syntax (``k=v k2="s"``, TOML values)."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text])) if text else {}


def run_inprocess(overrides: dict, *, progress=print, grid_factory=None, keep_strategy: list | None = None) -> dict:
    """Run the app through an in-process grid; returns the run summary.

    ``grid_factory(client_app, num_nodes, run_config) -> Grid`` replaces the default
    :class:`server.local_grid.LocalGrid` (the attack harness passes an observing grid);
    ``keep_strategy``, if given, receives the strategy object (for inspection after the run).
    """
    from client.app import app as client_app
    from server.intermediate.launcher import local_intermediate_servers
    from server.local_grid import LocalGrid
    from server.runner import run_federation
    from strategies.registry import build_strategy

    raw = {**app_defaults(), **overrides}
    with local_intermediate_servers(RunConfig.from_mapping(raw)) as cfg:
        raw = {**raw, "ddpsa-servers": cfg.ddpsa_servers}
        grid = (grid_factory or LocalGrid)(client_app, cfg.num_clients, raw)
        strategy = build_strategy(cfg)
        if keep_strategy is not None:
            keep_strategy.append(strategy)
        try:
            return run_federation(strategy, grid, cfg, progress=progress)
        finally:
            strategy.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cancelfl`` command."""
    parser = argparse.ArgumentParser(prog="cancelfl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one federated training")
    run.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess")
    run.add_argument("--run-config", default="", help="Flower run-config overrides, e.g. 'method=\"nadp\" num-rounds=5'")
    dep = sub.add_parser("deploy", help="start a SuperLink and N SuperNodes as processes on loopback and run")
    dep.add_argument("--supernodes", type=int, default=4)
    dep.add_argument("--run-config", default="")
    dep.add_argument("--tls", action="store_true", help="TLS between SuperNodes and SuperLink (self-signed CA)")
    from server import compare  # cancelfl compare: methods side by side at one epsilon, with a report

    compare.add_arguments(sub.add_parser("compare", help="several methods at one epsilon, side by side, with a report"))
    from server import keys  # cancelfl keys gen/roster: node identities and the roster clients trust

    keys.add_arguments(sub.add_parser("keys", help="make node identities (Ed25519) and the roster"))
    args = parser.parse_args(argv)
    if args.command == "keys":
        return keys.run(args)

    overrides = parse_run_config(args.run_config)
    try:
        RunConfig.from_mapping({**app_defaults(), **overrides})  # fail fast, naming the bad key
    except ValueError as err:
        print(f"cancelfl: {err}", file=sys.stderr)
        return 2
    if args.command == "compare":
        return compare.main(args, overrides)
    if args.command == "run" and args.engine == "inprocess":
        run_inprocess(overrides)
        return 0
    from server import deploy

    if args.command == "run":
        return deploy.run_simulation(overrides)
    return deploy.run_deployment(overrides, num_supernodes=args.supernodes, tls=args.tls)


if __name__ == "__main__":
    sys.exit(main())
