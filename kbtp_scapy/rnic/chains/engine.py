"""The chain engine: requester, responder and completer over one RNIC's memory.

Sans-IO: remote work requests leave through a ``Port`` and their results come back by
``Port``'s callbacks; a received Send comes in by ``deliver``. Everything else (loopback
work requests, WAIT, ENABLE, WAIT_DATA, completions) happens inside ``run``, which goes
on until every queue is blocked or idle. The host (the target's Python) only creates
queues, writes WQEs (``post``) and polls the CQs it asked to poll.
"""
from __future__ import annotations

import time
from collections import deque

from ..memory import Access, MemoryTable
from .completer import Completer
from .cqe import CQE_SIZE
from .queues import Completion, CompletionQueue, WorkQueue
from .requester import Port, Requester
from .responder import Responder
from .wqe import STRIDE, Op, Wqe

LOOPBACK_ACCESS = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC


class Loopback:
    """The engine's loopback QP, as far as memory protection goes: regions bound to it are
    reachable by the chain's loopback work requests and by no peer."""


class Engine:
    def __init__(self, memory: MemoryTable, port: Port, little: bool) -> None:
        self.memory, self.little = memory, little
        self.queues: list[WorkQueue] = []
        self._ready: deque[WorkQueue] = deque()
        self._queued: set[int] = set()
        self.completer = Completer(self.wake, little)
        # the engine's own regions are bound to its loopback QP: no peer can reach them
        self.loopback = Loopback()
        self.requester = Requester(memory, port, self.completer, little, self.queues, self.wake,
                                   self.loopback)
        self.responder = Responder(self.requester, self.completer, little)
        self.seconds = 0.0               # time spent running work requests (the "RNIC")
        self._running = False

    # -- set-up by the host -------------------------------------------------------------------

    def create_cq(self, polled: bool = False, moderation: int = 1, cqes: int = 0) -> CompletionQueue:
        """A CQ; a polled one keeps its entries and tells ``completer.on_polled`` of every
        ``moderation``-th (mlx5's CQ moderation: one event per batch). With ``cqes``, its
        completions are also written, as CQEs, into a ring of that many in registered
        memory that loopback work requests may read (mlx5's CQ buffer is host memory)."""
        cq = self.completer.create(polled, moderation)
        if cqes:
            cq.ring = self.memory.register(bytearray(cqes * CQE_SIZE), LOOPBACK_ACCESS,
                                           connection=self.loopback)
            cq.cqes = cqes
        return cq

    def signal(self, cq: CompletionQueue, wr_id: int = 0) -> None:
        """A completion the host adds itself (its software finished what the chain gave it)."""
        self.completer.complete(cq, Completion(wr_id, int(Op.NOP)))
        self.run()

    def create_queue(self, slots: int, cq: CompletionQueue, *, managed: bool = False,
                     receive: bool = False) -> WorkQueue:
        """A queue of ``slots`` WQE slots in a region of its own, which loopback work
        requests may read and write (that is how a chain edits its later WQEs)."""
        region = self.memory.register(bytearray(slots * STRIDE), LOOPBACK_ACCESS,
                                      connection=self.loopback)
        q = WorkQueue(len(self.queues), region, slots, cq, managed, receive)
        self.queues.append(q)
        return q

    def post(self, q: WorkQueue, wqe: Wqe, doorbell: bool = True) -> int:
        """Write ``wqe`` into ``q``'s next slot; its index. With ``doorbell`` the queue may
        run it at once (a managed queue still waits for ENABLE)."""
        if q.free <= 0:
            raise OverflowError(f"queue {q.number} is full ({q.slots} WQEs)")
        index = q.written
        q.slot(index)[:] = wqe.encode(self.little)
        q.written += 1
        if doorbell:
            self.ring(q)
        return index

    def rewind(self, q: WorkQueue) -> None:
        """Take back the WQEs no ENABLE let run (a chain's branch not taken), so the next
        ``post`` writes over them: the host may rewrite what the RNIC will not fetch."""
        q.written = q.posted = q.next
        q.enabled = min(q.enabled, q.next)

    def flush(self, q: WorkQueue) -> None:
        """The host takes a queue through the error state and back (a flush): the WQEs it
        had not run, a WAIT_DATA it was blocked on among them, never run; the next ones
        posted do."""
        q.next = q.posted = q.written
        q.enabled = min(q.enabled, q.next)

    def ring(self, q: WorkQueue) -> None:
        """The doorbell: every WQE written so far is there."""
        q.posted = q.written
        self.wake(q)

    # -- running ------------------------------------------------------------------------------

    def wake(self, q: WorkQueue) -> None:
        if q.number not in self._queued and not q.receive:
            self._queued.add(q.number)
            self._ready.append(q)

    def run(self) -> None:
        if self._running:                # a callback during run: the loop below sees it
            return
        self._running = True
        start = time.perf_counter()
        try:
            while self._ready:
                q = self._ready.popleft()
                self._queued.discard(q.number)
                self.requester.advance(q)
        finally:
            self._running = False
            self.seconds += time.perf_counter() - start

    def deliver(self, rq: WorkQueue, payload: bytes) -> Wqe:
        start = time.perf_counter()
        try:
            wqe = self.responder.deliver(rq, payload)
        finally:
            self.seconds += time.perf_counter() - start
        self.run()
        return wqe

    def kick(self) -> None:
        """The host changed memory a WAIT_DATA may watch."""
        self.requester.memory_changed()
        self.run()

    @property
    def executed(self) -> dict[str, int]:
        return self.requester.executed
