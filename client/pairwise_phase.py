"""Client side of the key-exchange phase shared by every pairwise-noise method.

``handle_keys`` answers ``query.keys`` with a fresh X25519 public key for the
server's key epoch (run-config ``key-rotation``) and keeps the private key in
``Context.state`` (the only storage that survives between phases and rounds:
in deployment every message runs in a new process).  ``pair_seeds`` derives one
32-byte seed per neighbour with HKDF, separated by purpose, round, pair and run
id, so no seed is ever reused even when the key pair lives for many rounds.
The X25519 shared secrets of an epoch are cached next to the private key
(keyed by the peer's id *and* public key, so a re-keyed peer is agreed anew).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from protocols.keyagreement import agree_many, derive_pair_seed, generate_keypair, keypair_from_private
from protocols.prg import gaussian

STATE_KEY = "cancelfl-keys"


def _epoch_of(cfg) -> int:
    """Key epoch named by the server (every key and peer-key message carries it)."""
    if "key-epoch" not in cfg:
        raise ValueError("message lacks 'key-epoch': cannot tell which key pair the peer keys belong to")
    return int(cfg["key-epoch"])


def handle_keys(msg: Message, env: ClientEnv) -> Message:
    """Make the key pair of the server's key epoch, store the private half, return the public half.

    The reply also carries ``num-examples`` (the local dataset size |D_i|),
    which methods whose noise allocation depends on public dataset sizes
    (nadp) need before training; other methods ignore it.
    """
    epoch = _epoch_of(msg.content["config"])
    kp = generate_keypair()
    # Keep only the current epoch's key (and no cached secret of an older one).
    env.context.state[STATE_KEY] = ConfigRecord({"epoch": epoch, "private": kp.private_bytes})
    return Message(RecordDict({"config": ConfigRecord({"public-key": kp.public_bytes,
                                                        "num-examples": len(env.y)})}), reply_to=msg)


def peers(msg: Message) -> list[int]:
    """Neighbour node ids sent by the server for this round."""
    return [int(p) for p in msg.content["config"]["peer-ids"]]


def pair_seeds(msg: Message, env: ClientEnv, purpose: str) -> dict[int, bytes]:
    """One seed per neighbour for ``purpose`` and this round (both ends derive the same value)."""
    cfg = msg.content["config"]
    rnd = int(cfg["round"])
    epoch = _epoch_of(cfg)
    stored = env.context.state.get(STATE_KEY)
    if stored is None or "epoch" not in stored or int(stored["epoch"]) != epoch:
        raise RuntimeError(f"no key pair for key epoch {epoch} (round {rnd}): the key phase did not run on this "
                           "node or its state was lost; the server re-keys it when it is next sampled")
    own = keypair_from_private(stored["private"])
    cache = {(int(p), bytes(k)): bytes(s) for p, k, s in
             zip(stored.get("peer-ids", []), stored.get("peer-keys", []), stored.get("shared", []), strict=True)}
    ids, keys = peers(msg), [bytes(k) for k in cfg["peer-keys"]]
    if len(ids) != len(keys):
        raise ValueError(f"{len(ids)} peer ids but {len(keys)} peer keys")
    new = [(p, k) for p, k in zip(ids, keys, strict=True) if (p, k) not in cache]
    if new:
        cache.update(zip(new, agree_many(own, [k for _, k in new]), strict=True))
        # Store one secret per peer, for its latest key (new entries come last in the dict, so they win).
        latest = {p: (k, s) for (p, k), s in cache.items()}
        stored["peer-ids"] = [str(p) for p in latest]
        stored["peer-keys"] = [k for k, _ in latest.values()]
        stored["shared"] = [s for _, s in latest.values()]
        env.context.state[STATE_KEY] = stored  # (lists are never empty here: Flower cannot serialise [])
    context = int(env.context.run_id).to_bytes(8, "big")
    return {peer: derive_pair_seed(cache[(peer, pk)], purpose=purpose, round_num=rnd, node_a=env.node_id,
                                   node_b=peer, context=context)
            for peer, pk in zip(ids, keys, strict=True)}


def mask_probe(msg: Message, mask: np.ndarray) -> float:
    """Projection of the pairwise mask on the round's public random direction (cancellation check)."""
    seed = msg.content["config"]["probe-seed"]
    return float(np.dot(mask, gaussian(seed, len(mask))))
