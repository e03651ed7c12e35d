"""A malicious nadp server that leaves a client's honest neighbours out of a round, driving the real client code.

Eq. 8's ``lambda`` keeps each upload's own noise at ``sigma_up`` against a ``nadp-tau`` share of colluding peers.  The
present floor lets the server keep a client in a round with a few of its roster neighbours only: its colluders.
Counted on the present neighbourhood, ``lambda`` then covers fewer colluders than the roster's neighbourhood
holds, and the colluders' pair seeds strip the upload below ``sigma_up``.  The client counts them in its roster
neighbourhood and refuses the smaller ``lambda``; the honest server plans the same.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.records import to_record
from protocols.config import RunConfig
from protocols.floor import nadp_round_noise
from protocols.graphs import present_floor, roster_round_of
from protocols.schedule import roster_releases
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.keys import PeerKeys
from protocols.wire.nadp import NadpPlan
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.nadp import NadpStrategy


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _left(noise, node: int, colluders: int) -> float:
    """Std of ``node``'s own upload noise once ``colluders`` of its neighbours strip their pairs, over sigma_up."""
    a = noise.allocation
    honest = sorted(s * s for s in a.counteracting_stds(node).values())[:len(a.counteracting_stds(node)) - colluders]
    return math.sqrt(a.residual_std[node] ** 2 + noise.lam ** 2 * math.fsum(honest)) / a.weights[node] \
        / noise.sigmas.sigma_up


def test_nadp_leaving_honest_neighbours_out_does_not_shrink_the_coalition_lambda_covers():
    n, tau = 10, 0.2
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, "num-rounds": 3, "nadp-tau": tau, "hidden": "",
           "local-epochs": 1, "batch-size": 1000}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    ds = dataset_for(cfg)
    model = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    template = list(strategy.configure_train(1, to_record(model, np.float64), ConfigRecord({"round": 1}), grid))[0]
    k = template.metadata.dst_node_id
    env = ClientEnv.from_context(grid.contexts[k])
    roster = node_identity(env).roster
    pk = PeerKeys.from_config(template.content["config"])
    sizes0 = NadpPlan.from_config(template.content["config"]).sizes
    colluders = round(tau * n)  # Eq. 8: a tau share of the n clients collude against k ((1 - tau) n - 1 honest others)
    assert present_floor(n - 1, cfg.mask_corruption_rate) <= colluders + 1 < n - 1
    keep = {k, *pk.peer_ids[:colluders + 1]}  # the colluders and one honest neighbour
    names = dict(zip(pk.participants, pk.participant_names, strict=True))
    parts = tuple(p for p in pk.participants if p in keep)
    idx = [i for i, p in enumerate(pk.peer_ids) if p in keep]
    smaller = PeerKeys(tuple(pk.peer_ids[i] for i in idx), tuple(pk.peer_keys[i] for i in idx), pk.key_epoch,
                       roster_round_of(cfg, roster, 1).seed, pk.probe_seed, tuple(pk.peer_names[i] for i in idx),
                       tuple(pk.peer_signatures[i] for i in idx), parts, tuple(names[p] for p in parts))
    sizes = {p: sizes0[p] for p in parts}
    graph = {p: [q for q in parts if q != p] for p in parts}
    releases = roster_releases(cfg, roster)
    present = nadp_round_noise(cfg, sizes, graph, 1.0, releases)  # colluders counted among the present clients
    more = dataclasses.replace(present, lam=2.0)  # enough for the roster's colluders (a larger lambda is accepted)
    assert _left(present, k, colluders) < 0.75  # the colluders strip k's upload below sigma_up
    assert _left(more, k, colluders) >= 1.0
    for noise, accepted in ((present, False), (more, True)):
        plan = NadpPlan("nadp", tuple(sorted(parts)), sizes, noise.sigmas.sigma_up, noise.sigmas.sigma_down,
                        noise.lam, {}, 1.0)
        content = copy.deepcopy(template.content)
        content["config"].update({**plan.to_config(), **smaller.to_config()})
        reply = grid.send_and_receive([Message(content, k, "train")])[0]
        if accepted:
            assert not reply.has_error(), reply.error.reason
        else:
            assert reply.has_error(), "a lambda counted on the present neighbours was accepted"
            assert "nadp-lambda" in reply.error.reason, reply.error.reason


def test_nadp_a_train_message_without_the_probe_seed_spends_nothing():
    """``cancellation-check``: a train message lacking the probe seed is refused before the ledger records the round.

    The round's upload never leaves, so a charge would spend the node's budget for nothing the server got.
    """
    from client.ledger import ClientLedger, ledger_dir

    n = 4
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, "num-rounds": 2, "hidden": "", "local-epochs": 1,
           "batch-size": 1000, "cancellation-check": True, "mask-corruption-rate": 0.0}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    ds = dataset_for(cfg)
    model = to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)),
                      np.float64)
    msg = list(strategy.configure_train(1, model, ConfigRecord({"round": 1}), grid))[0]
    node = msg.metadata.dst_node_id
    del msg.content["config"]["probe-seed"]
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "probe-seed" in reply.error.reason, "a message without the probe seed was answered"
    ctx = grid.contexts[node]
    with ClientLedger.open(ledger_dir(ctx.node_config), ctx.node_config["partition-id"], write=False) as led:
        assert list(led.rounds(ctx.run_id)) == []
