"""The client's privacy floor and ledger, around every train handler.

* :func:`admit` (called by the ClientApp before any method handler runs): the node's
  policy (:class:`protocols.floor.FloorPolicy`, from its node config) against the run
  config, the round number against ``num-rounds`` and the rounds this node already
  trained in the run, and a lifetime budget that is already spent.
* :func:`release` (called by every method handler with the privacy events of its
  upload, before anything leaves the node): refuses when the release would take the
  node past its lifetime budget or the method adds no noise a node policy asks for,
  records the release in the node's persistent ledger (:mod:`client.ledger`) and
  returns the :class:`protocols.wire.ledger.SpentReport` metrics for the reply.
* :func:`check_trust` (called by :func:`client.methods.train_phase` and :func:`client.methods.query_phase` before
  any handler): the trust assumptions the run config sizes the node's noise for (colluding fractions, thresholds,
  declared by the cards' ``option(trust=...)``) against those its node config pins.
* :func:`top_up` (called by :mod:`client.recovery` before a recovery answer leaves the node): what revealing the
  pair material of the neighbours a request names gone strips from the round's noise beyond its charge, refused
  past the same limits.

A refusal is a :class:`protocols.floor.FloorViolation` raised from the handler: Flower
turns it into an error reply whose reason names the parameter; nothing is uploaded.
The per-method floors (the noise a method owes the client, recomputed from the run
config) live in :mod:`protocols.floor` and are checked by the handlers themselves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from contextlib import nullcontext

from flwr.app import Message

from client.env import ClientEnv
from client.ledger import ClientLedger, ledger_dir
from protocols.floor import RTOL, FloorPolicy, FloorViolation, at_most, check_round
from protocols.methods import Guarantee, method_spec
from protocols.options import ConfigError, MethodOptions, in_range
from protocols.privacy import Accountant, Event, GaussianEvent, per_record
from protocols.wire.common import PEAK_RSS_MB, TrainIns
from protocols.wire.ledger import SpentReport

__all__ = ["FloorViolation", "admit", "check_new_round", "check_trust", "guarantee", "policy", "release", "top_up",
           "trust_minimum"]


def policy(env: ClientEnv) -> FloorPolicy:
    """The node's floor policy (node config; every key optional)."""
    return FloorPolicy.from_node_config(env.context.node_config)


def _ledger(env: ClientEnv, *, write: bool = True):
    return ClientLedger.open(ledger_dir(env.context.node_config), env.partition_id, write=write)


def _worst(spent: Mapping[str, float]) -> tuple[str, float]:
    return max(spent.items(), key=lambda kv: kv[1], default=("", 0.0))


def guarantee(env: ClientEnv) -> Guarantee:
    """What the method's epsilon protects (unit, and whether the uploads carry a guarantee): the registry's word."""
    return method_spec(env.cfg.method).guarantee(env.cfg.privacy_unit)


def _trust_keys(env: ClientEnv) -> Iterator[tuple[MethodOptions, str, str]]:
    """(the run's options, trust key, direction) of every trust assumption the run's method declares."""
    for cls in method_spec(env.cfg.method).options:
        for key, direction in cls.trust_keys().items():
            yield env.cfg.options_of(cls), key, direction


def _node_options(env: ClientEnv, opts: MethodOptions, key: str) -> MethodOptions | None:
    """``opts`` with trust key ``key`` at the node's value, or None where the node states none.

    The node's value: its node config's ``key``; else, for a node whose policy asks for a guarantee, the key's
    documented default (the assumption the method's guarantee is stated for).  Raises ValueError for a node
    config value of the wrong type or out of the key's range.
    """
    f, nc = opts.keys()[key], env.context.node_config
    if key in nc:
        try:
            value = _pinned(f.default, nc[key])
            m = f.metadata
            in_range(key, float(value), m["low"], m["high"], low_open=m["low_open"], high_open=m["high_open"])
        except (TypeError, ValueError, ConfigError) as err:
            raise ValueError(f"node config '{key}' = {nc[key]!r}: {err}") from err
    elif policy(env).wants_guarantee:
        value = f.default
    else:
        return None
    return dataclasses.replace(opts, **{f.name: value})


def _pinned(default: object, raw: object) -> object:
    """A node-config value of a trust key, typed as the key's ``default`` (ValueError: a fraction for an integer key)."""
    if isinstance(default, bool) or not isinstance(default, int | float):
        return raw
    value = float(raw)  # type: ignore[arg-type]
    if isinstance(default, int):
        if not value.is_integer() or value < 0:
            raise ValueError("a non-negative integer is needed")
        return int(value)
    return value


def trust_minimum(env: ClientEnv, key: str) -> float | None:
    """The node's value of trust key ``key`` (:func:`check_trust`; None: the node states none).

    For a handler's own per-round check (e.g. against the round's servers or sizes).
    """
    for opts, k, _ in _trust_keys(env):
        if k == key:
            node = _node_options(env, opts, key)
            return None if node is None else float(getattr(node, opts.keys()[key].name))
    return None


def check_trust(env: ClientEnv) -> None:
    """Refuse a run config that assumes less than this node's node config states (before any material leaves).

    For each trust key its method's options declare (``option(trust=...)``, e.g. ``ddpsa-collude-frac``,
    ``ddpsa-threshold``, ``niss-rho``, ``nadp-tau``, ``mask-corruption-rate``), the value the run config assumes
    (:meth:`~protocols.options.MethodOptions.assumed`) must be at least (``"at-least"``) or at most the node's:
    its node config's value, else the documented default where its policy asks for a guarantee.  The node never
    sizes its noise for its own value instead: its peers derive theirs and their pair seeds
    (:func:`protocols.identity.settings_digest`) from the run config.  Raises :class:`FloorViolation`.
    """
    for opts, key, direction in _trust_keys(env):
        node = _node_options(env, opts, key)
        if node is None:
            continue
        need, offered = node.assumed(key, env.cfg), opts.assumed(key, env.cfg)
        ok = offered >= need * (1 - RTOL) if direction == "at-least" else offered <= need * (1 + RTOL)
        if not ok:
            stated = (f"node config '{key}'" if key in env.context.node_config else
                      "the documented default, as node config 'max-epsilon-per-run' / 'lifetime-epsilon' asks for a "
                      f"guarantee (set node config '{key}' to accept less)")
            raise FloorViolation(key, _plain(offered), _plain(need), "the run config sizes this node's noise for a "
                                 f"weaker adversary (fewer colluders) than {stated}")


def _plain(value: float) -> float | int:
    return int(value) if math.isfinite(value) and value.is_integer() else value


def admit(msg: Message, env: ClientEnv) -> None:
    """Refuse a train message before any work: policy vs run config, round, an exhausted lifetime budget."""
    pol = policy(env)
    pol.check_run(env.cfg, protected=guarantee(env).uplink is not None)
    rnd = TrainIns.from_config(msg.content["config"]).round
    with _ledger(env, write=False) as led:
        check_round(rnd, env.cfg, led.rounds(env.context.run_id))
        if pol.lifetime_epsilon is not None:
            key, eps = _worst(led.spent(pol.lifetime_delta))
            at_most(f"lifetime-epsilon ({key})", eps, pol.lifetime_epsilon,
                    "this node's privacy ledger is spent (node config 'lifetime-epsilon')")


def check_new_round(env: ClientEnv, rnd: int, training: int | None = None) -> None:
    """Refuse work for round ``rnd`` (e.g. a share phase) unless it is a round this node may still train in.

    Rounds only move forward: a round at or before the last one this node trained in (its upload is out, its
    view and secrets are fixed) is refused, so a server cannot show the node another view of a round whose
    recovery it may still ask for.  ``training``: the round whose train message asks (its upload not yet in the
    ledger), which counts as trained in.  Raises :class:`FloorViolation`.
    """
    with _ledger(env, write=False) as led:
        used = led.rounds(env.context.run_id)
    check_round(rnd, env.cfg, used)
    last = max([*used, *([] if training is None else [training])], default=None)
    if last is not None and rnd <= last:
        raise FloorViolation("round", rnd, f"> {last}", "this node already trained in a later round"
                             if last != training else f"this node is training in round {training}: its view of "
                             "that round is the one the round's recovery counts on")


def release(msg: Message, env: ClientEnv, uplink: Event | None = None, downlink: Event | None = None,
            accountant: Accountant | None = None) -> dict[str, float]:
    """Check the lifetime budget and record the round's releases in the ledger, before anything leaves the node.

    ``uplink``: what the upload reveals to the server per the method's privacy unit; ``downlink``: the
    published model's part, when the client can tell it apart (else the uplink bounds it: post-processing).
    A method whose uploads carry no guarantee (registry, :attr:`protocols.methods.MethodSpec.privacy`:
    fedavg, cdp, the MP family) records an un-noised release (infinite epsilon) for the uplink.
    ``accountant``: the empty accountant of the composition the method's server charges these releases with
    (:meth:`client.ledger.Account.compose`; None: RDP, or composition theorems for a ``DpEvent``).
    A client-level release (``privacy-unit = "client"``, or a method without a unit) is charged to the ``record``
    accounts too (:func:`protocols.privacy.per_record`): the record budget spans every run, whatever its unit.
    Returns the :class:`~protocols.wire.ledger.SpentReport` metrics to merge into the reply.
    """
    g = guarantee(env)
    unit = g.unit if g.unit != "none" else "client"
    events: dict[str, Event] = {f"uplink/{unit}": uplink if g.uplink is not None and uplink is not None
                                else GaussianEvent(0.0)}
    if downlink is not None:
        events[f"downlink/{unit}"] = downlink
    eps, releases = _charge(env, TrainIns.from_config(msg.content["config"]).round, events, accountant, new_round=True)
    return SpentReport(eps, releases).to_metrics()


def top_up(env: ClientEnv, rnd: int, uplink: Event | None = None, downlink: Event | None = None,
           accountant: Accountant | None = None, *, ledger: ClientLedger | None = None) -> None:
    """Charge round ``rnd``'s releases what its dropout recovery strips beyond their charge, before it is answered.

    ``uplink`` / ``downlink``: the events to compose on top of what :func:`release` recorded for the round (None:
    nothing more), in the method's privacy unit (a client-level one also to the ``record`` accounts).  The round
    stays recorded once.  ``ledger``: the node's ledger, already open under its lock (None: opened here).  Raises
    :class:`FloorViolation` when the top-up would take the node past its lifetime budget, or leave it without a
    finite epsilon while its policy wants a guarantee: nothing is charged then.
    """
    g = guarantee(env)
    unit = g.unit if g.unit != "none" else "client"
    events = {f"{d}/{unit}": e for d, e in (("uplink", uplink), ("downlink", downlink)) if e is not None}
    if events:
        _charge(env, rnd, events, accountant, new_round=False, ledger=ledger)


def _charge(env: ClientEnv, rnd: int, events: dict[str, Event], accountant: Accountant | None, *,
            new_round: bool, ledger: ClientLedger | None = None) -> tuple[float, int]:
    """Compose ``events`` into the ledger under its lock, after the policy's checks; (worst epsilon, rounds released).

    ``new_round``: a new release of round ``rnd`` (refused when the round was trained in already, then recorded);
    else a top-up of a round already recorded.  A client-level release spends every record's budget too, at
    twice its sensitivity (:func:`protocols.privacy.per_record`).  ``ledger``: already open under its lock (None:
    opened here).
    """
    pol = policy(env)
    g = guarantee(env)
    protected, unit = g.uplink is not None, g.unit if g.unit != "none" else "client"
    events = dict(events)
    if any(key.endswith("/client") for key in events):
        events.update({f"{key.split('/')[0]}/record": per_record(event) for key, event in list(events.items())})
    pol.check_run(env.cfg, protected=protected)
    with nullcontext(ledger) if ledger is not None else _ledger(env) as led:
        if new_round:
            check_round(rnd, env.cfg, led.rounds(env.context.run_id))  # again, under the lock
        key, eps = _worst(led.projected(events, pol.lifetime_delta, accountant))
        what = "this round's upload" if new_round else f"revealing round {rnd}'s dropout recovery"
        if pol.wants_guarantee and not math.isfinite(eps):  # e.g. layers sent bare, a noiseless diagnostic
            raise FloorViolation(f"epsilon ({key})", eps, "finite", f"{what} would leave this node without "
                                 "a guarantee (node config 'max-epsilon-per-run' / 'lifetime-epsilon')")
        if pol.lifetime_epsilon is not None:
            at_most(f"lifetime-epsilon ({key})", eps, pol.lifetime_epsilon,
                    f"{what} would take the node past its lifetime budget (node config 'lifetime-epsilon')")
        if pol.max_epsilon_per_run is not None:  # what this run spends in its own unit, recovery top-ups included
            own = {k: v for k, v in led.projected_run(env.context.run_id, events, run_delta(pol, env.cfg.delta),
                                                      accountant).items() if k.endswith(f"/{unit}")}
            key, run_eps = _worst(own)
            at_most(f"max-epsilon-per-run ({key})", run_eps, pol.max_epsilon_per_run,
                    f"{what} would take this run past the node's per-run budget (node config 'max-epsilon-per-run')")
        if new_round:
            led.record(env.context.run_id, env.cfg.method, rnd, events, accountant)
        else:
            led.charge(env.context.run_id, events, accountant)
        return eps, len(led.rounds(env.context.run_id))


def run_delta(pol: FloorPolicy, delta: float) -> float:
    """The delta a run's spend is read at against ``max-epsilon-per-run`` (the run's, bounded by the node's).

    The run's ``delta``, or ``lifetime-delta`` where smaller and the node sets no ``max-delta``: the run config's
    delta is the server's choice, and a run asking ``delta = 0.9`` read there passed a per-run budget of 1 with noise
    for (1, 0.9) (ldp, 10 rounds: noise multiplier 1.29 instead of 12.8, epsilon 12.9 at delta 1e-5).
    """
    return delta if pol.max_delta is not None else min(delta, pol.lifetime_delta)


#: Train-reply metrics computed on the node's data without noise (on a model the server chose), and the peak memory
#: of the process that trained on it.
UNPROTECTED_METRICS = ("train_loss", "clipped_fraction", "update_norm", PEAK_RSS_MB)


def diagnostics_permitted(env: ClientEnv) -> bool:
    """Whether this node may send measured-noise diagnostics the run config asks for (``cancellation-check``).

    They reveal part of an upload's noise, so a node whose policy asks for a guarantee sends them only where its
    operator allows diagnostics (:func:`protocols.wire.common.diagnostics_allowed`).
    """
    from protocols.wire.common import diagnostics_allowed

    return diagnostics_allowed() or not policy(env).wants_guarantee


def withhold_unprotected(reply: Message, env: ClientEnv) -> Message:
    """``reply`` without :data:`UNPROTECTED_METRICS` when the node's policy asks for a guarantee (else as is).

    A training loss or clipped fraction of one full-batch step on the server's model is a noiseless statistic of
    the node's data; the server reads their absence as "not reported".
    """
    if reply.has_error() or not policy(env).wants_guarantee or "metrics" not in reply.content:
        return reply
    metrics = reply.content["metrics"]
    for key in UNPROTECTED_METRICS:
        if key in metrics:
            del metrics[key]
    return reply
