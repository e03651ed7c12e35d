"""A node's persistent privacy ledger: what its data has spent, over every run, per direction and privacy unit.

One JSON file per data partition, ``<ledger-dir>/client-<partition-id>.json`` (node config ``ledger-dir``, else
``$CANCELFL_LEDGER_DIR``, else ``<FLWR_HOME or ~/.flwr>/cancelfl-ledger``), read, updated and written under a
file lock by every message, so it survives restarts and new runs.  Accounts are keyed ``"<direction>/<unit>"``
(``uplink`` = the uploads, ``downlink`` = the published model; ``client`` = the node's whole dataset,
``record`` = one example).  Each holds an :class:`~protocols.privacy.RdpAccountant` for Gaussian and Laplace
releases, a :class:`~protocols.privacy.DpCompositionAccountant` for theorem-certified ones, and one accountant per
composition a method names for its releases (DDP-SA: :func:`protocols.ddpsa.composition_accountant`, the one its
server charges with); the epsilons of the accountants in use add at an equal share of ``delta`` each.  While an
account holds only unsampled Gaussian releases its epsilon is their exact Gaussian-DP composition
(:class:`GdpAccountant`), the figure a server that accounts exactly (LaDP) reports.  ``runs`` keeps, per Flower
run id, the rounds this node trained (a repeated round is refused), the run's own accounts (what node config
``max-epsilon-per-run`` caps), and what every message of the run must agree on whatever ``Context.state`` it starts
on: the settings digest (library mode), each round's recovery outcome, and the recovery top-ups charged.
A run's secrets (:meth:`ClientLedger.run_secret`) lie beside the ledger in owner-only files of their own.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from protocols.node_config import LEDGER_DIR as LEDGER_DIR_KEY
from protocols.privacy import (
    Accountant,
    DpCompositionAccountant,
    DpEvent,
    Event,
    GdpAccountant,
    RdpAccountant,
    accountant_from_state,
)
from protocols.private_files import write_private

#: Written version; 2 added the named compositions (an older reader refuses them instead of ignoring them).
_VERSION = 2
#: Versions read (1: no named compositions).
_READS = (1, 2)


def ledger_dir(node_config: Mapping[str, Any]) -> Path:
    """The node's ledger folder (node config ``ledger-dir``, else ``$CANCELFL_LEDGER_DIR``, else under FLWR_HOME)."""
    if node_config.get(LEDGER_DIR_KEY):
        return Path(str(node_config[LEDGER_DIR_KEY])).expanduser()
    if os.environ.get("CANCELFL_LEDGER_DIR"):
        return Path(os.environ["CANCELFL_LEDGER_DIR"]).expanduser()
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser() / "cancelfl-ledger"


def composition_key(accountant: Accountant) -> str:
    """The name of ``accountant``'s composition in a ledger account: its kind and parameters (``"pld"``, ...)."""
    state = accountant.to_state()
    params = [str(v) for k, v in sorted(state.items()) if k not in ("kind", "events")]
    return "/".join([str(state["kind"]), *params])


class Account:
    """One direction/unit account: RDP, composition theorems, and the compositions methods name for their releases.

    ``rdp``: Gaussian/Laplace releases; ``dp``: (eps, delta) ones; ``composed``: :func:`composition_key` -> accountant.
    """

    def __init__(self, rdp: RdpAccountant | None = None, dp: DpCompositionAccountant | None = None,
                 composed: Mapping[str, Accountant] | None = None) -> None:
        self.rdp = rdp or RdpAccountant()
        self.dp = dp or DpCompositionAccountant()
        self.composed: dict[str, Accountant] = dict(composed or {})

    def compose(self, event: Event, accountant: Accountant | None = None) -> None:
        """Add ``event`` to the composition ``accountant`` (empty) names; None: RDP, or theorems for a ``DpEvent``.

        Raises:
            ValueError: ``accountant`` holds releases.
        """
        if accountant is None:
            (self.dp if isinstance(event, DpEvent) else self.rdp).compose(event)
            return
        if accountant.releases:
            raise ValueError("a ledger composition is named by an empty accountant")
        key = composition_key(accountant)
        if key not in self.composed:
            self.composed[key] = accountant_from_state(accountant.to_state())
        self.composed[key].compose(event)

    def epsilon(self, delta: float) -> float:
        """Epsilon of everything composed, at total ``delta``."""
        parts = [acc for acc in (self.rdp, self.dp, *self.composed.values()) if acc.releases]
        if not parts:
            return 0.0
        share = delta / len(parts)
        return math.fsum(self._exact(acc).epsilon(share) for acc in parts)

    @staticmethod
    def _exact(acc: RdpAccountant | DpCompositionAccountant) -> GdpAccountant | RdpAccountant | DpCompositionAccountant:
        """The exact Gaussian-DP view of an RDP account that holds only unsampled Gaussians (tighter), else ``acc``."""
        if isinstance(acc, RdpAccountant) and acc.epsilon_rank() is not None:
            return GdpAccountant(acc.events)
        return acc

    def to_state(self) -> dict[str, Any]:
        state = {"rdp": self.rdp.to_state(), "dp": self.dp.to_state()}
        if self.composed:
            state["composed"] = {k: a.to_state() for k, a in sorted(self.composed.items())}
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Account:
        rdp, dp = accountant_from_state(state["rdp"]), accountant_from_state(state["dp"])
        if not isinstance(rdp, RdpAccountant) or not isinstance(dp, DpCompositionAccountant):
            raise ValueError("ledger account holds accountants of the wrong kind")
        composed = {str(k): accountant_from_state(v) for k, v in state.get("composed", {}).items()}
        if any(composition_key(a) != k for k, a in composed.items()):
            raise ValueError("ledger account holds a composition under another composition's name")
        return cls(rdp, dp, composed)


class ClientLedger:
    """The parsed ledger file of one partition (use :meth:`open` to read-modify-write it under a lock)."""

    def __init__(self, path: Path, data: dict[str, Any] | None = None) -> None:
        self.path = path
        data = data or {"version": _VERSION, "accounts": {}, "runs": {}}
        if data.get("version") not in _READS:
            raise ValueError(f"privacy ledger {path}: unknown version {data.get('version')!r}")
        self.accounts = {k: Account.from_state(v) for k, v in data["accounts"].items()}
        self.runs: dict[str, dict[str, Any]] = {str(k): dict(v) for k, v in data["runs"].items()}

    @staticmethod
    def file_for(directory: Path, partition_id: int) -> Path:
        return Path(directory) / f"client-{int(partition_id)}.json"

    @classmethod
    @contextmanager
    def open(cls, directory: Path, partition_id: int, *, write: bool = True) -> Iterator[ClientLedger]:
        """The ledger under an exclusive lock; written back atomically on normal exit when ``write``."""
        path = cls.file_for(directory, partition_id)
        with _locked(path):
            try:
                data = json.loads(path.read_text()) if path.exists() else None
            except json.JSONDecodeError as err:
                # A corrupt ledger must not read as "nothing spent".
                raise ValueError(f"privacy ledger {path} is unreadable ({err}); refusing to train") from err
            ledger = cls(path, data)
            yield ledger
            if write:
                ledger._save()

    @classmethod
    def run_secret(cls, directory: Path, partition_id: int, run_id: int, purpose: str,
                   make: Callable[[], bytes]) -> bytes:
        """The partition's secret ``purpose`` of run ``run_id``: the bytes of the first ``make()`` pinned.

        Kept in a file of its own beside the ledger, ``client-<partition-id>.run-<run-id>.<purpose>.secret``, mode
        0600 (the ledger file is not owner-only), written atomically under the ledger's lock when absent, so every
        task of the node reads the one pinned, whatever ``Context.state`` it starts on.  Deleting the file after the
        run forgets the secret.
        """
        path = Path(directory) / f"client-{int(partition_id)}.run-{int(run_id)}.{purpose}.secret"
        with _locked(cls.file_for(directory, partition_id)):
            if not path.exists():
                write_private(path, bytes(make()))
            return path.read_bytes()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_state(), indent=1))
        os.replace(tmp, self.path)

    def to_state(self) -> dict[str, Any]:
        return {"version": _VERSION, "accounts": {k: a.to_state() for k, a in sorted(self.accounts.items())},
                "runs": self.runs}

    # ------------------------------------------------------------------ queries
    def rounds(self, run_id: int) -> list[int]:
        """Rounds this node trained in run ``run_id``."""
        return [int(r) for r in self.runs.get(str(run_id), {}).get("rounds", [])]

    def spent(self, delta: float) -> dict[str, float]:
        """Epsilon spent per account at ``delta``."""
        return {k: a.epsilon(delta) for k, a in self.accounts.items()}

    def projected(self, events: Mapping[str, Event], delta: float, accountant: Accountant | None = None
                  ) -> dict[str, float]:
        """Epsilon per account if ``events`` were composed too (``accountant``: :meth:`Account.compose`'s; no change)."""
        return _projected(self.accounts, events, delta, accountant)

    def run_accounts(self, run_id: int) -> dict[str, Account]:
        """What run ``run_id`` alone spent, per account (its releases and their recovery top-ups).

        A run whose rounds were recorded by a ledger without per-run accounts takes the node's accounts (a bound:
        what it spent before cannot be told apart).
        """
        run = self.runs.get(str(run_id), {})
        states = run.get("accounts", {}) if "accounts" in run or not run.get("rounds") else self.to_state()["accounts"]
        return {str(k): Account.from_state(v) for k, v in states.items()}

    def projected_run(self, run_id: int, events: Mapping[str, Event], delta: float,
                      accountant: Accountant | None = None) -> dict[str, float]:
        """Epsilon per account of run ``run_id`` alone if ``events`` were composed too (no change)."""
        return _projected(self.run_accounts(run_id), events, delta, accountant)

    # ------------------------------------------------------------------ update
    def record(self, run_id: int, method: str, rnd: int, events: Mapping[str, Event],
               accountant: Accountant | None = None) -> None:
        """Compose one round's releases (``accountant``: :meth:`Account.compose`'s) and remember the round of the run."""
        run = self.runs.setdefault(str(run_id), {"method": method, "rounds": []})
        run["rounds"] = sorted({*run["rounds"], int(rnd)})
        self.charge(run_id, events, accountant)

    def pin_outcome(self, run_id: int, rnd: int, digest: bytes) -> bytes:
        """The outcome digest of round ``rnd`` of run ``run_id`` this node signs and answers: the first one pinned.

        Pins ``digest`` when the round has none yet, and returns the pinned one (compare it with ``digest``).  Kept
        in the ledger, under its lock: Flower's SuperNode may start a message's ClientApp on ``Context.state`` from
        before the previous message's (a ClientApp saves it only at exit), so only the ledger sees every message.
        """
        return self._pin(run_id, "outcomes", str(int(rnd)), digest)

    def pin_node(self, run_id: int, node_id: int) -> int:
        """The Flower node this ledger serves in run ``run_id``: the first one pinned (as :meth:`pin_outcome`).

        Two nodes whose messages reach one ledger file (the same ``ledger-dir`` and ``partition-id``) would share
        its account, its pins and its secrets; the caller refuses a node other than the pinned one.
        """
        return int.from_bytes(self._pin(run_id, "pins", "node", int(node_id).to_bytes(8, "big")), "big")

    def pin_settings(self, run_id: int, digest: bytes) -> bytes:
        """The settings digest this node acts on in run ``run_id``: the first one pinned (as :meth:`pin_outcome`)."""
        return self._pin(run_id, "pins", "settings", digest)

    def recovery_charged(self, run_id: int, rnd: int, digest: bytes) -> bool:
        """Whether the recovery top-up of round ``rnd``'s outcome ``digest`` is charged in run ``run_id``."""
        charged = self.runs.get(str(run_id), {}).get("recovery-charged", {})
        return bytes(digest).hex() in charged.get(str(int(rnd)), [])

    def mark_recovery_charged(self, run_id: int, rnd: int, digest: bytes) -> None:
        """Record that the recovery top-up of round ``rnd``'s outcome ``digest`` is charged (:meth:`recovery_charged`)."""
        charged = self.runs.setdefault(str(run_id), {"rounds": []}).setdefault("recovery-charged", {})
        digests = charged.setdefault(str(int(rnd)), [])
        if bytes(digest).hex() not in digests:
            digests.append(bytes(digest).hex())

    def _pin(self, run_id: int, section: str, key: str, value: bytes) -> bytes:
        """``runs[run_id][section][key]``, set to ``value`` when absent (hex in the file)."""
        pins = self.runs.setdefault(str(run_id), {"rounds": []}).setdefault(section, {})
        return bytes.fromhex(pins.setdefault(key, bytes(value).hex()))

    def charge(self, run_id: int, events: Mapping[str, Event], accountant: Accountant | None = None) -> None:
        """Compose ``events`` into the node's and run ``run_id``'s accounts without recording a new round.

        E.g. a round topped up after its dropout recovery.
        """
        run_accounts = self.run_accounts(run_id)
        for key, event in events.items():
            self.accounts.setdefault(key, Account()).compose(event, accountant)
            run_accounts.setdefault(key, Account()).compose(event, accountant)
        run = self.runs.setdefault(str(run_id), {"rounds": []})
        run["accounts"] = {k: a.to_state() for k, a in sorted(run_accounts.items())}


@contextmanager
def _locked(ledger: Path) -> Iterator[None]:
    """An exclusive lock on the ledger file ``ledger`` (its ``.lock`` sibling), its folder made when missing."""
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with open(ledger.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _projected(accounts: Mapping[str, Account], events: Mapping[str, Event], delta: float,
               accountant: Accountant | None) -> dict[str, float]:
    """Epsilon per account of ``accounts`` with ``events`` composed into copies."""
    out = {k: a.epsilon(delta) for k, a in accounts.items()}
    for key, event in events.items():
        acc = Account.from_state(accounts[key].to_state()) if key in accounts else Account()
        acc.compose(event, accountant)
        out[key] = acc.epsilon(delta)
    return out
