"""Fault injection (TESTING AID, run-config ``fault-drop-rate``): which train replies the server's grid withholds.

In every round the round loop's grid (:class:`strategies.run.grid.MeteredGrid`, so under every engine:
in-process, Flower's simulation runtime, deployment) withholds the train messages of ``round(rate * n)`` of the
``n`` nodes that got one -- after the round's key / share phase, so their pair noise is fixed -- chosen
deterministically from (seed, round).  Those nodes take no further part in the round (e.g. the recovery phase):
to the server they are clients that dropped out.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Message

from protocols.config_checks import fault_withheld


def fault_drops(messages: list[Message], rate: float, seed: int, fallback_round: int = 1) -> tuple[int, set[int]]:
    """(round, nodes whose train message is withheld) of one phase's ``messages``; no nodes for other phases.

    Args:
        messages: the messages of one ``send_and_receive`` call.
        rate: fraction of the train messages' nodes to withhold, in [0, 1); at least one node always remains.
        seed: the run seed (with the round it fixes the choice).
        fallback_round: the round to use when the train config carries none.

    Returns:
        The round read from the train config and the withheld node ids (empty when ``rate`` is 0 or the
        messages are not train messages).
    """
    train = [m for m in messages if m.metadata.message_type == "train"]
    if rate <= 0 or not train:
        return fallback_round, set()
    try:
        rnd = int(train[0].content["config"]["round"])
    except (KeyError, TypeError, ValueError):
        rnd = fallback_round
    nodes = sorted(m.metadata.dst_node_id for m in train)
    count = fault_withheld(rate, len(nodes))
    rng = np.random.default_rng([int(seed), rnd, 0xFA17])
    return rnd, {nodes[int(i)] for i in rng.choice(len(nodes), size=count, replace=False)}
