"""The requester role: runs send-queue WQEs in order, as an RNIC's send engine does.

A WQE is decoded from its slot when the queue reaches it, so what earlier work requests
wrote into it counts. Ordering follows the verbs: WQEs of one queue start in order; an
RDMA Write or Send is complete once handed to the connection (its ordering is the
connection's), an RDMA Read or atomic when its response comes; a FENCE WQE starts only
once the queue's earlier Reads and atomics have completed; WAIT blocks the queue until a
CQ has Count completions; ENABLE lets a managed queue run Count more WQEs; WAIT_DATA
blocks until a masked word of memory compares as asked. A LOOPBACK work request runs on
this RNIC's own memory, as on a loopback QP, and completes at once. A failed work
request puts its queue in the error state, as on an RNIC.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..memory import AccessError, Fault, MemoryTable
from ..qp import Verb, WorkRequest
from .completer import Completer
from .queues import Completion, WorkQueue
from .wqe import ALL, Cond, Flag, Op, Sge, Wqe, byteorder

_RIGHT = {Op.READ: 1, Op.WRITE: 2}   # Access.REMOTE_READ, REMOTE_WRITE as ints
# flags as ints: IntFlag arithmetic on every work request is slow
FENCE, LOOPBACK, SIGNALED = int(Flag.FENCE), int(Flag.LOOPBACK), int(Flag.SIGNALED)
SOLICITED, INVALIDATE = int(Flag.SOLICITED), int(Flag.INVALIDATE)
Done = Callable[[Any, BaseException | None], None]


class Port(Protocol):
    """Where remote work requests go: a QueuePair (``driver.py``) or a test's recorder."""

    def transmit(self, wr: WorkRequest, done: Done | None) -> None: ...


class Blocked(Exception):
    """The queue cannot go on now; the engine retries it when something changes."""

    def __init__(self, on: str, cq: int | None = None) -> None:
        super().__init__(on)
        self.on, self.cq = on, cq


class Requester:
    def __init__(self, memory: MemoryTable, port: Port, completer: Completer, little: bool,
                 queues: list[WorkQueue], wake: Callable[[WorkQueue], None], loopback: object) -> None:
        self.memory, self.port, self.completer = memory, port, completer
        self.loopback = loopback        # the "connection" loopback work requests come on
        self.little, self.order = little, byteorder(little)
        self.memory_order = byteorder(memory.order == "little")
        self.queues, self.wake = queues, wake
        self.executed: dict[str, int] = {}
        self.data_waiters: list[WorkQueue] = []

    # -- local memory ---------------------------------------------------------------------

    def _local(self, sge: Sge) -> memoryview:
        region = self.memory.get(sge.key)
        if region is None or not region.valid:
            raise AccessError(Fault.INVALID_STAG, sge.key, sge.addr, sge.length)
        return region.local(sge.addr, sge.length)

    def gather(self, sges: list[Sge]) -> bytes:
        return b"".join(bytes(self._local(s)) for s in sges)

    def scatter(self, sges: list[Sge], data: bytes | bytearray | memoryview) -> int:
        """Place ``data`` across ``sges`` in order; the octets placed."""
        at = 0
        for s in sges:
            if at >= len(data):
                break
            piece = data[at:at + s.length]
            self._local(Sge(s.key, s.addr, len(piece)))[:] = piece
            at += len(piece)
        if at < len(data):
            raise ValueError(f"{len(data)} octets do not fit the scatter list ({at})")
        return at

    # -- one queue ------------------------------------------------------------------------

    def advance(self, q: WorkQueue) -> None:
        """Run ``q``'s WQEs until it is blocked, errored or out of enabled WQEs."""
        while q.error is None and q.next < q.limit():
            try:
                wqe = Wqe.decode(q.slot(q.next), self.little)
                self._start(q, wqe)
            except Blocked as blocked:
                if blocked.cq is not None:
                    self.completer.wait(blocked.cq, q)
                elif blocked.on == "data":
                    self.data_waiters.append(q)
                return                     # "fence": a completion wakes it
            except (AccessError, ValueError) as exc:
                q.error = str(exc)
                self.completer.complete(q.cq, Completion(0, -1, q.error, 0, q.number))
                return
            q.next += 1
            name = wqe.op.name
            self.executed[name] = self.executed.get(name, 0) + 1

    def _start(self, q: WorkQueue, w: Wqe) -> None:
        if w.flags & FENCE and q.inflight:
            raise Blocked("fence")
        op = w.op
        if op is Op.WAIT:
            if self.completer.cqs[w.target].count < w.count:
                raise Blocked("cq", w.target)
        elif op is Op.WAIT_DATA:
            word = int.from_bytes(self.memory.remote(w.remote_stag, w.remote_offset, 8, 1,
                                                         self.loopback), self.order)
            equal = word & w.operand2 == w.operand & w.operand2
            if equal != (w.cond == Cond.EQ):
                raise Blocked("data")
        elif op is Op.ENABLE:
            other = self.queues[w.target]
            other.enabled = other.posted if w.count == ALL else other.enabled + w.count
            self.wake(other)
        elif op is Op.NOP:
            pass
        elif w.flags & LOOPBACK:
            self._loopback(w)
        else:
            self._remote(q, w)
            return
        self._done(q, w)

    def _done(self, q: WorkQueue, w: Wqe, byte_len: int = 0) -> None:
        if w.flags & SIGNALED:
            self.completer.complete(q.cq, Completion(w.wr_id, int(w.op), "ok", byte_len, q.number))

    def _loopback(self, w: Wqe) -> None:
        m = self.memory
        if w.op is Op.READ:
            self.scatter(w.sges, m.remote(w.remote_stag, w.remote_offset, w.length, _RIGHT[Op.READ],
                                          self.loopback))
        elif w.op is Op.WRITE:
            m.remote(w.remote_stag, w.remote_offset, sum(s.length for s in w.sges),
                     _RIGHT[Op.WRITE], self.loopback)[:] = self.gather(w.sges)
        elif w.op in (Op.FETCH_ADD, Op.CAS):
            view = m.atomic(w.remote_stag, w.remote_offset, self.loopback)
            if w.op is Op.FETCH_ADD:
                original = m.fetch_add(view, w.operand, w.operand2 or None)
            else:
                original = m.compare_swap(view, w.operand, w.operand2)
            if w.sges:                     # else the original value is not wanted
                self.scatter(w.sges, original.to_bytes(8, self.memory_order))
        else:
            raise ValueError(f"{w.op.name} cannot run on a loopback queue")
        self.memory_changed()

    def _remote(self, q: WorkQueue, w: Wqe) -> None:
        if w.op is Op.SEND:
            wr = WorkRequest(Verb.SEND, self.gather(w.sges), solicited=bool(w.flags & SOLICITED),
                             invalidate=w.invalidate if w.flags & INVALIDATE else None)
        elif w.op is Op.WRITE:
            data = self.gather(w.sges)
            wr = WorkRequest(Verb.WRITE, data, w.remote_stag, w.remote_offset, len(data))
        elif w.op is Op.READ:
            wr = WorkRequest(Verb.READ, b"", w.remote_stag, w.remote_offset, w.length)
        elif w.op is Op.FETCH_ADD:
            wr = WorkRequest(Verb.FETCH_ADD, b"", w.remote_stag, w.remote_offset, 8, add=w.operand,
                             mask=w.operand2 or None)
        elif w.op is Op.CAS:
            wr = WorkRequest(Verb.COMPARE_SWAP, b"", w.remote_stag, w.remote_offset, 8,
                             add=w.operand2, compare=w.operand)
        else:
            raise ValueError(f"{w.op.name} is not a send-queue operation")
        if wr.verb in (Verb.SEND, Verb.WRITE):
            self.port.transmit(wr, None)
            self._done(q, w, len(wr.payload))
            return
        q.inflight += 1

        def done(result: Any, error: BaseException | None) -> None:
            q.inflight -= 1
            if error is not None:
                q.error = str(error)
                self.completer.complete(q.cq, Completion(w.wr_id, int(w.op), q.error, 0, q.number))
                return
            octets = bytes(result) if wr.verb is Verb.READ else int(result).to_bytes(8, self.memory_order)
            try:
                if w.sges:
                    self.scatter(w.sges, octets)
            except (AccessError, ValueError) as exc:
                q.error = str(exc)
                return
            self._done(q, w, len(octets))
            self.memory_changed()
            self.wake(q)
        self.port.transmit(wr, done)

    def memory_changed(self) -> None:
        """Memory changed: the queues waiting on data look again."""
        waiters, self.data_waiters = self.data_waiters, []
        for q in waiters:
            self.wake(q)

