"""What one connection has sent and its peer has not taken yet: the target's backpressure.

Answers (COMPLETIONs, completion records) go out in posting order, so the work completion
of a signaled one says the peer has it and everything posted before it: acknowledged by
the peer's RNIC on RoCEv2 and on a verbs device, handed to TCP (whose buffer does not
grow past its high-water mark) on the soft iWARP RNIC. The target signals every
``SIGNAL_EVERY``-th answer (a future per answer costs a RoCEv2 LOAD about 8% of its CPU)
and counts each answer's octets, with the LOAD data written before it, until a signaled
one covers it; when it must wait, a zero-length RDMA Write covers the rest. A connection
over its bounds is not served until half of that is taken, and is ended when that does
not happen in time; a peer that does not read, or posts no receive buffer for its
completions, so holds a bounded amount of the target's memory for a bounded time.
"""
from __future__ import annotations

import asyncio

from ..rnic.qp import QueuePair

SIGNAL_EVERY = 8     # an unsignaled answer is covered by the next signaled one


class Backlog:
    """Octets and answers posted on a connection and not yet taken by its peer."""

    def __init__(self, max_octets: int, max_messages: int) -> None:
        self.max_octets = max_octets
        self.limit_messages(max_messages)
        self.octets = self.messages = 0
        self._uncovered = self._uncovered_octets = 0   # since the last signaled answer
        self._below = asyncio.Event()
        self._below.set()

    def limit_messages(self, count: int) -> None:
        """At most ``count`` answers not taken; signaled often enough for that."""
        self.max_messages = count
        self.every = max(1, min(SIGNAL_EVERY, count // 4))

    @property
    def signal_next(self) -> bool:
        """Whether the next answer is to be signaled."""
        return self._uncovered + 1 >= self.every

    def posted(self, octets: int, future: asyncio.Future | None, count: int = 1) -> None:
        """``count`` answers of ``octets`` in all went out; ``future``, the completion of
        the last if signaled, covers them and the unsignaled ones before them."""
        self.octets += octets
        self.messages += count
        self._uncovered += count
        self._uncovered_octets += octets
        if future is not None:
            self._cover(future)

    def _cover(self, future: asyncio.Future) -> None:
        count, octets = self._uncovered, self._uncovered_octets
        self._uncovered = self._uncovered_octets = 0
        future.add_done_callback(lambda done: self._taken(done, count, octets))

    def _taken(self, future: asyncio.Future, count: int, octets: int) -> None:
        if not future.cancelled():
            future.exception()      # a failure is the connection's end, seen elsewhere
        self.octets -= octets
        self.messages -= count
        if self.octets <= self.max_octets // 2 and self.messages <= self.max_messages // 2:
            self._below.set()

    @property
    def over(self) -> bool:
        return self.octets > self.max_octets or self.messages > self.max_messages

    async def drain(self, qp: QueuePair, timeout: float) -> None:
        """Wait until the peer has taken half of the bounds' worth; TimeoutError if it
        does not within ``timeout`` seconds. Answers no signaled one covers yet get a
        zero-length RDMA Write behind them whose completion does."""
        if self._uncovered:
            self._cover(qp.write(0, 0, b""))
        self._below.clear()
        await asyncio.wait_for(self._below.wait(), timeout)
