"""Liveness of a session's connection without traffic from the peer.

A peer that vanishes without closing (killed, its host or link gone) sends nothing more,
and RoCEv2 has no keepalive: its session would look active for ever, holding its slot. So
after ``interval`` seconds in which nothing arrived, the target posts a zero-length RDMA
Write, which names no memory and which the peer's RNIC acknowledges without its CPU (IB
9.4.1; RFC 5040 s5.1); a dead peer's RNIC does not, and the transport's retries fail the
Write, or ``timeout`` passes. On iWARP the Write completes once TCP has it, so it is TCP
that decides: the soft RNIC arms TCP_USER_TIMEOUT and keepalive with the same times
(``rnic/iwarp.py``). Either way the connection ends and its session goes to retention.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..rnic.qp import ConnectionLost, QueuePair, RemoteError


class Liveness:
    """Probes of one connection; ``heard`` is set by the receiver on every arrival."""

    def __init__(self, qp: QueuePair, interval: float, timeout: float) -> None:
        self.qp, self.interval, self.timeout = qp, interval, timeout
        self.heard = True
        self.probes = 0

    async def watch(self, on_probe: Callable[[], None]) -> str:
        """Probe after each silent interval; return why the peer is dead."""
        while True:
            await asyncio.sleep(self.interval)
            if self.heard:
                self.heard = False
                continue
            self.probes += 1
            on_probe()
            try:
                await asyncio.wait_for(self.qp.write(0, 0, b""), self.timeout)
            except TimeoutError:
                return f"no answer to a liveness probe within {self.timeout:g} s"
            except (ConnectionLost, RemoteError) as exc:
                return f"liveness probe failed: {exc}"
