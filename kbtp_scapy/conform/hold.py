"""Holding back the checker's answers to the target's RDMA Reads.

A non-inline store makes the target RDMA-read the initiator's buffer. The checker is that
initiator, so it decides when the Read Response leaves: while it holds it, the target is
stuck in the middle of the store for as long as the checker needs, and what must not
happen before the store finishes (a later request completing, the entry turning VALID,
buffers running short) can be looked for without racing the target. A held response
is only late, never lost: ``release`` sends every one in order.

The soft RNIC answers a Read as it arrives. The hold takes over, on one queue pair only,
the step that sends the answer once the request has been checked and the data read:
the tagged Read Response on iWARP (an RNIC sends it after the Sends it has queued, as
RDMAP allows), the READ RESPONSE packets on RoCEv2 (where the target's RNIC, seeing later
PSNs acknowledged first, retransmits the Read Request, as a real one does on a slow path;
the repeats are held too, and the extra responses are stale to it).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..rnic.qp import QueuePair
from ..wire.iwarp_defs import Op

#: Seconds a case holds a Read to let what must not happen meanwhile show. The target
#: under test answers a request in well under a millisecond on loopback and a few on a
#: network, so a bug shows inside it every run, never by luck of timing.
SETTLE = 0.3


class ReadHold:
    """While ``holding``, the Read Responses of ``qp`` wait for ``release``."""

    def __init__(self, qp: QueuePair) -> None:
        self.qp = qp
        self.holding = False
        self.requested = asyncio.Event()       # a Read Request arrived while holding
        self._held: list[tuple[Callable[..., Any], tuple]] = []
        if qp.transport == "iwarp":
            self._take("_send_tagged", lambda op, *rest: op == Op.READ_RESPONSE)
        else:
            self._take("_respond_read", lambda *args: True)

    def _take(self, name: str, is_response: Callable[..., bool]) -> None:
        send = getattr(self.qp, name)

        def maybe_hold(*args: Any) -> None:
            if self.holding and is_response(*args):
                self._held.append((send, tuple(bytes(a) if isinstance(a, memoryview) else a
                                               for a in args)))
                self.requested.set()
            else:
                send(*args)
        setattr(self.qp, name, maybe_hold)

    def hold(self) -> None:
        self.holding = True
        self.requested.clear()

    async def wait_requested(self, timeout: float) -> bool:
        """Whether the target asked for data (an RDMA Read) within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self.requested.wait(), timeout)
            return True
        except TimeoutError:
            return False

    @property
    def held(self) -> int:
        return len(self._held)

    def release(self) -> None:
        """Send every held response, in the order they were held."""
        self.holding = False
        held, self._held = self._held, []
        if self.qp.closed:
            return
        for send, args in held:
            send(*args)
