"""Client side of the signed consistency check (``query.consistency``) of the double-masked methods.

:func:`handle_consistency` signs the round's outcome (:class:`~protocols.wire.consistency.ConsistencyRequest`)
with the node's Ed25519 roster identity after the checks of a recovery request
(:func:`client.recovery.check_request`: its own upload received, the round it uploaded in, every neighbour
received or dropped, no node both, nothing contradicting a request it already answered).  It signs one outcome
per round: the digest stays in ``Context.state`` (:attr:`client.recovery.RecoveryStore.signed`) and in the ledger
(:func:`client.recovery.pinned`), and a different outcome for the same round is refused.  The recovery phase then
reveals pair material only for that outcome and with enough signatures of it (:func:`client.recovery.unsigned`).
Protocol: :mod:`protocols.consistency`.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.identity import node_identity
from client.recovery import RecoveryStore, check_request, pinned
from protocols.consistency import consistency_statement, outcome_digest
from protocols.wire.consistency import ConsistencyReply, ConsistencyRequest
from protocols.wire.recovery import RecoveryRequest


def sign_outcome(env: ClientEnv, req: ConsistencyRequest) -> ConsistencyReply:
    """Sign the outcome ``req`` with this node's identity, or refuse naming why (see the module doc)."""
    store = RecoveryStore.load(env)
    outcome = RecoveryRequest(req.round, req.received, req.dropped, req.excluded)
    why = check_request(store, outcome, env.node_id, int(env.context.run_id))
    if why:
        return ConsistencyReply(refused=why)
    assert store is not None  # check_request refuses otherwise
    if not store.mask_keys:
        return ConsistencyReply(refused="this node's upload of the round is not self-masked: nothing to sign")
    digest = outcome_digest(req.round, req.received, req.dropped, req.excluded)
    if store.signed and store.signed != digest:
        return ConsistencyReply(refused=f"this node already signed a different outcome of round {req.round}")
    why = pinned(env, req.round, digest)
    if why:
        return ConsistencyReply(refused=why)
    me = node_identity(env)
    signature = me.identity.sign(consistency_statement(run_id=int(env.context.run_id), round_num=req.round,
                                                       name=me.name, node_id=env.node_id, digest=digest))
    if store.signed != digest:
        store.signed = digest
        store.save(env)
    return ConsistencyReply(me.name, signature)


def handle_consistency(msg: Message, env: ClientEnv) -> Message:
    """``query.consistency``: sign the round's outcome once (see :func:`sign_outcome`)."""
    try:
        req = ConsistencyRequest.from_config(msg.content["config"])
    except ValueError as err:
        out = ConsistencyReply(refused=f"malformed request ({err})")
    else:
        out = sign_outcome(env, req)
    return Message(RecordDict({"config": ConfigRecord(out.to_config())}), reply_to=msg)
