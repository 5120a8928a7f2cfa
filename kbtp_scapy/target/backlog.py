"""What one connection has sent and its peer has not taken yet: the target's backpressure.

Every answer (a COMPLETION, or a completion record) is posted signaled, so its work
completion says the peer has it: acknowledged by the peer's RNIC on RoCEv2 and on a
verbs device, handed to TCP (whose buffer does not grow past its high-water mark) on the
soft iWARP RNIC. Its octets, with the LOAD data written before it, count until then. A
connection over its bounds is not served until half of that is taken, and is ended when
that does not happen in time; a peer that does not read, or posts no receive buffer for
its completions, so holds a bounded amount of the target's memory for a bounded time.
"""
from __future__ import annotations

import asyncio


class Backlog:
    """Octets and answers posted on a connection and not yet taken by its peer."""

    def __init__(self, max_octets: int, max_messages: int) -> None:
        self.max_octets, self.max_messages = max_octets, max_messages
        self.octets = self.messages = 0
        self._below = asyncio.Event()
        self._below.set()

    def track(self, future: asyncio.Future | None, octets: int) -> None:
        """Count ``octets`` until ``future`` (a signaled answer's completion) is done."""
        if future is None:
            return
        self.octets += octets
        self.messages += 1
        future.add_done_callback(lambda done: self._taken(done, octets))

    def _taken(self, future: asyncio.Future, octets: int) -> None:
        if not future.cancelled():
            future.exception()      # a failure is the connection's end, seen elsewhere
        self.octets -= octets
        self.messages -= 1
        if self.octets <= self.max_octets // 2 and self.messages <= self.max_messages // 2:
            self._below.set()

    @property
    def over(self) -> bool:
        return self.octets > self.max_octets or self.messages > self.max_messages

    async def drain(self, timeout: float) -> None:
        """Wait until the peer has taken half of the bounds' worth; TimeoutError if it
        does not within ``timeout`` seconds."""
        self._below.clear()
        await asyncio.wait_for(self._below.wait(), timeout)
