"""The run folder: a fresh folder per run, stale outputs, the per-round checkpoint and resuming from it.

* ``out-dir = ""`` gives every run a fresh ``runs/<UTC time>-<method>`` and points the ``runs/latest`` symlink at
  it (:func:`resolve_out_dir`); a fresh run in an existing folder first removes an earlier run's outputs
  (:data:`OUTPUT_FILES`), and the launcher refuses such a folder unless told to overwrite (:func:`earlier_outputs`).
* After each round the runner writes ``checkpoint-r<round>.npz`` and then ``checkpoint.json`` naming it,
  atomically: the model, round, metrics rows, failed rounds, wall time, run config and the strategy's
  :meth:`~strategies.base.CancelStrategy.state_dict` (its privacy ledger).  Sampling depends only on
  (seed, round) and DP noise on the OS CSPRNG, so no RNG state is kept; clients re-key after a resume.
* When round ``r``'s train messages go out, its privacy charge is recorded as ``pending``: a crash during the
  round keeps the charge, and the repeated round is charged again (epsilon is never under-counted).
* ``resume = true`` continues from the last completed round in ``out-dir`` with the stored run config
  (:func:`resume_overrides`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protocols.config import ConfigError, RunConfig, changed_keys

CHECKPOINT_JSON = "checkpoint.json"
#: The model of a checkpoint: one file per round, named in checkpoint.json (older ones removed after the switch).
CHECKPOINT_NPZ = "checkpoint-r{round}.npz"
ERROR_FILE = "error.json"
#: Every file a run writes into its folder (removed before a fresh run starts there).
OUTPUT_FILES = ("metrics.jsonl", "summary.json", "model.npz", "model.json", "report.md", "accuracy.png",
                "epsilon.png", "noise.png", ERROR_FILE, CHECKPOINT_JSON)
#: Folder of the privacy ledgers (:mod:`client.ledger`) of the clients the launcher starts: in the run folder, so
#: that a resumed run's clients continue their spend instead of starting from zero; a fresh run removes it.
LEDGER_DIR = "client-ledgers"
#: Folder of the node identities and roster of a ``cancelfl deploy`` run (:func:`server.deploy.node_identities`):
#: a resumed deployment's nodes are the same roster; a fresh run removes it.
IDENTITY_DIR = "node-identities"
#: Run-config keys a resumed run may change (where things are, not what is computed).
#: Where the DDP-SA servers of a run are (those the launcher started are gone after a crash).
LOCATION_KEYS = ("ddpsa-servers", "ddpsa-ca", "ddpsa-server-key")
RESUME_MAY_CHANGE = ("out-dir", "resume", "data-dir", "round-timeout", *LOCATION_KEYS)
#: Folder of the default run folders, relative to the working directory.
RUNS_ROOT = Path("runs")


def ledger_dir(out_dir: str | Path) -> Path:
    """Absolute :data:`LEDGER_DIR` of the run folder ``out_dir`` (for nodes whose working directory differs)."""
    return Path(out_dir).resolve() / LEDGER_DIR


class ResumeError(ConfigError):
    """The run in out-dir cannot be resumed (no or damaged checkpoint, or a changed run config)."""


# --------------------------------------------------------------------------- run folders
def fresh_run_folder(method: str, root: Path = RUNS_ROOT) -> Path:
    """Create ``root/<UTC time>-<method>`` (suffixed ``-2``, ``-3``... if taken) and point ``root/latest`` at it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        folder = root / (f"{stamp}-{method}" if n == 1 else f"{stamp}-{method}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        point_latest(folder)
        return folder
    raise ConfigError(f"no free run folder name under {root} for {stamp}-{method}")


def point_latest(folder: Path) -> None:
    """Make ``<parent>/latest`` a relative symlink to ``folder``.

    A real directory named ``latest`` is renamed ``<its mtime>-latest``, never deleted.
    """
    latest = folder.parent / "latest"
    if latest.is_dir() and not latest.is_symlink():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(latest.stat().st_mtime))
        latest.rename(folder.parent / f"{stamp}-latest")
    tmp = folder.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder.name)
    os.replace(tmp, latest)


def resolve_out_dir(cfg: RunConfig) -> RunConfig:
    """``cfg`` with an absolute out-dir: a fresh run folder when it is ``""``, else the given path."""
    if not cfg.out_dir:
        return cfg.replace(out_dir=str(fresh_run_folder(cfg.method).resolve()))
    return cfg.replace(out_dir=str(Path(cfg.out_dir).expanduser().resolve()))


def prepare_out_dir(path: str | Path) -> Path:
    """Create the out-dir (and parents) and check it is writable; :class:`ConfigError` naming the cause if not."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise ConfigError(f"run-config 'out-dir' = {str(path)!r} cannot be created: a file of that name is in "
                          "the way") from err
    except OSError as err:
        raise ConfigError(f"run-config 'out-dir' = {str(path)!r} cannot be created: "
                          f"{err.strerror or err} ({err.filename or path})") from err
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"run-config 'out-dir' = {str(path)!r} is not writable")
    return out


def earlier_outputs(path: str | Path) -> list[str]:
    """Names of an earlier run's output files in ``path`` (empty if none or no such folder)."""
    out = Path(path)
    if not out.is_dir():
        return []
    return ([name for name in (*OUTPUT_FILES, LEDGER_DIR, IDENTITY_DIR) if (out / name).exists()]
            + sorted(p.name for p in _model_files(out)))


def _model_files(out: Path) -> list[Path]:
    return list(out.glob(CHECKPOINT_NPZ.format(round="*")))


def clear_outputs(path: str | Path, keep: Collection[str | Path] = ()) -> None:
    """Remove an earlier run's outputs (:data:`OUTPUT_FILES`, checkpoints, :data:`LEDGER_DIR`, :data:`IDENTITY_DIR`).

    ``keep``: paths the launcher made for the run about to start there (its nodes' identities and ledgers).
    """
    kept = {Path(k).resolve() for k in keep}
    for name in earlier_outputs(path):
        target = Path(path) / name
        if target.resolve() in kept:
            continue
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)


def write_error(out_dir: str | Path, reason: str) -> None:
    """Record why the ServerApp failed (read by the launcher, which then exits non-zero with the reason)."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)  # a failure before the run loop made it
        _atomic_write(Path(out_dir) / ERROR_FILE, json.dumps({"error": reason}, indent=2).encode())
    except OSError:
        pass  # the reason is also in the ServerApp's log; the missing summary already fails the run


def read_error(out_dir: str | Path) -> str | None:
    """The reason recorded by :func:`write_error`, if any."""
    try:
        return str(json.loads((Path(out_dir) / ERROR_FILE).read_text())["error"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- checkpoints
@dataclass
class Checkpoint:
    """Everything a resumed run needs, as of the end of round :attr:`round`."""

    round: int
    weights: OrderedDict[str, np.ndarray]
    strategy_state: dict[str, Any]
    rows: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    #: Strategy state including the charge of round ``round + 1`` once its train messages went out.
    pending: dict[str, Any] | None = None
    #: The published model (run-config ``model-ema``: an average of the global models) when it is not ``weights``.
    published: OrderedDict[str, np.ndarray] | None = None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _meta(ckpt: Checkpoint) -> dict[str, Any]:
    return {"format": 1, "round": ckpt.round, "config": ckpt.config, "strategy_state": ckpt.strategy_state,
            "rows": ckpt.rows, "failures": ckpt.failures, "elapsed_s": ckpt.elapsed_s, "pending": ckpt.pending,
            "arrays": list(ckpt.weights)}


def save_checkpoint(out_dir: str | Path, ckpt: Checkpoint) -> None:
    """Write the round's model file, then the JSON naming it (the commit point), then drop older model files."""
    out = Path(out_dir)
    name = CHECKPOINT_NPZ.format(round=ckpt.round)
    tmp = out / f".{name}.tmp-{os.getpid()}.npz"
    extra = {} if ckpt.published is None else {f"p{i}": np.asarray(a) for i, a in enumerate(ckpt.published.values())}
    np.savez(tmp, **{f"a{i}": np.asarray(a) for i, a in enumerate(ckpt.weights.values())}, **extra)
    os.replace(tmp, out / name)
    _atomic_write(out / CHECKPOINT_JSON, json.dumps({**_meta(ckpt), "arrays_file": name}, allow_nan=False).encode())
    for old in _model_files(out):
        if old.name != name:
            old.unlink(missing_ok=True)


def mark_pending(out_dir: str | Path, server_round: int, strategy_state: dict[str, Any]) -> None:
    """Record that round ``server_round``'s train messages went out, with the state that includes its charge."""
    path = Path(out_dir) / CHECKPOINT_JSON
    if not path.is_file():
        return  # round 1: a crash restarts from scratch, nothing was published
    meta = json.loads(path.read_text())
    meta["pending"] = {"round": server_round, "strategy_state": strategy_state}
    _atomic_write(path, json.dumps(meta, allow_nan=False).encode())


def load_checkpoint(out_dir: str | Path) -> Checkpoint:
    """Read the checkpoint of ``out_dir``; :class:`ResumeError` naming the problem if there is none or it is damaged."""
    out = Path(out_dir)
    path = out / CHECKPOINT_JSON
    if not path.is_file():
        raise ResumeError(f"cannot resume: {path} does not exist (the run in {out} finished no round, "
                          "or it is not a cancelfl run folder)")
    try:
        meta = json.loads(path.read_text())
        with np.load(out / meta["arrays_file"]) as npz:
            weights = OrderedDict((name, npz[f"a{i}"]) for i, name in enumerate(meta["arrays"]))
            published = (OrderedDict((name, npz[f"p{i}"]) for i, name in enumerate(meta["arrays"]))
                         if "p0" in npz.files else None)
        pending = meta.get("pending")
        return Checkpoint(int(meta["round"]), weights, meta["strategy_state"], list(meta["rows"]),
                          list(meta["failures"]), float(meta["elapsed_s"]), dict(meta["config"]),
                          pending if pending and pending.get("round") == int(meta["round"]) + 1 else None,
                          published)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ResumeError(f"cannot resume: the checkpoint in {out} is damaged ({type(err).__name__}: {err})") from err


def resume_overrides(out_dir: str | Path, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The run config to resume the run in ``out_dir``: the stored one, plus ``resume`` and location keys.

    Only :data:`RESUME_MAY_CHANGE` keys may be given in ``overrides``; anything else would make the
    resumed rounds a different run (and its epsilon meaningless), so it is refused naming the keys.
    """
    ckpt = load_checkpoint(out_dir)
    bad = sorted(k for k in overrides if k not in RESUME_MAY_CHANGE)
    if bad:
        raise ResumeError(f"--resume continues the stored run config; these keys cannot change: {', '.join(bad)} "
                          f"(only {', '.join(RESUME_MAY_CHANGE)} may)")
    # DDP-SA servers the launcher started for the crashed run are gone: new ones (unless given again).
    stored = {k: v for k, v in ckpt.config.items() if k not in LOCATION_KEYS}
    return {**stored, **overrides, "out-dir": str(Path(out_dir).resolve()), "resume": True}


# --------------------------------------------------------------------------- used by the runner
def start_run_folder(cfg: RunConfig) -> Path:
    """The run's out-dir, created; a fresh run first removes an earlier run's outputs (a resumed one keeps them).

    The nodes' :data:`LEDGER_DIR` and :data:`IDENTITY_DIR` stay: the launcher that starts the nodes makes them
    for this run (after removing an earlier run's), and its nodes may already use them when the server starts.
    """
    out = prepare_out_dir(cfg.out_dir or resolve_out_dir(cfg).out_dir)
    if not cfg.resume:
        clear_outputs(out, keep=(out / LEDGER_DIR, out / IDENTITY_DIR))
    else:
        (out / ERROR_FILE).unlink(missing_ok=True)
    return out


def load_for_resume(out_dir: str | Path, cfg: RunConfig, strategy: Any) -> Checkpoint:
    """Load the checkpoint, check the run config is the stored one, restore ``strategy``'s state.

    With a pending round (its train messages went out before the crash) the state including that round's
    privacy charge is restored: the repeated round is charged again, so epsilon is never under-counted.
    """
    ckpt = load_checkpoint(out_dir)
    changed = changed_keys(ckpt.config, cfg, ignore=RESUME_MAY_CHANGE)
    if changed:
        raise ResumeError("cannot resume: the run config differs from the checkpoint's in "
                          + ", ".join(f"'{k}' ({ckpt.config.get(k)!r} -> {cfg.to_mapping().get(k)!r})" for k in changed))
    strategy.load_state(ckpt.pending["strategy_state"] if ckpt.pending else ckpt.strategy_state)
    return ckpt


def run_outcome(out_dir: str | Path, code: int = 0) -> tuple[int, str]:
    """Exit code and message of a finished run, from its folder (``code``: the exit code of ``flwr run``).

    Non-zero when the ServerApp recorded a failure (``error.json``), when no ``summary.json`` was written,
    when the run stopped early (``stopped``) or when most rounds (more than half) failed.
    """
    out = Path(out_dir)
    error = read_error(out)
    if error is not None:
        return 1, f"the run failed: {error} (outputs so far in {out})"
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return code or 1, (f"the run did not finish: no summary.json in {out} (flwr exit code {code}); "
                           "the ServerApp's log above says why")
    failed = summary.get("failed_rounds") or []
    done = summary.get("rounds_completed")
    if summary.get("stopped"):
        return 1, f"the run stopped early: {summary['stopped']} (outputs in {out})"
    if done and len(failed) >= int(done):
        return 1, f"no round succeeded ({len(failed)} failed); the first failure: {failed[0]}"
    if done and 2 * len(failed) > int(done):
        return 1, (f"most rounds failed ({len(failed)} of {done}; the model is that of the rounds that succeeded); "
                   f"the first failure: {failed[0]}")
    if code:
        return code, f"flwr exited with code {code} (outputs in {out})"
    return 0, f"run finished, summary at {out / 'summary.json'}"
