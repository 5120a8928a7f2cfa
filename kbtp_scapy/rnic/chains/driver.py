"""The engine on a soft-RNIC connection: its remote work requests are the QueuePair's.

Every Send, RDMA Write, RDMA Read and atomic a chain issues is posted on the connection's
``QueuePair`` as the one the software target would post, so the frames are the RNIC's
own. Received Sends go to the engine's receive queue instead of ``QueuePair.recv``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..qp import ConnectionLost, QueuePair, Received, WorkRequest
from .engine import Engine
from .queues import WorkQueue
from .requester import Done

log = logging.getLogger("kbtp.rnic")


class QueuePairPort:
    def __init__(self, qp: QueuePair) -> None:
        self.qp = qp
        self.engine: Engine | None = None

    def transmit(self, wr: WorkRequest, done: Done | None) -> None:
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
