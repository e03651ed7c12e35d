"""Use a cancelfl method in your own Flower ClientApp, with your own PyTorch model and local data.

* :func:`attach` registers the method's train handler and its extra message phases (key exchange, share relay,
  dropout recovery) on your ``ClientApp``; ``load(context)`` returns your model and this node's data::

      app = ClientApp()
      attach(app, lambda context: (Net(), x_local, y_local))

* :func:`protect` handles one message inside a handler you write yourself and returns the reply to send.

The strategy sends its settings (``method``, ``epsilon``, ``clip``, ...) in every message
(:mod:`protocols.wire.settings`), so the client needs no run config; a client run config naming another
``method`` is refused.  Premises of the protection: the method trains your model itself (a DP guarantee covers
a training procedure, not an arbitrary update), ``y`` holds integer class labels, and the model's ``state_dict``
keys match the server's arrays.  Noise is drawn on the CPU from the OS CSPRNG; training runs on ``device``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from client.env import ClientEnv
from client.floor import admit
from client.methods import query_actions, query_handler, train_handler
from protocols.config import RunConfig
from protocols.wire.settings import settings_of

#: ``load(context) -> (model, x, y)``: your model (a fresh instance) and this node's training data.
Loader = Callable[[Context], tuple[nn.Module, np.ndarray, np.ndarray]]


def client_env(context: Context, model: nn.Module, x: np.ndarray, y: np.ndarray,
               msg: Message | None = None) -> ClientEnv:
    """The method's view of this client: settings, identity, your data, copies of your model.

    Settings come from ``msg`` (what the strategy sent, checked against the run config) or, without
    ``msg``, from the run config (ConfigError if it names no method, or a mismatch).
    """
    if msg is not None:
        cfg = settings_of(msg.content if msg.has_content() else None, context.run_config)
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


def protect(msg: Message, context: Context, model: nn.Module, x: np.ndarray, y: np.ndarray) -> Message:
    """Reply to ``msg`` as the configured method's client, with ``model`` trained on ``(x, y)``.

    ``train`` messages: the method's local step and upload protection; ``query.<action>`` messages: the
    method's extra phases.  ``model`` itself is not modified (the method trains a copy).
    """
    env = client_env(context, model, x, y, msg)
    kind = msg.metadata.message_type
    if kind == "train":
        admit(msg, env)  # the node's privacy floor and ledger, as in the stock ClientApp (client.floor)
        return train_handler(env.cfg.method)(msg, env)
    if kind.startswith("query."):
        return query_handler(env.cfg.method, kind.split(".", 1)[1])(msg, env)
    raise ValueError(f"cancelfl: no handler for message type {kind!r}")


def attach(app: ClientApp, load: Loader) -> ClientApp:
    """Register every cancelfl handler (train and all extra phases) on ``app``; returns ``app``."""
    from client.app import FEDERATION, federation

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return protect(msg, context, *load(context))

    for action in sorted(query_actions()):
        def _query(msg: Message, context: Context) -> Message:
            return protect(msg, context, *load(context))

        app.query(action)(_query)
    app.query(FEDERATION)(federation)  # the ServerApp's federation check (server/federation.py)
    return app


__all__ = ["Loader", "attach", "client_env", "protect"]
