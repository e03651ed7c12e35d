"""A resumed run's nodes must trust the roster its checkpoint holds.

The pairwise methods draw every round's public sample and graph from it, and the accounts follow that
schedule.  Each engine gives its nodes their own
identities (in-process: seeded key files; simulation: identities derived from the run seed; ``cancelfl deploy``:
the ones kept in the run folder), so :func:`check_resume_engine` refuses, before anything starts, a resume whose
nodes would trust another roster, naming the command whose nodes trust the stored one.
"""

from __future__ import annotations

from pathlib import Path

from protocols.config import ConfigError, RunConfig
from protocols.identity import DerivedRoster, IdentityError, Roster
from server.keys import node_name, seeded_identity
from strategies.run.checkpoint import IDENTITY_DIR, load_checkpoint

#: Engine -> the command that resumes a run on it.
RESUME_COMMAND = {"inprocess": "cancelfl run --resume {out}", "simulation": "cancelfl run --engine simulation "
                  "--resume {out}", "deploy": "cancelfl deploy --resume {out}"}


def engine_roster_digest(engine: str, cfg: RunConfig, out: str | Path) -> bytes | None:
    """Digest of the roster the nodes ``engine`` starts for ``cfg`` trust (None: new identities, unknown yet)."""
    if engine == "simulation":
        return DerivedRoster(int(cfg.seed), int(cfg.num_clients)).digest()
    if engine == "inprocess":  # server.local_grid.LocalGrid's seeded identities node-<i>
        names = [node_name(i) for i in range(int(cfg.num_clients))]
        return Roster({n: seeded_identity(int(cfg.seed), n).public_bytes for n in names}).digest()
    path = Path(out) / IDENTITY_DIR / "roster.json"
    try:
        return Roster.load(path).digest() if path.is_file() else None
    except IdentityError:
        return None


def check_resume_engine(out: str | Path, engine: str, cfg: RunConfig) -> None:
    """Refuse (``ConfigError``) to resume the run in ``out`` on ``engine`` when its nodes would trust another roster.

    A run whose checkpoint holds no roster (methods without a key phase, or none ran yet) resumes on any engine.
    """
    ckpt = load_checkpoint(out)
    state = ckpt.pending["strategy_state"] if ckpt.pending else ckpt.strategy_state
    schedule = state.get("schedule")
    if not schedule:
        return
    stored = Roster.from_json(schedule["roster"]).digest()
    if engine_roster_digest(engine, cfg, out) == stored:
        return
    match = [e for e in RESUME_COMMAND if e != engine and engine_roster_digest(e, cfg, out) == stored]
    how = (f"resume it with `{RESUME_COMMAND[match[0]].format(out=out)}`" if match else
           "no engine here starts nodes with its identities (a deployment's kept identities are gone)")
    raise ConfigError(f"--resume: this run's nodes trust another roster than the {engine} engine's nodes would (the "
                      f"public schedule and the accounts follow the run's roster); {how}")
