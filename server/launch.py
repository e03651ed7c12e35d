"""``cancelfl`` command line: run a method in-process, in Flower's simulation, or on real processes.

    cancelfl run [--engine inprocess|simulation] [--run-config 'method="nadp" num-rounds=5']
    cancelfl deploy --supernodes 4 [--run-config ...]     # SuperLink + SuperNodes as OS processes
    cancelfl run|deploy --resume OUT                      # continue a crashed run from its last round
    cancelfl keys gen --out DIR --node NAME; cancelfl keys roster --out roster.json DIR/*.pub   # identities
    cancelfl compare [--engine simulation] [--methods fedavg,cdp,nadp] [--epsilon 1]   # side by side + report
    cancelfl audit --method M [--direction upload|model] [--epsilon E] [--trials N]   # claimed vs audited epsilon

``inprocess`` drives the same ServerApp strategy and ClientApp code through
:class:`server.local_grid.LocalGrid` (no SuperLink, no Ray: seconds instead of
tens of seconds; used by tests and benchmarks).  ``simulation`` starts a private
SuperLink in simulation mode on a free loopback port with its own ``FLWR_HOME``
and submits the app with ``flwr run``; ``deploy`` does the same with real
``flower-supernode`` processes (see :mod:`server.deploy`).

``run``/``deploy`` check everything they can before any process starts
(:func:`preflight`), write to a fresh ``runs/<time>-<method>`` unless out-dir is
given (:mod:`strategies.run.checkpoint`), exit non-zero with the reason when the run
failed, and continue a crashed run with ``--resume OUT``.  ``--verbose`` prints each round's details
(:func:`strategies.run.loop.round_line`).  The help (:mod:`server.cli_text`) is plain text; torch, Flower and
the accountants are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from protocols.config import ConfigError, RunConfig, is_on, parse_run_config
from protocols.methods import local_services
from server.defaults import app_defaults, check_flower_keys
from strategies.run.checkpoint import (
    CHECKPOINT_JSON,
    clear_outputs,
    earlier_outputs,
    ledger_dir,
    prepare_out_dir,
    read_error,
    resolve_out_dir,
    resume_overrides,
    run_outcome,
    write_error,
)

# Flower must not phone home from tests, CI or user runs started here.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def _warn(message: str) -> None:
    print(f"cancelfl: warning: {message}", file=sys.stderr)


def local_checks(cfg: RunConfig) -> None:
    """What the clients of a run on this machine need, checked before any of them starts (``ConfigError``).

    Every client gets at least one training record (run-config ``num-clients`` against the dataset's records,
    :func:`protocols.task.data.partitions_for`; also the dataset files are read), a ``model`` import path builds
    a ``torch.nn.Module`` for the dataset's input shape and classes (:func:`check_user_model`) and run-config
    ``device`` exists here.
    """
    from protocols.task.data import partitions_for
    from protocols.task.models import resolve_device

    if not cfg.dataset.startswith("hub:"):  # a hub dataset would be downloaded twice
        partitions_for(cfg)
        check_user_model(cfg)
    resolve_device(cfg.device)


def check_user_model(cfg: RunConfig) -> None:
    """Build run-config ``model`` once when it is an import path; ``ConfigError`` naming the key if it cannot.

    The factory is resolved and called for the dataset's input shape and classes, as the ServerApp does at
    start (the global RNG is left as it was).
    """
    import torch

    from protocols.config import is_import_path
    from protocols.task.data import dataset_for
    from protocols.task.models import build_model

    if not is_import_path(cfg.model):
        return
    ds = dataset_for(cfg)
    try:
        with torch.random.fork_rng(devices=[]):
            build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    except Exception as err:  # noqa: BLE001 - the user's factory failed: refused at start, naming it
        if str(err).startswith("run-config 'model'"):  # import_object's and user_model's own messages
            raise ConfigError(str(err)) from err
        raise ConfigError(f"run-config 'model' = {cfg.model!r} could not be built for input shape "
                          f"{tuple(ds.input_shape)} and {ds.num_classes} classes: {type(err).__name__}: {err}") from err


def preflight(overrides: dict, *, warn=_warn) -> RunConfig:
    """Check everything that can be checked before any process starts; ``ConfigError``/``ValueError`` naming the cause.

    The run config (keys, types, ranges), the method's own constraints (its strategy is constructed; for
    DDP-SA up to the intermediate servers the launcher starts later), the dataset files (truncated,
    non-gzip or mismatched IDX files), :func:`local_checks` and the start sequence every engine applies
    (:func:`protocols.start_checks.start_checks`), whose notes (settings the run adjusts, a ``delta`` not below
    1/n) are reported through ``warn``.
    """
    from protocols.start_checks import check_clip_floor, start_checks
    from strategies.registry import build_strategy

    cfg = RunConfig.from_mapping({**app_defaults(), **overrides})
    check_clip_floor(cfg)  # before the method's calibration, which a clip float64 does not resolve may break
    try:
        build_strategy(cfg).close()
    except ArithmeticError as err:  # a calibration out of float range: the settings, not a bug of the run
        raise ConfigError(f"method {cfg.method!r} cannot calibrate its noise for epsilon = {cfg.epsilon:g}, delta = "
                          f"{cfg.delta:g}, clip = {cfg.clip:g}: {type(err).__name__}: {err}") from err
    except ConfigError as err:
        # DDP-SA servers (and their credentials) the launcher starts later: every check before them passed.
        if not (local_services(cfg) and "'ddpsa-servers'" in str(err)):
            raise
    local_checks(cfg)
    for note in start_checks(cfg):
        warn(note)
    return cfg


def inprocess_notes(cfg: RunConfig) -> list[str]:
    """What the in-process engine does not apply, one sentence per setting given: run-config ``round-timeout``.

    Its clients run one after another in the launcher's thread and every reply is waited for (a ClientApp call
    cannot be cut short); the simulation and ``deploy`` engines apply the timeout.
    """
    default = float(app_defaults().get("round-timeout", RunConfig.round_timeout))
    if cfg.round_timeout == default:
        return []
    return [f"run-config 'round-timeout' = {cfg.round_timeout:g} is not applied by the in-process engine: its clients "
            "run one after another in this process and every reply is waited for; run with --engine simulation or "
            "cancelfl deploy for a reply deadline"]


def choose_out_dir(cfg: RunConfig, *, overwrite: bool = False) -> str:
    """The run's absolute out-dir, created: a fresh ``runs/<time>-<method>`` for ``""``.

    A given folder holding an earlier run's outputs is refused (``ConfigError`` naming the ways out) unless
    ``overwrite`` (they are then removed) or the run resumes from it.
    """
    if not cfg.out_dir:
        return resolve_out_dir(cfg).out_dir
    path = str(Path(cfg.out_dir).expanduser().resolve())
    earlier = earlier_outputs(path)
    if earlier and not cfg.resume:
        if not overwrite:
            raise ConfigError(f"out-dir {path} holds an earlier run's outputs ({', '.join(earlier)}); leave out-dir "
                              "unset for a fresh runs/<time>-<method> folder, choose another, continue that run with "
                              f"--resume {path}, or replace its outputs with --overwrite")
        clear_outputs(path)
    prepare_out_dir(path)
    return path


def run_inprocess(overrides: dict, *, progress=print, grid_factory=None, keep_strategy: list | None = None,
                  verbose: bool = False, checked: bool = False) -> dict:
    """Run the app through an in-process grid; returns the run summary.

    Before any client exists it applies :func:`local_checks` and the start sequence of every engine
    (:func:`protocols.start_checks.start_checks`), its notes as ``warning:`` lines through ``progress``.

    ``grid_factory(client_app, num_nodes, run_config) -> Grid`` replaces the default
    :class:`server.local_grid.LocalGrid` (the attack harness passes an observing grid; it waits for every reply,
    whatever run-config ``round-timeout``: :func:`inprocess_notes`);
    ``keep_strategy``, if given, receives the strategy object (for inspection after the run);
    ``verbose``: detailed round lines; ``checked``: :func:`preflight` ran on these overrides (and showed the
    notes), so the start checks are not repeated.

    Raises:
        ConfigError: settings refused at start (as by :func:`preflight`), before any client trains.
    """
    from client.app import app as client_app
    from protocols.node_config import DDPSA_CA, DDPSA_SERVERS
    from protocols.start_checks import start_checks
    from server.intermediate.launcher import local_intermediate_servers, roster_of
    from server.local_grid import LocalGrid
    from server.runner import run_federation
    from strategies.registry import build_strategy

    raw = {**app_defaults(), **overrides}
    cfg = RunConfig.from_mapping(raw)
    if not checked:  # before the out-dir is made and the grid makes num-clients identities and contexts
        local_checks(cfg)
        for note in start_checks(cfg):
            progress(f"warning: {note}")
    raw["out-dir"] = resolve_out_dir(cfg).out_dir  # "" = a fresh runs/<time>-<method>
    cfg = RunConfig.from_mapping(raw)
    if not cfg.resume:  # an earlier run's outputs, its clients' ledgers too, before this run's clients exist
        clear_outputs(cfg.out_dir)
    if grid_factory is None:  # the clients' privacy ledgers live in the run folder: a resumed run continues them
        grid = LocalGrid(client_app, cfg.num_clients, raw, node_config={"ledger-dir": str(ledger_dir(cfg.out_dir))})
    else:
        grid = grid_factory(client_app, cfg.num_clients, raw)
    # DDP-SA: local intermediate servers that trust the nodes' roster; the nodes get them in their own node config
    # (a node asking for a guarantee takes no servers from the run config).
    with local_intermediate_servers(cfg, roster_of(c.node_config for c in grid.contexts.values())) as cfg:
        for ctx in grid.contexts.values():
            if cfg.ddpsa_servers and DDPSA_SERVERS not in ctx.node_config:  # a node's own pinned ones stay
                ctx.node_config.update({DDPSA_SERVERS: cfg.ddpsa_servers, DDPSA_CA: cfg.ddpsa_ca})
        strategy = build_strategy(cfg)
        if keep_strategy is not None:
            keep_strategy.append(strategy)
        try:
            return run_federation(strategy, grid, cfg, progress=progress, verbose=verbose)
        finally:
            strategy.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cancelfl`` command; exit code 0 only for a run that finished with a model.

    2: refused at start (bad run config, method settings, data files or out-dir); 1: the run failed
    (the ServerApp crashed, most rounds failed, or it stopped early); 130: interrupted.
    """
    from server import cli_text, compare, keys  # plain-language help; compare and keys' options (light imports)

    raw = argparse.RawDescriptionHelpFormatter
    epilog = cli_text.run_epilog(app_defaults())
    parser = argparse.ArgumentParser(
        prog="cancelfl", formatter_class=raw, description=cli_text.DESCRIPTION,
        epilog=f"methods:\n{cli_text.methods_text()}\n\nrun-config keys and defaults: cancelfl run --help")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,deploy,compare,keys,audit}")
    run = sub.add_parser("run", help="run one federated training", formatter_class=raw, epilog=epilog,
                         description="Run one federated training: the method, data and privacy target come from "
                                     "--run-config.")
    run.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess",
                     help="inprocess: server and clients in this process, no Ray (default); simulation: Flower's "
                          "simulation on a private SuperLink")
    run.add_argument("--run-config", default="", help="run-config keys, e.g. 'method=\"nadp\" num-rounds=5' (below)")
    dep = sub.add_parser("deploy", help="start a SuperLink and N SuperNodes as processes on loopback and run",
                         formatter_class=raw, epilog=epilog,
                         description="Start a Flower SuperLink and N SuperNodes as processes on 127.0.0.1 (each node "
                                     "with its own identity) and run one training on them.")
    dep.add_argument("--supernodes", type=_positive_int, default=None,
                     help="number of SuperNodes = num-clients (default: run-config num-clients if set, else 4)")
    dep.add_argument("--run-config", default="", help="run-config keys, as for run (below)")
    dep.add_argument("--tls", action="store_true",
                     help="TLS between SuperNodes and SuperLink (self-signed CA), with SuperNode authentication: "
                          "only the nodes whose keys it registered join")
    for p in (run, dep):
        p.add_argument("--resume", metavar="OUT", default=None,
                       help="continue the crashed run in folder OUT from its last completed round (same run config)")
        p.add_argument("--overwrite", action="store_true", help="replace an earlier run's outputs in out-dir")
    cmp = sub.add_parser("compare", help="several methods at one epsilon, side by side, with a report",
                         formatter_class=raw, epilog=epilog, description=compare.DESCRIPTION)
    compare.add_arguments(cmp)
    for p in (run, dep, cmp):
        p.add_argument("--verbose", "-v", action="store_true",
                       help="each round's details: epsilon per direction, clients, bytes, the method's own figures")
    keys.add_arguments(sub.add_parser("keys", help="make node identities (Ed25519) and the roster"))
    audit_parser = sub.add_parser("audit", help="empirical epsilon lower bound of a method vs its claim")
    argv = list(sys.argv[1:] if argv is None else argv)
    if next((a for a in argv if not a.startswith("-")), None) == "audit":  # its module imports torch and Flower
        from server import audit_cli  # cancelfl audit: empirical epsilon lower bound of a method's real release code

        audit_cli.add_arguments(audit_parser)
    args = parser.parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    previous = signal.signal(signal.SIGTERM, _terminated)  # run the cleanup (finally blocks) on `kill`, as on Ctrl-C
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    """:func:`main` after parsing."""
    if args.command == "keys":
        from server import keys

        return keys.run(args)
    if args.command == "audit":
        from server import audit_cli

        return audit_cli.main(args)

    try:
        overrides = parse_run_config(args.run_config)
        if args.command == "compare":
            from server import compare

            RunConfig.from_mapping({**app_defaults(), **overrides})  # fail fast, naming the bad key
            return compare.main(args, overrides, run_inprocess, check=preflight)
        if not args.resume and is_on(overrides.get("resume")) and overrides.get("out-dir"):
            args.resume = overrides["out-dir"]  # run-config resume = true: as --resume, the stored run config
        if args.resume:
            overrides = resume_overrides(args.resume, overrides)
        if args.command == "deploy":
            stored = overrides.get("num-clients") if args.resume else None
            if stored is not None and args.supernodes not in (None, stored):
                raise ConfigError(f"--resume: the run had {stored} SuperNodes (num-clients); --supernodes "
                                  f"{args.supernodes} would make it a different run")
            given = overrides.get("num-clients")
            if isinstance(given, str) and given.strip().lower() == "auto":
                given = None
            if given is not None and args.supernodes is None:  # the user's num-clients: refused by name when bad
                given = RunConfig.from_mapping({**app_defaults(), **overrides}).num_clients
            elif given is not None and given != args.supernodes:
                _warn(f"--supernodes {args.supernodes} overrides run-config 'num-clients' = {given}: the run has "
                      f"{args.supernodes} clients")
            args.supernodes = args.supernodes or given or 4
            overrides["num-clients"] = args.supernodes
        cfg = preflight(overrides)
        if args.command == "run" and args.engine == "inprocess":
            for note in inprocess_notes(cfg):
                _warn(note)
        else:
            check_flower_keys(overrides)  # Flower's runtime takes only the keys the app declares
        if args.resume:
            from server.resume_check import check_resume_engine

            check_resume_engine(args.resume, "deploy" if args.command == "deploy" else args.engine, cfg)
        from server.deploy import check_capacity, check_service_capacity

        check_service_capacity(local_services(cfg))  # DDP-SA's intermediate servers: processes on this machine
        if args.command == "deploy":
            check_capacity(args.supernodes)  # every SuperNode is a process on this machine
        overrides["out-dir"] = choose_out_dir(cfg, overwrite=args.overwrite)
    except ValueError as err:  # ConfigError and the data loader's errors: refused before any process starts
        print(f"cancelfl: {err}", file=sys.stderr)
        return 2
    out = overrides["out-dir"]
    print(f"cancelfl: outputs in {out}")
    try:
        if args.command == "run" and args.engine == "inprocess":
            code = _inprocess_exit(overrides, verbose=args.verbose)
        elif args.command == "run":
            from server import deploy

            code = deploy.run_simulation(overrides, verbose=args.verbose, notes_shown=True)  # shown by preflight
        else:
            from server import deploy

            code = deploy.run_deployment(overrides, num_supernodes=args.supernodes, tls=args.tls, verbose=args.verbose,
                                         notes_shown=True)
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, or SIGTERM (:func:`_terminated`)
        code = stop.code if isinstance(stop, SystemExit) and isinstance(stop.code, int) else 130
        print("cancelfl: interrupted; every process it started is stopped", file=sys.stderr)
    if code and resumable(out):
        print(f"cancelfl: continue it with: cancelfl {args.command} --resume {out}", file=sys.stderr)
    return code


def resumable(out: str | Path) -> bool:
    """Whether ``--resume out`` can continue the run that failed there.

    It can when a checkpoint is left, no summary was written and the recorded failure (``error.json``, written
    by the ServerApp or :func:`_inprocess_exit`) is not the run config's: a ``ConfigError``, or an error naming
    a run-config key, which resuming the same config would only repeat.  A crash or an interrupt can.
    """
    out = Path(out)
    if not (out / CHECKPOINT_JSON).is_file() or (out / "summary.json").is_file():
        return False
    kind, _, message = (read_error(out) or "").partition(": ")
    return kind != ConfigError.__name__ and not message.startswith("run-config '")


def _positive_int(text: str) -> int:
    """The ``--supernodes`` type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _terminated(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _inprocess_exit(overrides: dict, *, verbose: bool = False) -> int:
    """Run in-process after :func:`preflight`, judged as the others are (:func:`strategies.run.checkpoint.run_outcome`)."""
    out = overrides["out-dir"]
    num_clients = RunConfig.from_mapping({**app_defaults(), **overrides}).num_clients
    print(f"cancelfl: starting {num_clients} in-process clients (loading torch and Flower) ...", flush=True)
    try:
        run_inprocess(overrides, verbose=verbose, checked=True)  # after preflight
    except KeyboardInterrupt:
        print("cancelfl: interrupted", file=sys.stderr)
        code = 130
    except Exception as err:  # noqa: BLE001 - any failure of the run: show it, exit non-zero
        if (Path(out) / "summary.json").is_file():  # the run ended itself (e.g. a divergence stop) and said why
            print(f"cancelfl: {run_outcome(out)[1]}", file=sys.stderr)
        else:
            traceback.print_exc()
            print(f"cancelfl: the run failed: {type(err).__name__}: {err}", file=sys.stderr)
            write_error(out, f"{type(err).__name__}: {err}")  # as the ServerApp records it (:func:`resumable`)
        code = 1
    else:
        code, message = run_outcome(out)
        print(f"cancelfl: {message}", file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
