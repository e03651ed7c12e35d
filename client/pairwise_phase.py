"""Client side of the key-exchange phase shared by every pairwise-noise method.

``handle_keys`` answers ``query.keys`` with a fresh X25519 public key and keeps
the private key in ``Context.state`` (the only storage that survives between
the phases of a round: in deployment every message runs in a new process).
``pair_seeds`` derives one 32-byte seed per neighbour with HKDF, separated by
purpose, round, pair and run id, so no seed is ever reused.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from protocols.keyagreement import agree, derive_pair_seed, generate_keypair, keypair_from_private
from protocols.prg import gaussian

STATE_KEY = "cancelfl-keys"


def handle_keys(msg: Message, env: ClientEnv) -> Message:
    """Make this round's key pair, store the private half, return the public half.

    The reply also carries ``num-examples`` (the local dataset size |D_i|),
    which methods whose noise allocation depends on public dataset sizes
    (nadp) need before training; other methods ignore it.
    """
    rnd = int(msg.content["config"]["round"])
    kp = generate_keypair()
    # Keep only the current round's key: older private keys are never needed again.
    env.context.state[STATE_KEY] = ConfigRecord({"round": rnd, "private": kp.private_bytes})
    return Message(RecordDict({"config": ConfigRecord({"public-key": kp.public_bytes,
                                                        "num-examples": len(env.y)})}), reply_to=msg)


def peers(msg: Message) -> list[int]:
    """Neighbour node ids sent by the server for this round."""
    return [int(p) for p in msg.content["config"]["peer-ids"]]


def pair_seeds(msg: Message, env: ClientEnv, purpose: str) -> dict[int, bytes]:
    """One seed per neighbour for ``purpose`` (both ends derive the same value)."""
    cfg = msg.content["config"]
    rnd = int(cfg["round"])
    stored = env.context.state.get(STATE_KEY)
    if stored is None or int(stored["round"]) != rnd:
        raise RuntimeError(f"no key pair for round {rnd}: the key phase did not run on this node")
    own = keypair_from_private(stored["private"])
    context = int(env.context.run_id).to_bytes(8, "big")
    seeds = {}
    for peer, pk in zip(peers(msg), cfg["peer-keys"], strict=True):
        shared = agree(own, pk)
        seeds[peer] = derive_pair_seed(shared, purpose=purpose, round_num=rnd, node_a=env.node_id, node_b=peer,
                                       context=context)
    return seeds


def mask_probe(msg: Message, mask: np.ndarray) -> float:
    """Projection of the pairwise mask on the round's public random direction (cancellation check)."""
    seed = msg.content["config"]["probe-seed"]
    return float(np.dot(mask, gaussian(seed, len(mask))))
