"""Server-side optimizers of the FedSGD methods: the step the server takes with the round's noisy gradient.

The MP family (MU_Server, Algorithm 3) and DDP-SA (Algorithm 2, step 4) publish a *gradient* each round and
the server moves the global model with it.  What the server does with a released gradient is
post-processing: any optimizer costs no privacy.  Two are offered (run-config ``server-optimizer``):

* ``sgd``:  theta <- theta - lr g                         (the MP paper's xi; DDP-SA's Algorithm 2)
* ``adam``: theta <- theta - lr m_hat / (sqrt(v_hat) + eps)   (Kingma & Ba, bias-corrected moments)

Adam is the MP family's default (its regime in :mod:`protocols.methods`): its squared-loss MLP is badly
conditioned for plain SGD, and Adam's step is scale-free (about lr per coordinate), so one lr suits datasets
whose gradients differ by orders of magnitude.  DDP-SA's own experiments use Adam too (its Sec. VI).

The state (moments and step count) is part of the strategy's checkpoint: a resumed run continues the same
optimizer (:meth:`ServerOptimizer.to_state`, :func:`optimizer_from_state`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["SERVER_OPTIMIZERS", "NonFiniteGradient", "ServerAdam", "ServerOptimizer", "ServerSgd",
           "make_server_optimizer", "optimizer_from_state"]

#: Run-config ``server-optimizer`` values.
SERVER_OPTIMIZERS: tuple[str, ...] = ("sgd", "adam")


class NonFiniteGradient(ValueError):
    """The released gradient holds NaN or inf: refused before any optimizer state moves."""


class ServerOptimizer:
    """One optimizer over a fixed list of parameter arrays; :meth:`step` returns the new parameters."""

    name = ""

    def __init__(self, lr: float) -> None:
        if not (np.isfinite(lr) and lr > 0):
            raise ValueError(f"server learning rate must be a positive number, got {lr!r}")
        self.lr = float(lr)

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """New parameters (fresh float64 arrays) after one step with ``grads`` (same shapes as ``params``)."""
        if len(params) != len(grads):
            raise ValueError(f"{len(grads)} gradient arrays for {len(params)} parameters")
        for p, g in zip(params, grads, strict=True):
            if np.shape(p) != np.shape(g):
                raise ValueError(f"gradient of shape {np.shape(g)} for a parameter of shape {np.shape(p)}")
            if not np.isfinite(g).all():  # checked before any state moves: a failed round leaves Adam's moments
                raise NonFiniteGradient("the gradient is not finite; the server optimizer did not step")
        return self._step([np.asarray(p, np.float64) for p in params], [np.asarray(g, np.float64) for g in grads])

    def _step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def to_state(self) -> dict[str, Any]:
        """JSON types: the name, lr and whatever the optimizer carries across rounds."""
        return {"name": self.name, "lr": self.lr}

    def describe(self) -> str:
        """One line for the run's description."""
        return f"{self.name} lr {self.lr:g}"


class ServerSgd(ServerOptimizer):
    """theta <- theta - lr g: stateless."""

    name = "sgd"

    def _step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> list[np.ndarray]:
        return [p - self.lr * g for p, g in zip(params, grads, strict=True)]


class ServerAdam(ServerOptimizer):
    """Adam with bias-corrected moments (beta1 0.9, beta2 0.999, eps 1e-8: Kingma & Ba's defaults)."""

    name = "adam"

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(lr)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0):
            raise ValueError(f"Adam needs 0 <= beta1, beta2 < 1 and eps > 0, got {beta1}, {beta2}, {eps}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.t = 0
        self.m: list[np.ndarray] = []
        self.v: list[np.ndarray] = []

    def _step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> list[np.ndarray]:
        if not self.m:
            self.m = [np.zeros_like(p) for p in params]
            self.v = [np.zeros_like(p) for p in params]
        elif [m.shape for m in self.m] != [p.shape for p in params]:
            raise ValueError("the model's shapes changed between server steps")
        self.t += 1
        c1, c2 = 1 - self.beta1**self.t, 1 - self.beta2**self.t
        out = []
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            self.m[i] = self.beta1 * self.m[i] + (1 - self.beta1) * g
            self.v[i] = self.beta2 * self.v[i] + (1 - self.beta2) * g * g
            out.append(p - self.lr * (self.m[i] / c1) / (np.sqrt(self.v[i] / c2) + self.eps))
        return out

    def to_state(self) -> dict[str, Any]:
        return {**super().to_state(), "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps, "t": self.t,
                "m": [_array_state(m) for m in self.m], "v": [_array_state(v) for v in self.v]}

    def describe(self) -> str:
        return f"adam lr {self.lr:g} (beta1 {self.beta1:g}, beta2 {self.beta2:g})"


def _array_state(a: np.ndarray) -> dict[str, Any]:
    """An array as JSON types: its little-endian float64 bytes in base64 (exact, and fast to encode and parse)."""
    return {"shape": list(a.shape), "f8_base64": base64.b64encode(np.ascontiguousarray(a, "<f8").tobytes()).decode()}


def _array_from_state(s: Mapping[str, Any]) -> np.ndarray:
    """Inverse of :func:`_array_state`; also reads a ``values`` list of floats."""
    if "values" in s:
        return np.asarray(s["values"], np.float64).reshape(s["shape"])
    return np.frombuffer(base64.b64decode(s["f8_base64"]), "<f8").astype(np.float64).reshape(s["shape"])


def make_server_optimizer(name: str, lr: float) -> ServerOptimizer:
    """``name`` in :data:`SERVER_OPTIMIZERS` with learning rate ``lr`` (ValueError otherwise)."""
    if name == "sgd":
        return ServerSgd(lr)
    if name == "adam":
        return ServerAdam(lr)
    raise ValueError(f"unknown server optimizer {name!r}; known: {', '.join(SERVER_OPTIMIZERS)}")


def optimizer_from_state(state: Mapping[str, Any]) -> ServerOptimizer:
    """Inverse of :meth:`ServerOptimizer.to_state` (a checkpoint's optimizer, moments included)."""
    opt = make_server_optimizer(state["name"], state["lr"])
    if isinstance(opt, ServerAdam):
        opt.beta1, opt.beta2, opt.eps, opt.t = state["beta1"], state["beta2"], state["eps"], int(state["t"])
        opt.m = [_array_from_state(s) for s in state["m"]]
        opt.v = [_array_from_state(s) for s in state["v"]]
    return opt
