"""A lying server's side of the unmasking phase, driving the real client handlers (consistency, then recover)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flwr.app import ConfigRecord, Message, RecordDict

from client.consistency import handle_consistency
from client.env import ClientEnv
from client.recovery import handle_recover
from protocols.consistency import SignedOutcome
from protocols.wire.consistency import CONSISTENCY_RECORD, ConsistencyReply, ConsistencyRequest, SignedOutcomes
from protocols.wire.recovery import RecoveryReply, RecoveryRequest


def sign(grid, nodes: Iterable[int], received, dropped=(), excluded=(), rnd: int = 1) -> dict[int, ConsistencyReply]:
    """Ask each of ``nodes`` to sign the outcome (``received``, ``dropped``, ``excluded``); node -> its reply."""
    req = ConfigRecord(ConsistencyRequest(rnd, tuple(sorted(received)), tuple(sorted(dropped)),
                                          tuple(sorted(excluded))).to_config())
    out = {}
    for node in nodes:
        reply = handle_consistency(Message(RecordDict({"config": req}), node, "query.consistency"),
                                   ClientEnv.from_context(grid.contexts[node]))
        out[node] = ConsistencyReply.from_config(reply.content["config"])
    return out


def signed(replies: Mapping[int, ConsistencyReply]) -> SignedOutcomes:
    """The signatures among ``replies`` (refusals left out), as the recovery request carries them."""
    return SignedOutcomes(tuple(SignedOutcome(n, r.name, r.signature) for n, r in sorted(replies.items())
                                if not r.refused))


def recover(grid, node: int, received, dropped, *, forwarded=None, excluded=(), signatures: SignedOutcomes | None = None,
            rnd: int = 1) -> RecoveryReply:
    """Send ``node`` a recovery request (with ``signatures`` when given) and parse its reply."""
    content = RecordDict({"config": ConfigRecord(RecoveryRequest(rnd, tuple(sorted(received)), tuple(sorted(dropped)),
                                                                 tuple(sorted(excluded)), forwarded).to_config())})
    if signatures is not None and signatures.entries:
        content[CONSISTENCY_RECORD] = ConfigRecord(signatures.to_config())
    reply = handle_recover(Message(content, node, "query.recover"), ClientEnv.from_context(grid.contexts[node]))
    return RecoveryReply.from_config(reply.content["config"])


def sign_and_recover(grid, node: int, received, dropped, *, forwarded=None, excluded=(), signers: Iterable[int] = (),
                     rnd: int = 1) -> RecoveryReply:
    """One consistent lie: ``node`` and ``signers`` sign the outcome, then ``node`` is asked with their signatures."""
    replies = sign(grid, {node, *signers}, received, dropped, excluded, rnd)
    return recover(grid, node, received, dropped, forwarded=forwarded, excluded=excluded, rnd=rnd,
                   signatures=signed(replies))
