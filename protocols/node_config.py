"""The node-config keys cancelfl reads, in one place, and the check that refuses a misspelt one.

A node's protection rests on keys its operator writes in its node config (``flower-supernode --node-config
'...'``): the policy (:data:`POLICY_KEYS`), the trust assumptions every registered method declares with
``option(trust=...)``, its identity, ledger and intermediate servers.  A key the node does not read is ignored,
so ``max-epsilon-per-rnu = 1`` or ``lifetime_epsilon = 3`` would leave the node training under whatever the server
asks.  :func:`check_node_config` (run by the ClientApp before it answers any message, and by the launchers that take
a node config) refuses a key that is not one of :func:`known_keys` but a near miss of one (:func:`intended_key`);
any other key is left alone, for a ClientApp of your own may read keys of its own.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

__all__ = ["BASE_KEYS", "DATA_CACHE", "DDPSA_CA", "DDPSA_SERVERS", "IDENTITY_KEY", "LEDGER_DIR", "NUM_PARTITIONS",
           "PARTITION_ID", "POLICY_KEYS", "REQUIRE_IDENTITY", "ROSTER", "NEAR_MISS_CUTOFF", "TRUSTED_FAB",
           "NodeConfigError", "check_node_config", "intended_key", "known_keys", "run_config_keys", "trusted_fabs"]

#: This node's partition and the federation's size (Flower's simulation sets both; a SuperNode takes them from
#: ``--node-config``).
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
#: Folder of the node's privacy ledger (:mod:`client.ledger`).
LEDGER_DIR = "ledger-dir"
#: The node's Ed25519 identity, the roster it trusts, and whether it refuses to run without them
#: (:mod:`client.identity`).
IDENTITY_KEY = "identity-key"
ROSTER = "roster"
REQUIRE_IDENTITY = "require-identity"
#: The DDP-SA intermediate servers and their CA this node pushes its shares to (:mod:`client.methods.ddpsa`).
DDPSA_SERVERS = "ddpsa-servers"
DDPSA_CA = "ddpsa-ca"
#: Folder of the node's partition cache (:mod:`protocols.task.partition_cache`).
DATA_CACHE = "data-cache"
#: SHA-256 of the FABs (Flower app bundles) the node runs, comma-separated (:mod:`server.fab_pin`).
TRUSTED_FAB = "trusted-fab"
#: The node's policy (:class:`protocols.floor.FloorPolicy`): its field -> node-config key.
POLICY_KEYS = {"max_epsilon_per_run": "max-epsilon-per-run", "max_delta": "max-delta", "max_clip": "max-clip",
               "lifetime_epsilon": "lifetime-epsilon", "lifetime_delta": "lifetime-delta"}
#: Every key above: what the node reads whatever its method.
BASE_KEYS: frozenset[str] = frozenset({PARTITION_ID, NUM_PARTITIONS, LEDGER_DIR, IDENTITY_KEY, ROSTER,
                                       REQUIRE_IDENTITY, DDPSA_SERVERS, DDPSA_CA, DATA_CACHE, TRUSTED_FAB,
                                       *POLICY_KEYS.values()})
#: ``difflib`` similarity from which an unknown key counts as a misspelling of a known one: one wrong, missing or
#: swapped character in a key of eight or more (``nadp-tua``, ``max-epsilon-per-rnu``), not a key of one's own
#: that merely shares a word (``data-path`` against ``data-cache``: 0.74, ``max-data`` against ``max-delta``: 0.82).
NEAR_MISS_CUTOFF = 0.85


class NodeConfigError(ValueError):
    """A node-config key that is a near miss of a key cancelfl reads: the node would run without the intended one.

    ``intended`` None: the key is a run-config key a node cannot set (the server's run config sets it);
    ``reason``: another refusal of ``key``, in these words.
    """

    def __init__(self, key: str, intended: str | None, reason: str | None = None) -> None:
        self.key, self.intended = key, intended
        if reason is not None:
            super().__init__(f"node config '{key}': {reason}")
            return
        if intended is None:
            super().__init__(f"node config '{key}' is a run-config key, which the server's run config sets: in a "
                             "node config it would be ignored. A node bounds what a run may ask with "
                             f"{', '.join(sorted(POLICY_KEYS.values()))} and pins the trust keys of its methods "
                             "(docs/privacy.md, node policy)")
            return
        super().__init__(f"node config '{key}' is not one of cancelfl's node-config keys: did you mean '{intended}'? "
                         f"Refused, as the node would run without its '{intended}' (rename the key; a key of your own "
                         "ClientApp must not be a near miss of one of them)")


def known_keys() -> frozenset[str]:
    """Every node-config key cancelfl reads: :data:`BASE_KEYS` and each registered method's trust keys.

    A trust key is a run-config key a method's options declare with ``option(trust=...)``
    (:meth:`protocols.options.MethodOptions.trust_keys`), a plugin's included: a node pins it in its node config.
    """
    from protocols.methods import options_classes

    return BASE_KEYS | {key for cls in options_classes() for key in cls.trust_keys()}


def run_config_keys() -> frozenset[str]:
    """Every run-config key: :class:`protocols.config.RunConfig`'s own and every registered method's options."""
    from protocols.config import RunConfig, common_fields
    from protocols.methods import options_classes

    common = {RunConfig.key_of(f.name) for f in common_fields()}
    return frozenset(common | {key for cls in options_classes() for key in cls.keys()})


def _plain(key: str) -> str:
    return key.casefold().replace("_", "-")


def intended_key(key: str, known: Iterable[str]) -> str | None:
    """The key of ``known`` that ``key`` misspells, or None (``key`` itself known, or not near any).

    A near miss: equal once case is folded and ``_`` read as ``-`` (``lifetime_epsilon``), else the closest known key
    with a :mod:`difflib` similarity of at least :data:`NEAR_MISS_CUTOFF` to that form (``max-epsilon-per-rnu``).
    """
    known = sorted(known)
    if key in known:
        return None
    plain = {_plain(k): k for k in known}
    if _plain(key) in plain:
        return plain[_plain(key)]
    close = difflib.get_close_matches(_plain(key), list(plain), n=1, cutoff=NEAR_MISS_CUTOFF)
    return plain[close[0]] if close else None


def check_node_config(node_config: Mapping[str, object]) -> None:
    """Refuse a near miss of a key cancelfl reads, or a run-config key a node cannot set; other unknown keys pass.

    ``epsilon = 1`` in a node config does not bound a run (``max-epsilon-per-run`` does): it is refused.  So is
    ``ddpsa-servers`` without ``ddpsa-ca`` or the reverse: the node would check its pinned servers against the run
    config's CA, the parameter server's choice, or trust the run config's servers.

    Raises:
        NodeConfigError: naming the first such key (in sorted order) and the key it likely means, or the half of
            the DDP-SA pin that is set.
    """
    known, run_keys = known_keys(), run_config_keys()
    for key in sorted(map(str, node_config)):
        if key in run_keys and key not in known:
            raise NodeConfigError(key, None)
        intended = intended_key(key, known)
        if intended is not None:
            raise NodeConfigError(key, intended)
    pinned = [key for key in (DDPSA_SERVERS, DDPSA_CA) if str(node_config.get(key, "")).strip()]
    if len(pinned) == 1:
        other = DDPSA_CA if pinned[0] == DDPSA_SERVERS else DDPSA_SERVERS
        raise NodeConfigError(pinned[0], None, f"set '{other}' with it: the intermediate servers a node pins are "
                              "checked against the CA it pins, never against the run config's (the parameter "
                              "server's choice)")


def trusted_fabs(node_config: Mapping[str, object]) -> frozenset[str] | None:
    """The FAB hashes node-config ``trusted-fab`` pins (lower-case hex SHA-256), or None when the key is absent.

    Raises:
        ValueError: a value that is not a comma-separated list of 64-digit hex SHA-256 digests.
    """
    if TRUSTED_FAB not in node_config:
        return None
    raw = str(node_config[TRUSTED_FAB])
    pins = frozenset(part.strip().lower() for part in raw.replace(" ", ",").split(",") if part.strip())
    bad = sorted(p for p in pins if len(p) != 64 or any(c not in "0123456789abcdef" for c in p))
    if not pins or bad:
        raise ValueError(f"node config '{TRUSTED_FAB}' = {raw!r} must list the SHA-256 (64 hex digits) of each FAB the "
                         "node runs, comma-separated (`cancelfl keys fab-hash` prints an app's)")
    return pins
