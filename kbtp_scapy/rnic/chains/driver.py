"""The engine on a soft-RNIC connection: its remote work requests are the QueuePair's.

Every Send, RDMA Write, RDMA Read and atomic a chain issues is posted on the connection's
``QueuePair`` as the one the software target would post, so the frames are the RNIC's
own. Received Sends go to the engine's receive queue instead of ``QueuePair.recv``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..qp import ConnectionLost, QueuePair, Received, Verb, WorkRequest
from .engine import Engine
from .queues import WorkQueue
from .requester import Done

log = logging.getLogger("kbtp.rnic")


class QueuePairPort:
    """Remote work requests onto ``qp``. It counts the Sends and the octets of Sends and
    Writes it posted, as an RNIC's send counters do, and posts every ``every``-th Send
    signaled: ``covered`` is that Send's completion (the peer took it and all before it)
    with the counts up to it, for the host to read once per batch (the target's backlog:
    docs/CHAINS.md, finding 5)."""

    def __init__(self, qp: QueuePair, every: int = 8) -> None:
        self.qp, self.every = qp, every
        self.engine: Engine | None = None
        self.sends = self.octets = 0
        self.covered: tuple[asyncio.Future | None, int, int] = (None, 0, 0)

    def transmit(self, wr: WorkRequest, done: Done | None) -> None:
        if wr.verb in (Verb.SEND, Verb.WRITE):
            self.octets += len(wr.payload)
            if wr.verb is Verb.SEND:
                self.sends += 1
                if self.sends % self.every == 0:
                    signaled = self.qp.post(wr, signaled=True)
                    signaled.add_done_callback(_seen)
                    self.covered = (signaled, self.sends, self.octets)
                    return
        future = self.qp.post(wr, signaled=done is not None)
        if done is None or future is None:
            return

        def finished(f: asyncio.Future) -> None:
            error = None if f.cancelled() else f.exception()
            done(None if error is not None or f.cancelled() else f.result(),
                 error or (ConnectionLost("cancelled") if f.cancelled() else None))
            if self.engine is not None:
                self.engine.run()
        future.add_done_callback(finished)


def _seen(future: asyncio.Future) -> None:
    """A failed Send is the connection's end, which the host sees elsewhere."""
    if not future.cancelled():
        future.exception()


def attach(engine: Engine, qp: QueuePair, rq: WorkQueue,
           lost: Callable[[BaseException], None]) -> None:
    """Receive completions of ``qp`` go to ``rq`` (the end of the connection to ``lost``)."""
    def received(item: Received | ConnectionLost) -> None:
        if isinstance(item, BaseException):
            lost(item)
            return
        try:
            engine.deliver(rq, item.payload)
        except Exception as exc:          # a fault of the receive: the connection ends
            log.info("chain receive failed: %s", exc)
            qp.abort(f"receive WQE: {exc}")
    qp.on_receive(received)
