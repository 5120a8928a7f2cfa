"""A work-request chain engine for the soft RNIC (issue 25; docs/CHAINS.md).

WQEs are bytes in registered memory (``wqe.py``), run by a requester, a responder and a
completer as the kernel's rxe splits them, with mlx5's cross-channel WAIT and ENABLE,
wait-on-data, RedN's compare-and-swap on a WQE's control word, and RFC 7306 masked
FetchAdd. ``engine.py`` is sans-IO; ``driver.py`` connects it to a ``QueuePair``.
"""
from .engine import Engine
from .wqe import Cond, Flag, Op, Sge, Wqe

__all__ = ["Cond", "Engine", "Flag", "Op", "Sge", "Wqe"]
