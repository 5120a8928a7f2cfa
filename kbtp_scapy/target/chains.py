"""``kbtp target --execution chains``: LOAD runs as a pre-posted work-request chain.

The target's Python builds, for each of twice the connection's request credits, a receive
and the chain behind it (docs/CHAINS.md, "Block Load"), and refills finished chains in
batches, woken once per batch by CQ moderation. The chain engine (``rnic/chains``) then
executes a LOAD from its arrival to its COMPLETION without any KBTP code: the receive's
scatter list places the request's fields into later WQEs, loopback Reads place the table
entry there, Compare and Swap on two branch WQEs' control words decides between the fast
path and software, and the fast path writes the block and sends the completion.

Every request the chain cannot finish (another opcode, LOAD flags, Generation zero, an
entry that is not VALID and SEALED, a handle outside the table) takes the software branch:
a completion on the software CQ, for which the Python reassembles the request from the
receive's scatter pieces and serves it as the software target does. Requests complete in
order: each chain waits until the one before it (chain or software) has completed.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from ..rnic.chains import Engine, Flag, Op, Sge, Wqe
from ..rnic.chains.alias import register_handle_alias
from ..rnic.chains.driver import QueuePairPort, attach
from ..rnic.chains.engine import LOOPBACK_ACCESS
from ..rnic.chains.queues import CompletionQueue, WorkQueue
from ..rnic.chains.wqe import ALL, byteorder, offset_of, sge_offset
from ..tables import memory as M
from ..tables.enums import ENTRY_FLAGS, GOODBYE_FLAGS, OPCODES, REQUEST_FLAGS, flag
from ..tables.messages import COMPLETION, DATA_DESCRIPTOR, HEADER

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("kbtp.target")
OP = OPCODES.by_name()
VALID_SEALED = flag(ENTRY_FLAGS, "VALID") | flag(ENTRY_FLAGS, "SEALED")
RELEASE = flag(GOODBYE_FLAGS, "RELEASE")
INVALIDATE = flag(REQUEST_FLAGS, "INVALIDATE")

_H = {name: HEADER.offset(name) for name in ("request_id", "handle", "generation", "status")}
_HEADER_SIZE = HEADER.size
_DD_SIZE = DATA_DESCRIPTOR.size
_COMPLETION_SIZE = HEADER.size + COMPLETION.size
_C_LENGTH, _C_OFFSET = (HEADER.size + COMPLETION.offset(f) for f in ("data_length", "block_offset"))


class Chain:
    """The queues and buffers of one chain slot (credit slot ``j``)."""

    def __init__(self, engine: Engine, j: int, sw_cq: CompletionQueue, done_cq: CompletionQueue,
                 spare: CompletionQueue) -> None:
        self.j = j
        self.p = engine.create_queue(4, spare, managed=True)   # request guard
        self.f = engine.create_queue(8, spare, managed=True)   # table entry, entry guard
        self.o = engine.create_queue(4, done_cq, managed=True)  # WRITE, SEND (fast path)
        self.s = engine.create_queue(2, sw_cq, managed=True)   # to software


class ChainRunner:
    """Serves one connection's requests with chains; ``serve`` returns GOODBYE's RELEASE."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.qp = conn, conn.qp
        t = conn.target
        self.target, self.metrics = t, t.metrics
        self.little = conn.addr_le
        self.order = byteorder(self.little)
        memory = t.rnic_memory
        if memory.order != self.order:
            raise ValueError(f"chains need the target's memory order to be its WQE order "
                             f"({self.order}); it is {memory.order}")
        self.memory = memory
        # receive buffers the transport posted already count as chains' receives
        self.owed = self.qp.posted + self.qp.undelivered
        self.slots = max(2 * max(conn.credits, 1), self.owed)
        self.port = QueuePairPort(self.qp)
        self.engine = Engine(memory, self.port, self.little)
        self.port.engine = self.engine
        e = self.engine
        self.spare = e.create_cq()
        self.recv_cq = e.create_cq(polled=True, moderation=1 << 62)   # entries, no events
        self.done_cq = e.create_cq(polled=True, moderation=max(1, conn.credits))
        self.sw_cq = e.create_cq(polled=True)
        self.rq = e.create_queue(self.slots, self.recv_cq, receive=True)
        self.ctl = e.create_queue(3 * self.slots, self.spare)
        self.chains = [Chain(e, j, self.sw_cq, self.done_cq, self.spare) for j in range(self.slots)]
        table = t.memory.table
        loopback = e.loopback           # every region below: the chain's own, no peer's
        self.alias = register_handle_alias(memory, t.memory.table_buffer, table.base_handle,
                                           table.count, M.ENTRY_SIZE, connection=loopback)
        self.pool = memory.register(t.memory.pool, LOOPBACK_ACCESS, base=t.memory.pool_base,
                                    connection=loopback)
        self.rest = t._recv_size() - _HEADER_SIZE - _DD_SIZE
        self.per = 64 + 16 + max(self.rest, 0)        # completion, scratch, rest of a request
        self.buffers = memory.register(bytearray(self.slots * self.per), LOOPBACK_ACCESS,
                                       connection=loopback)
        self.built = 0             # chains built so far (ticket of the next one)
        self.refilled = 0          # completions already accounted for
        self.software: deque[int] = deque()
        self.wakeup = asyncio.Event()
        self.ended: BaseException | None = None
        self.sw_seen = 0
        e.completer.on_polled = self._polled

    # -- addresses ------------------------------------------------------------------------

    def _buf(self, j: int, at: int = 0) -> int:
        return self.buffers.base + j * self.per + at

    def _completion(self, j: int) -> int:
        return self._buf(j)

    def _scratch(self, j: int) -> int:
        return self._buf(j, 64)

    def _rest(self, j: int) -> int:
        return self._buf(j, 80)

    @staticmethod
    def _field(q: WorkQueue, index: int, at: int) -> tuple[int, int]:
        """(key, Tagged Offset) of octet ``at`` of WQE ``index`` of ``q``."""
        return q.region.stag, q.at(index) + at

    def _sge(self, q: WorkQueue, index: int, at: int, length: int) -> Sge:
        key, addr = self._field(q, index, at)
        return Sge(key, addr, length)

    # -- building ------------------------------------------------------------------------

    def receive_sges(self, c: Chain, ib1: int, ib2: int, iww: int) -> list[Sge]:
        """The receive's scatter list (docs/CHAINS.md, "Block Load", receive)."""
        b = self.buffers.stag
        j = c.j
        guard, gen = offset_of("guard"), offset_of("guard") + 2
        return [
            self._sge(c.p, ib1, guard, 4),                                    # version .. flags
            Sge(b, self._completion(j) + _H["request_id"], 16),               # Request ID, handle
            self._sge(c.f, ib2, gen, 2),                                      # Generation
            Sge(b, self._scratch(j), 2),                                      # Status
            self._sge(c.o, iww, offset_of("remote_stag"), _DD_SIZE),          # Data Descriptor
            Sge(b, self._rest(j), max(self.rest, 0)),                         # anything after
        ]

    def build(self) -> None:
        """Post chain ``built`` into its slot: receive, control WQEs and the four queues."""
        k = self.built
        c = self.chains[k % self.slots]
        e, b, j = self.engine, self.buffers.stag, c.j
        for q in (c.p, c.f, c.o, c.s):
            e.rewind(q)                 # the branches the last chain here did not take
        # the completion as far as it is constant: Version, COMPLETION, the rest zero
        done = bytearray(_COMPLETION_SIZE)
        done[:2] = bytes((1, OP["COMPLETION"]))
        self.buffers.local(self._completion(j), _COMPLETION_SIZE)[:] = done
        ib1 = c.p.written + 3                        # A, X, c1, B1
        ir1, ic2, ib2 = c.f.written, c.f.written + 3, c.f.written + 5   # WR1, WR2, WR3, c2a, c2b, B2
        iww, isend = c.o.written, c.o.written + 1     # WRITE, SEND
        # P: the handle's octets into WR1's address and B1's flags octet, then guard 1
        handle = self._completion(j) + _H["handle"]
        roff = offset_of("remote_offset") + (1 if self.little else 0)
        pieces = [self._sge(c.f, ir1, roff, 7), self._sge(c.p, ib1, 1, 1)]
        if not self.little:
            pieces.reverse()             # octet 0 (the top one) comes first
        e.post(c.p, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=b, remote_offset=handle, length=8,
                        sges=pieces), doorbell=False)
        # X: the Data Descriptor's STag, which the completion invalidates
        skey, saddr = self._field(c.o, iww, offset_of("remote_stag"))
        e.post(c.p, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=skey, remote_offset=saddr, length=4,
                        sges=[self._sge(c.o, isend, offset_of("invalidate"), 4)]), doorbell=False)
        expect = int.from_bytes(bytes((1, OP["LOAD"])) + INVALIDATE.to_bytes(2, "big"), self.order)
        b1 = Wqe(Op.ENABLE, 0, target=c.s.number, guard=expect, count=ALL)
        e.post(c.p, Wqe(Op.CAS, Flag.LOOPBACK | Flag.FENCE, remote_stag=c.p.region.stag,
                        remote_offset=c.p.at(ib1), operand=b1.control(self.little),
                        operand2=Wqe(Op.ENABLE, 0, target=c.f.number, guard=expect,
                                     count=ALL).control(self.little)), doorbell=False)
        e.post(c.p, b1, doorbell=False)
        # F: the table entry, twice; the request's Generation; guard 2
        guard = offset_of("guard")
        entry_sges = [self._sge(c.f, ib2, guard, 2),                          # Flags
                      self._sge(c.f, ic2, offset_of("operand") + 6, 2)]       # Generation
        entry_sges += self._number(c.o, iww, sge_offset(0, "length"))         # Data Length
        entry_sges.append(self._sge(c.o, iww, sge_offset(0, "addr"), 8))      # Block Offset
        e.post(c.f, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.alias.stag, length=M.ENTRY_SIZE,
                        sges=entry_sges), doorbell=False)
        back = self._number_back(b, self._completion(j) + _C_LENGTH)
        back.append(Sge(b, self._completion(j) + _C_OFFSET, 8))
        wkey, waddr = self._field(c.o, iww, sge_offset(0, "length"))
        e.post(c.f, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=wkey, remote_offset=waddr,
                        length=12, sges=back), doorbell=False)
        gkey, gaddr = self._field(c.f, ic2, offset_of("operand") + 6)      # the entry's Generation
        e.post(c.f, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=gkey, remote_offset=gaddr,
                        length=2, sges=[Sge(b, self._completion(j) + _H["generation"], 2)]),
               doorbell=False)
        fail = Wqe(Op.ENABLE, 0, target=c.s.number, count=ALL)
        want = bytearray(fail.encode(self.little)[:8])
        want[guard:guard + 2] = VALID_SEALED.to_bytes(2, "big")
        passed = Wqe(Op.ENABLE, 0, target=c.o.number, count=ALL).control(self.little)
        for _ in ("request Generation = entry's", "request Generation 0"):
            e.post(c.f, Wqe(Op.CAS, Flag.LOOPBACK | Flag.FENCE, remote_stag=c.f.region.stag,
                            remote_offset=c.f.at(ib2), operand=int.from_bytes(want, self.order),
                            operand2=passed), doorbell=False)
        e.post(c.f, fail, doorbell=False)
        # O: the block to the initiator, then the completion
        e.post(c.o, Wqe(Op.WRITE, 0, sges=[Sge(self.pool.stag, 0, 0)]), doorbell=False)
        e.post(c.o, Wqe(Op.SEND, Flag.SIGNALED | Flag.INVALIDATE, wr_id=k,
                        sges=[Sge(b, self._completion(j), _COMPLETION_SIZE)]), doorbell=False)
        # S: to software
        e.post(c.s, Wqe(Op.NOP, Flag.SIGNALED, wr_id=k), doorbell=False)
        for q in (c.p, c.f, c.o, c.s):
            e.ring(q)
        # the receive, and the control WQEs that start the chain
        e.post(self.rq, Wqe(Op.RECV, wr_id=k, sges=self.receive_sges(c, ib1, ib2, iww)))
        e.post(self.ctl, Wqe(Op.WAIT, target=self.recv_cq.number, count=k + 1), doorbell=False)
        e.post(self.ctl, Wqe(Op.WAIT, target=self.done_cq.number, count=k), doorbell=False)
        e.post(self.ctl, Wqe(Op.ENABLE, target=c.p.number, count=ALL))
        if self.owed:
            self.owed -= 1
        else:
            self.qp.post_recv(1)
        self.built += 1

    def _number(self, q: WorkQueue, index: int, at: int) -> list[Sge]:
        """Scatter entries that put a 4-octet network-order number into a WQE field: one
        when the WQE order is big-endian, four one-octet ones reversing it otherwise (Data
        Length is not an ADDR_LE field)."""
        if not self.little:
            return [self._sge(q, index, at, 4)]
        return [self._sge(q, index, at + 3 - i, 1) for i in range(4)]

    def _number_back(self, key: int, addr: int) -> list[Sge]:
        """The reverse of ``_number``: a WQE-order field into a network-order one."""
        if not self.little:
            return [Sge(key, addr, 4)]
        return [Sge(key, addr + 3 - i, 1) for i in range(4)]

    # -- completions ----------------------------------------------------------------------

    def _polled(self, cq: CompletionQueue) -> None:
        if cq is self.sw_cq:
            while cq.entries:
                self.software.append(cq.entries.popleft().wr_id)
        self.wakeup.set()

    def request_bytes(self, k: int) -> bytes:
        """Software's copy of request ``k``: its receive's scatter pieces, in order."""
        while self.recv_cq.entries:
            entry = self.recv_cq.entries.popleft()
            if entry.wr_id == k:
                length = entry.byte_len
                break
        else:
            raise RuntimeError(f"no receive completion for request {k}")
        wqe = Wqe.decode(self.rq.slot(k), self.little)
        return self.engine.requester.gather(wqe.sges)[:length]

    def refill(self) -> None:
        """Account for the chains that finished and build their successors (one batch)."""
        done = self.done_cq.count
        finished = done - self.refilled
        if finished <= 0:
            return
        sw = self.sw_seen
        self.sw_seen = 0
        chained = finished - sw
        if chained > 0:
            self.metrics.chained(OP["LOAD"], chained)
        self.refilled = done
        self.done_cq.entries.clear()
        received = self.recv_cq.entries
        while received and received[0].wr_id < done:
            received.popleft()
        while self.built < done + self.slots:
            self.build()
        self.metrics.refills += 1

    # -- serving --------------------------------------------------------------------------

    async def serve(self) -> bool:
        try:
            return await self._serve()
        finally:
            self.refill()               # the counters of the last, partial batch

    async def _serve(self) -> bool:
        for _ in range(self.slots):
            self.build()
        attach(self.engine, self.qp, self.rq, self._lost)
        self.engine.run()
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            if self.ended is not None:
                raise self.ended
            if self.qp.error is not None:
                raise self.qp.error
            self.refill()
            while self.software:
                k = self.software.popleft()
                release = await self._software(k)
                if release is not None:
                    return release
            self.refill()

    def _lost(self, error: BaseException) -> None:
        self.ended = error
        self.wakeup.set()

    async def _software(self, k: int) -> bool | None:
        """Serve request ``k`` as the software target does; GOODBYE's RELEASE, or None."""
        conn = self.conn
        req, why = conn.parse(self.request_bytes(k))
        self.metrics.python_request(req["opcode"])
        outcome, why = await conn.execute(req, None, why)
        if outcome is None:
            return bool(req["flags"] & RELEASE)
        conn._complete(req, outcome, why)
        self.sw_seen += 1
        self.engine.signal(self.done_cq, k)
        return None

    def close(self) -> None:
        for region in (self.alias, self.pool, self.buffers):
            self.memory.deregister(region.stag)
        for q in self.engine.queues:
            self.memory.deregister(q.region.stag)

