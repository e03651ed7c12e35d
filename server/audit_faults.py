"""Planted faults in the real release code, for the audit's own tests (:func:`planted`).

* ``halve-noise``: the method's Gaussian std halved where its clients draw it (ddpsa: its Laplace scale).
* ``skip-pair-noise``: one nadp client uploads without its pair noise.
* ``private-kl``: ladp's P_j computed from the client's trained local model (the paper's Algorithm 3) instead of
  the server's public estimate.
* ``strip-pair-noise`` (server side, run by the release itself, :mod:`server.audit_release`): the server tells
  every neighbour of one client that it dropped while holding its upload, and removes the revealed pair noise
  from it; planted with ``self-mask = false`` (with double masking the clients refuse).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["planted"]


@contextlib.contextmanager
def planted(fault: str | None, victim: Callable[[], int | None], method: str = "") -> Iterator[None]:
    """Patch the release code of ``method`` with ``fault`` for the duration (module attributes the handlers look up).

    ``victim()``: the node id of the client a per-client fault hits (the first participant of the release).
    """
    if fault is None or fault == "strip-pair-noise":  # the server-side fault is run by the audit itself
        yield
        return
    patches: list[tuple[object, str, object]] = []
    if fault == "halve-noise" and method == "ddpsa":
        import client.methods.ddpsa as ddpsa_client

        # The Laplace scale of the local noise or of the distributed share (a Gamma difference) halved; the PRG's
        # normals stay as they are (the Gamma sampler draws from them).
        for name in ("laplace_noise", "distributed_laplace_share"):
            orig_noise = getattr(ddpsa_client, name)
            patches.append((ddpsa_client, name, orig_noise))
            setattr(ddpsa_client, name, (lambda f: lambda size, scale, *a, **k: f(size, scale / 2, *a, **k))(orig_noise))
    elif fault == "halve-noise":
        import client.methods.nadp as nadp_client
        import protocols.prg as prg

        def halved(orig):
            return lambda seed, size, std=1.0, *a, **k: orig(seed, size, std / 2, *a, **k)

        # ldp, cdp and niss (its shares and distortions) call protocols.prg.gaussian when they release; nadp holds
        # its own reference.
        for mod in (prg, nadp_client):
            patches.append((mod, "gaussian", mod.gaussian))
            mod.gaussian = halved(mod.gaussian)
        orig_pairs = nadp_client.pairwise_noise
        patches.append((nadp_client, "pairwise_noise", orig_pairs))
        nadp_client.pairwise_noise = lambda *a, scale=1.0, **k: orig_pairs(  # type: ignore[assignment]
            *a, scale={j: s / 2 for j, s in scale.items()} if isinstance(scale, dict) else scale / 2, **k)
    elif fault == "skip-pair-noise":
        import client.methods.nadp as nadp_client

        orig = nadp_client.pairwise_noise
        patches.append((nadp_client, "pairwise_noise", orig))

        def skipping(own_id, seeds, size, **kw):
            return np.zeros(size) if own_id == victim() else orig(own_id, seeds, size, **kw)

        nadp_client.pairwise_noise = skipping  # type: ignore[assignment]
    elif fault == "private-kl":
        import client.methods.ladp as ladp_client
        from protocols.ladp import softmax_kl

        patches.append((ladp_client, "privacy_estimates", ladp_client.privacy_estimates))
        ladp_client.privacy_estimates = lambda msg, local_w, global_w: {  # type: ignore[assignment]
            name: softmax_kl(local_w[name], global_w[name]) for name in local_w}
    try:
        yield
    finally:
        for mod, name, value in reversed(patches):
            setattr(mod, name, value)
