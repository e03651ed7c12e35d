"""Use a cancelfl method in your own Flower ClientApp, with your own PyTorch model and local data.

* :func:`attach` registers the method's train handler and its extra message phases (key exchange, share relay,
  dropout recovery) on your ``ClientApp``; ``load(context)`` returns your model and this node's data::

      app = ClientApp()
      attach(app, lambda context: (Net(), x_local, y_local))

* :func:`protect` handles one message inside a handler you write yourself and returns the reply to send.

The strategy sends its settings (``method``, ``epsilon``, ``clip``, ...) in every message
(:mod:`protocols.wire.settings`), so the client needs no run config; settings that differ from a key the
client's run config sets (its ``method``, ``epsilon``, ...) are refused, and so is a diagnostic
(``cancellation-check``) the client's own run config does not turn on.  The first message of a run pins its
settings (the node's ledger, :func:`pinned`): a later message of the run with other settings is refused, so a
server cannot recalibrate a run (e.g. announce ``num-rounds = r`` in round ``r``).
Premises of the protection: the method trains your model itself (a DP guarantee covers a training procedure,
not an arbitrary update), ``y`` holds integer class labels, and the model's ``state_dict`` keys match the
server's arrays.  Noise is drawn on the CPU from the OS CSPRNG; training runs on ``device``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from client.env import ClientEnv
from client.errors import sealed
from client.ledger import ClientLedger, ledger_dir
from client.methods import query_actions, query_phase, train_phase
from protocols.config import ConfigError, RunConfig, describe_changes
from protocols.node_config import check_node_config
from protocols.wire.settings import MISMATCH, settings_of

#: ``Context.state`` record of the settings this node pinned for its run: ``run-id`` and the mapping as ``json``.
PINNED_KEY = "cancelfl-run-settings"

#: ``load(context) -> (model, x, y)``: your model (a fresh instance) and this node's training data.
Loader = Callable[[Context], tuple[nn.Module, np.ndarray, np.ndarray]]


def client_env(context: Context, model: nn.Module, x: np.ndarray, y: np.ndarray,
               msg: Message | None = None) -> ClientEnv:
    """The method's view of this client: settings, identity, your data, copies of your model.

    Settings come from ``msg`` (what the strategy sent, checked against the run config and against the
    settings pinned by the run's first message, :func:`pinned`) or, without ``msg``, from the run config
    (ConfigError if it names no method, or a mismatch).  A node config holding a near miss of a key cancelfl reads
    is refused first (:func:`protocols.node_config.check_node_config`).
    """
    check_node_config(context.node_config)
    if msg is not None:
        cfg = pinned(context, settings_of(msg.content if msg.has_content() else None, context.run_config))
    else:
        cfg = RunConfig.from_mapping(context.run_config, strict=False)
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int64)
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"client data: {len(x)} samples and {len(y)} labels (need the same, at least one)")
    pid = int(context.node_config.get("partition-id", 0))
    nparts = int(context.node_config.get("num-partitions", 1))
    out_features = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    num_classes = out_features[-1] if out_features else int(y.max()) + 1
    return ClientEnv(cfg, context, int(context.node_id), pid, nparts, (x, y, num_classes, tuple(x.shape[1:])),
                     model_fn=lambda: copy.deepcopy(model))


def pinned(context: Context, cfg: RunConfig) -> RunConfig:
    """``cfg``, once it matches the settings of this run's first message.

    The first message of a run pins its node id and a digest of its settings in the node's ledger, under its lock
    (:meth:`client.ledger.ClientLedger.pin_settings`), and the settings themselves in ``context.state``: Flower's
    SuperNode may start a message's ClientApp on ``Context.state`` from before the previous message's, so only the
    ledger sees every message.  A message on a state holding the run's settings is checked against them (its
    refusal names the changed keys) without opening the ledger.

    Raises:
        ConfigError: (:data:`~protocols.wire.settings.MISMATCH`) ``cfg`` differs from the run's pinned settings; or
            the ledger already serves another node in this run (two nodes configured onto one ledger file).
    """
    run_id = str(context.run_id)  # text: a Flower run id is an unsigned 64-bit value
    text = json.dumps(cfg.to_mapping(), sort_keys=True)
    rec = context.state.get(PINNED_KEY)
    if isinstance(rec, ConfigRecord) and rec.get("run-id") == run_id:
        shown = describe_changes(json.loads(str(rec["json"])), cfg, "", "")
        if shown:
            raise _changed(run_id, f" ({shown})")
        return cfg
    digest = hashlib.sha256(text.encode()).digest()
    folder, pid = ledger_dir(context.node_config), int(context.node_config.get("partition-id", 0))
    with ClientLedger.open(folder, pid) as led:
        node = led.pin_node(int(context.run_id), int(context.node_id))
        first = led.pin_settings(int(context.run_id), digest)
    if node != int(context.node_id):
        raise ConfigError(f"node {context.node_id}: its ledger ({folder}, partition-id {pid}) already serves node "
                          f"{node} in run {run_id}; two nodes sharing one ledger would share its privacy account and "
                          "its secrets: give each node its own node config 'partition-id' or 'ledger-dir'")
    if first != digest:
        raise _changed(run_id, " (another message of the run pinned other settings)")
    context.state[PINNED_KEY] = ConfigRecord({"run-id": run_id, "json": text})
    return cfg


def _changed(run_id: str, shown: str) -> ConfigError:
    return ConfigError(f"{MISMATCH} the strategy's settings changed within run {run_id}{shown}; this node acts on the "
                       f"settings of the run's first message only, so the run must keep them (start a new run to "
                       f"change them)")


def protect(msg: Message, context: Context, model: nn.Module, x: np.ndarray, y: np.ndarray) -> Message:
    """Reply to ``msg`` as the configured method's client, with ``model`` trained on ``(x, y)``.

    ``train`` messages: the method's local step and upload protection, as the stock ClientApp gives them
    (:func:`client.methods.train_phase`: the node's floor and ledger, a carried unmasking); ``query.<action>``
    messages: the method's extra phases.  ``model`` itself is not modified (the method trains a copy).  An exception,
    the checks of the node config, settings and data included, reaches the server with its text only if it is a
    public refusal (:func:`client.errors.sealed`).
    """
    kind = msg.metadata.message_type
    with sealed(kind):
        env = client_env(context, model, x, y, msg)
        if kind == "train":
            return train_phase(msg, env)
        if kind.startswith("query."):
            return query_phase(msg, env, kind.split(".", 1)[1])
        raise ValueError(f"cancelfl: no handler for message type {kind!r}")


def attach(app: ClientApp, load: Loader) -> ClientApp:
    """Register every cancelfl handler (train and all extra phases) on ``app``; returns ``app``.

    ``load`` runs under :func:`client.errors.sealed` too: its exceptions (a file path, a size) stay on the node.
    """
    from client.app import FEDERATION, federation

    def _answer(msg: Message, context: Context) -> Message:
        with sealed(msg.metadata.message_type):
            return protect(msg, context, *load(context))

    app.train()(_answer)
    for action in sorted(query_actions()):
        app.query(action)(_answer)
    app.query(FEDERATION)(federation)  # the ServerApp's federation check (server/federation.py)
    return app


__all__ = ["PINNED_KEY", "Loader", "attach", "client_env", "pinned", "protect"]
