"""Run small torch work single-threaded.

The model-perturbation math works on small matrices (a client's batch times an MLP layer). With the
default intra-op thread pool, each tiny op pays a thread hand-off, which dominates on a loaded machine.
The context manager restores the previous setting, so other code in the same process (in-process runs) is unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torch_threads"]


@contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count to ``n``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
