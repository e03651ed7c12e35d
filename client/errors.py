"""What an exception raised on the node tells the server: a public refusal's text, else its class only.

Flower sends a failing ClientApp's exception text back to the server in the error reply
(``str(type(ex)) + ":<'" + str(ex) + "'>"``).  A text built on the node's data or noise (a noisy value, a
coordinate, a norm, a loss) would then leave the node uncharged, and so would a text naming the node's files or
dataset size.  :func:`sealed` is the one place every handler's exception passes, from its first line (the node
config and the run config read, the local data loaded: :mod:`client.app`, :func:`client.api.protect` and
:func:`client.api.attach`'s handlers; :func:`client.methods.train_phase` and :func:`client.methods.query_phase`
seal again for a caller of their own): the refusals in :data:`PUBLIC_ERRORS`, whose texts name keys and public
bounds by contract, keep their text; any other exception is logged on the node in full and reaches the server as
its class name and a fixed reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging import ERROR

from flwr.common import log

from protocols.floor import FloorViolation
from protocols.identity import IdentityError
from protocols.keyagreement import KeyAgreementError
from protocols.node_config import NodeConfigError
from protocols.options import ConfigError
from protocols.relay_crypto import RelayAuthError
from protocols.wire.common import ViewError
from protocols.wire.intermediate.stub import IntermediateAggregationError

__all__ = ["PUBLIC_ERRORS", "WITHHELD", "WithheldError", "public_reason", "sealed"]

#: Exceptions whose text a node sends as is: each names keys, the message's own values and public bounds only.
PUBLIC_ERRORS: tuple[type[BaseException], ...] = (FloorViolation, ConfigError, NodeConfigError, ViewError,
                                                   IdentityError, KeyAgreementError, RelayAuthError,
                                                   IntermediateAggregationError)

#: The reason sent for any other exception (its text may name the node's data or noise).
WITHHELD = "raised on this node; its text is withheld from the server (it is in the node's log)"


class WithheldError(RuntimeError):
    """What a node raises in place of an exception whose text it withholds (the text names the class only)."""


def public_reason(err: BaseException) -> str:
    """The text the server may see for ``err``: its own for :data:`PUBLIC_ERRORS`, else its class and :data:`WITHHELD`."""
    if isinstance(err, PUBLIC_ERRORS):
        return str(err)
    return f"{type(err).__name__} {WITHHELD}"


@contextmanager
def sealed(what: str, log_fn: Callable[..., None] = log) -> Iterator[None]:
    """Run a handler: an exception outside :data:`PUBLIC_ERRORS` is logged here and re-raised text-free.

    ``what`` names the phase in the node's log.  The re-raised :class:`WithheldError` carries neither the original
    text nor its traceback (``from None``); a public refusal passes unchanged, and so does a :class:`WithheldError`
    of a seal within this one (logged there).
    """
    try:
        yield
    except (*PUBLIC_ERRORS, WithheldError):
        raise
    except Exception as err:  # noqa: BLE001 - every other exception: its text stays on the node
        log_fn(ERROR, "%s: %s: %s", what, type(err).__name__, err, exc_info=err)
        raise WithheldError(public_reason(err)) from None
