"""``kbtp target --execution chains``: LOAD, STORE and ALLOC_STORE as pre-posted work-request chains.

The target's Python builds, for each of twice the connection's request credits, a receive
and the chain behind it (docs/CHAINS.md), and refills finished chains in batches, woken
once per batch by CQ moderation. The chain engine (``rnic/chains``) then executes a LOAD, a
mapped STORE (inline, or its data RDMA-Read) or an ALLOC_STORE (``chain_alloc``) from its
arrival to its COMPLETION without any KBTP code: the
receive's scatter list places the request's fields into later WQEs, loopback Reads place
the table entry there, Compare and Swap on branch WQEs' control words decides between the
operations' paths and software, and the path moves the data and sends the completion.

Every request the chain cannot finish (another opcode, other flags, an entry that fails a
check, a handle outside the table or the initiator's range) takes the software branch: a
completion on the software CQ, for which the Python reassembles the request from the
receive's scatter pieces and serves it as the software target does. Requests complete in
order: each chain waits until the one before it (chain or software) has completed.

Once per batch the target also applies the connection's backlog limit to what the chains
sent (withholding the refill while the peer has not taken it) and, in a DIRECT_ALLOC
session, looks at the initiator's Head; ``chain_tickets`` settles ALLOC_STORE chains that a
failed connection or a ring slot that never fills cut short.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from typing import TYPE_CHECKING

from ..rnic.chains import Engine, Flag, Op, Sge, Wqe
from ..rnic.chains.alias import handle_offset, register_alias
from ..rnic.chains.cqe import offset_of as cqe_offset
from ..rnic.chains.driver import QueuePairPort, attach
from ..rnic.chains.engine import LOOPBACK_ACCESS
from ..rnic.chains.queues import CompletionQueue, WorkQueue
from ..rnic.chains.wqe import ALL, byteorder, offset_of, sge_offset
from ..tables import memory as M
from ..tables.messages import COMPLETION, DATA_DESCRIPTOR, HEADER
from ..vocab import AnyMessage, EntryFlag, GoodbyeFlag, Opcode, RequestFlag
from . import chain_alloc, chain_tickets

if TYPE_CHECKING:
    from .connection import Connection
    from .operations import Outcome

log = logging.getLogger("kbtp.target")

_H = {name: HEADER.offset(name) for name in ("request_id", "handle", "generation", "status")}
_HEADER_SIZE = HEADER.size
_DD_SIZE = DATA_DESCRIPTOR.size
_COMPLETION_SIZE = HEADER.size + COMPLETION.size
_C_LENGTH, _C_OFFSET = (HEADER.size + COMPLETION.offset(f) for f in ("data_length", "block_offset"))
# a slot's buffer: the completion and a STORE's new entry octets, scratch, the byte-count
# word, the rest of a request
_SCRATCH_AT, _COUNT_AT, _REST_AT = 64, 80, 88
_REQUEST = _HEADER_SIZE + _DD_SIZE      # a request without inline data: its byte count
_ABOVE = 1 << 40           # the byte-count word's preset: a mismatch leaves its top half non-zero
_TAG = 56                  # wr_id of a chain's completion: opcode << 56 | request number
# guard 1's accepted (opcode, flags) words and the stage each enables
_GUARD1 = ((Opcode.LOAD, RequestFlag.INVALIDATE, "load"),
           (Opcode.STORE, RequestFlag.INLINE, "inline"),
           (Opcode.STORE, RequestFlag.INLINE | RequestFlag.SEAL, "inline"),
           (Opcode.STORE, RequestFlag.INVALIDATE, "read"),
           (Opcode.STORE, RequestFlag.INVALIDATE | RequestFlag.SEAL, "read"),
           (Opcode.ALLOC_STORE, RequestFlag.INLINE, "alloc-inline"),
           (Opcode.ALLOC_STORE, RequestFlag.INLINE | RequestFlag.SEAL, "alloc-inline"),
           (Opcode.ALLOC_STORE, RequestFlag.INVALIDATE, "alloc-read"),
           (Opcode.ALLOC_STORE, RequestFlag.INVALIDATE | RequestFlag.SEAL, "alloc-read"))
_OCTETS = int.from_bytes(b"\x80" * 8, "big")    # Add Mask: every octet adds on its own
_PASS = 0x50                # what a limit key reads where a length is within its limit


class Chain:
    """The queues of one chain slot (credit slot ``j``): P guards the request, F and O are
    LOAD's entry stage and output, FS and OS an inline mapped STORE's, FR and OR a mapped
    STORE's that RDMA-Reads its data, S hands a request to software."""

    def __init__(self, engine: Engine, j: int, sw_cq: CompletionQueue, done_cq: CompletionQueue,
                 spare: CompletionQueue) -> None:
        self.j = j
        self.p = engine.create_queue(16, spare, managed=True)
        self.f = engine.create_queue(8, spare, managed=True)
        self.o = engine.create_queue(4, done_cq, managed=True)
        self.fs = engine.create_queue(24, spare, managed=True)
        self.os = engine.create_queue(4, done_cq, managed=True)
        self.fr = engine.create_queue(24, spare, managed=True)
        self.or_ = engine.create_queue(4, done_cq, managed=True)
        self.s = engine.create_queue(2, sw_cq, managed=True)
        # ALLOC_STORE, inline and read: entry guard, quota guard, output (chain_alloc.py)
        self.alloc = {inline: (engine.create_queue(28, spare, managed=True),
                               engine.create_queue(4, spare, managed=True),
                               engine.create_queue(24, done_cq, managed=True))
                      for inline in (True, False)}
        self.queues = (self.p, self.f, self.o, self.fs, self.os, self.fr, self.or_, self.s,
                       *(q for stages in self.alloc.values() for q in stages))


class ChainRunner:
    """Serves one connection's requests with chains; ``serve`` returns GOODBYE's RELEASE."""

    COUNT_WRS = {True: 5, False: 4}     # the byte-count check's WRs before the length check's

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
        self.port = QueuePairPort(self.qp, conn.backlog.every)   # signaled as software answers
        self.engine: Engine = Engine(memory, self.port, self.little)
        self.port.engine = self.engine
        e = self.engine
        self.spare = e.create_cq()
        # entries, no events; CQEs in memory: the chains compare each receive's byte count
        self.recv_cq = e.create_cq(polled=True, moderation=1 << 62, cqes=self.slots)
        assert self.recv_cq.ring is not None
        self.cqes = self.recv_cq.ring
        self.done_cq = e.create_cq(polled=True, moderation=max(1, conn.credits))
        self.sw_cq = e.create_cq(polled=True)
        self.rq = e.create_queue(self.slots, self.recv_cq, receive=True)
        self.ctl = e.create_queue(3 * self.slots, self.spare)
        self.chains = [Chain(e, j, self.sw_cq, self.done_cq, self.spare)
                       for j in range(self.slots)]
        table = t.memory.table
        loopback = e.loopback           # every region below: the chain's own, no peer's
        self.alias = register_alias(memory, t.memory.table_buffer, table.base_handle,
                                    table.count, M.ENTRY_SIZE, connection=loopback)
        own = conn.state                # stores: the initiator's own range only
        self.own = register_alias(memory, t.memory.table_buffer, own.handle_base, own.handle_count,
                                  M.ENTRY_SIZE, start=(own.handle_base - table.base_handle) * M.ENTRY_SIZE,
                                  connection=loopback, access=LOOPBACK_ACCESS)   # ALLOC_STORE's atomics
        size = t.memory.block_size      # blocks through an alias: no access spills over one
        self.blocks = register_alias(memory, t.memory.pool, t.memory.pool_base, t.config.blocks, size,
                                     unit=size, connection=loopback)
        self.rest = t._recv_size() - _HEADER_SIZE - _DD_SIZE
        self.per = -(-(_REST_AT + max(self.rest, 0)) // 8) * 8   # 8-aligned: atomics on E
        self.buffers = memory.register(bytearray(self.slots * self.per), LOOPBACK_ACCESS,
                                       connection=loopback)
        # each slot's inline data, through an alias: a Length beyond what it holds reads zeros
        self.staging = register_alias(memory, self.buffers.buffer, 0, self.slots, max(self.rest, 0),
                                      unit=self.per, pitch=self.per, start=_REST_AT,
                                      connection=loopback)
        # the length checks' limit keys: PASS at Tagged Offsets 0 to the limit, the null key beyond
        self.block_limit, self.inline_limit = (
            register_alias(memory, bytearray([_PASS]) * (limit + 1), 0, 1, limit + 1, unit=1 << 32,
                           connection=loopback)
            for limit in (size, min(t.config.max_inline, size)))
        # LOAD's byte-count key: PASS at Tagged Offset 40 (a request without octets after
        # its Data Descriptor) only, zeros below and the null key beyond
        self.exact = register_alias(memory, bytearray(_REQUEST) + bytes((_PASS,)), 0, 1, _REQUEST + 1,
                                    unit=1 << 32, connection=loopback)
        self.alloc = chain_alloc.AllocStage(self)
        self.watch = own.watch
        if self.watch is not None:
            self.watch.counted = self._fold
        self.built = 0             # chains built so far (ticket of the next one)
        self.refilled = 0          # completions already accounted for
        self.software: deque[int] = deque()
        self.sent = (0, 0)         # the port's Sends and octets already in the backlog
        self.wakeup = asyncio.Event()
        self.ended: BaseException | None = None
        self.poll: asyncio.TimerHandle | None = None
        self.watchdog: chain_tickets.Watchdog | None = None
        e.completer.on_polled = self._polled
        # the idle rule (sessions._quiet) reads the receive CQ's count: requests a chain
        # ran reach no Python, so heard_at alone would age (docs/CHAINS.md, "The idle
        # rule and the other hostile-peer limits")
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        own.received, own.received_seen = self._received, self.recv_cq.count

    # -- addresses ------------------------------------------------------------------------

    def _buf(self, j: int, at: int = 0) -> int:
        return self.buffers.base + j * self.per + at

    def _completion(self, j: int) -> int:
        return self._buf(j)

    def _scratch(self, j: int) -> int:
        return self._buf(j, _SCRATCH_AT)

    def _rest(self, j: int) -> int:
        return self._buf(j, _REST_AT)

    def block(self, j: int) -> int:
        """The Block Offset in slot ``j``'s completion (an address field: the memory's order)."""
        return int.from_bytes(self.buffers.local(self._completion(j) + _C_OFFSET, 8), self.order)

    def _post_data(self, queue: WorkQueue, j: int, inline: bool) -> None:
        """The request's data into the block, through the block alias: slot ``j``'s inline
        data from the staging buffer, or an RDMA Read of the initiator's buffer (its
        descriptor placed into this READ by the receive's scatter list)."""
        if inline:
            self.engine.post(queue, Wqe(Op.WRITE, Flag.LOOPBACK, remote_stag=self.blocks.stag,
                                        sges=[Sge(self.staging.stag, self._staged(j), 0)]), doorbell=False)
        else:
            self.engine.post(queue, Wqe(Op.READ, 0, sges=[Sge(self.blocks.stag, 0, 0)]), doorbell=False)

    def _staged(self, j: int) -> int:
        """Tagged Offset of slot ``j``'s inline data through the staging alias."""
        return handle_offset(j * self.per)

    @staticmethod
    def _field(q: WorkQueue, index: int, at: int) -> tuple[int, int]:
        """(key, Tagged Offset) of octet ``at`` of WQE ``index`` of ``q``."""
        return q.region.stag, q.at(index) + at

    def _sge(self, q: WorkQueue, index: int, at: int, length: int) -> Sge:
        key, addr = self._field(q, index, at)
        return Sge(key, addr, length)

    # -- building ------------------------------------------------------------------------

    def _shifted(self, q: WorkQueue, index: int, at: int, top: Sge) -> list[Sge]:
        """Scatter entries that place an 8-octet address-order value (a handle, a Block
        Offset) shifted up one octet into the field at ``at`` (value * 256: an alias key's
        Tagged Offset), its top octet into ``top``, in the order the octets come."""
        low = self._sge(q, index, at + (1 if self.little else 0), 7)
        return [low, top] if self.little else [top, low]

    def _handle(self, j: int, q: WorkQueue, index: int, top: Sge) -> Wqe:
        """A loopback Read of the request's handle (in the completion buffer) into the
        address field of WQE ``index`` of ``q``, shifted (see ``_shifted``)."""
        return Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.buffers.stag,
                   remote_offset=self._completion(j) + _H["handle"], length=8,
                   sges=self._shifted(q, index, offset_of("remote_offset"), top))

    def _copy(self, key: int, addr: int, length: int, sges: list[Sge], fence: bool = False) -> Wqe:
        """A loopback Read: ``length`` octets at (key, addr) into ``sges`` (a value needed in
        a second place)."""
        return Wqe(Op.READ, Flag.LOOPBACK | (Flag.FENCE if fence else 0), remote_stag=key,
                   remote_offset=addr, length=length, sges=sges)

    def _guard(self, q: WorkQueue, index: int, fail: Wqe, guard: bytes, passed: Wqe) -> Wqe:
        """The CAS that turns branch WQE ``index`` of ``q`` from ``fail`` into ``passed``
        when its Guard holds ``guard`` (the octets the chain placed there)."""
        want = bytearray(fail.encode(self.little)[:8])
        want[offset_of("guard"):offset_of("guard") + len(guard)] = guard
        return Wqe(Op.CAS, Flag.LOOPBACK | Flag.FENCE, remote_stag=q.region.stag,
                   remote_offset=q.at(index), operand=int.from_bytes(want, self.order),
                   operand2=passed.control(self.little))

    def _entry_guard(self, c: Chain, q: WorkQueue, index: int, flags: int, out: WorkQueue,
                     checked: bool = False) -> None:
        """Guard 2 at WQE ``index`` of ``q``: the branch to ``out`` when the entry's Flags
        are ``flags`` and the request's Generation is the entry's (the first CAS, whose
        compare the entry Read completed) or zero (the second), else to software. With
        ``checked``, the Flags' high octet (always 0 in an entry) is where ``_length_check``
        put its verdict, which must be PASS."""
        fail = Wqe(Op.ENABLE, 0, target=c.s.number, count=ALL)
        passed = Wqe(Op.ENABLE, 0, target=out.number, count=ALL)
        want = bytes((_PASS if checked else 0, flags)) + bytes(2)
        for _ in ("request Generation = entry's", "request Generation 0"):
            self.engine.post(q, self._guard(q, index, fail, want, passed), doorbell=False)
        self.engine.post(q, fail, doorbell=False)

    def _byte_count(self, k: int) -> Wqe:
        """A loopback Read of request ``k``'s byte count from its receive's CQE (in
        registered memory, ``rnic/chains/cqe.py``); its scatter list is the caller's."""
        return Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.cqes.stag,
                   remote_offset=self.recv_cq.cqe(k) + cqe_offset("byte_count"), length=4)

    def _length_check(self, q: WorkQueue, k: int, load_out: WorkQueue, iww: int, inline: bool,
                      branch: Sge) -> None:
        """``COUNT_WRS[inline]`` + 2 WQEs on ``q``. The byte-count check: the receive's
        byte count into a word W preset to 2^40, a FetchAdd of -40, a CAS of W with 2^40 +
        Length (inline data) or 2^40 (none) that swaps in 0, and W's top half into the top
        half of the length check's Tagged Offset, zero only when the request is exactly as
        long as its header says (docs/NOTES.md decision 4). The length check: the request's
        Length (the Data Descriptor's, in LOAD's Write) into the low half of that Tagged
        Offset, of a one-octet Read through a limit key, which reads PASS at offsets 0 to the
        limit (Block Size, or Max Inline for inline data) and zero beyond (the null key),
        then that Read into ``branch``: ordered and equal compares made of data movement, an
        atomic and a CAS (docs/CHAINS.md, "Validation")."""
        e, b = self.engine, self.buffers.stag
        lkey, laddr = self._field(load_out, iww, offset_of("length"))
        word = self._buf(k % self.slots, _COUNT_AT)
        low, high = (0, 4) if self.little else (4, 0)       # the halves of an 8-octet field
        icas, icheck = q.written + self.COUNT_WRS[inline] - 2, q.written + self.COUNT_WRS[inline] + 1
        count = self._byte_count(k)
        count.sges = [Sge(b, word + low, 4)]
        e.post(q, count, doorbell=False)
        e.post(q, Wqe(Op.FETCH_ADD, Flag.LOOPBACK | Flag.FENCE, remote_stag=b, remote_offset=word,
                      operand=-_REQUEST % (1 << 64)), doorbell=False)
        if inline:
            e.post(q, self._copy(lkey, laddr, 4, [self._sge(q, icas, offset_of("operand") + low, 4)]),
                   doorbell=False)
        e.post(q, Wqe(Op.CAS, Flag.LOOPBACK | Flag.FENCE, remote_stag=b, remote_offset=word,
                      operand=_ABOVE, operand2=0), doorbell=False)
        e.post(q, self._copy(b, word + high, 4, [self._sge(q, icheck, offset_of("remote_offset") + high, 4)],
                             fence=True), doorbell=False)
        e.post(q, self._copy(lkey, laddr, 4, [self._sge(q, icheck, offset_of("remote_offset") + low, 4)]),
               doorbell=False)
        limit = self.inline_limit if inline else self.block_limit
        e.post(q, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=limit.stag, length=1,
                      sges=[branch]), doorbell=False)

    def build(self) -> None:
        """Post chain ``built`` into its slot: the receive, the control WQEs, the request
        guard and both operations' stages (docs/CHAINS.md, "Block Load", "Mapped Store")."""
        k = self.built
        c = self.chains[k % self.slots]
        e, b, j = self.engine, self.buffers.stag, c.j
        for q in c.queues:
            e.rewind(q)                 # the branches the last chain here did not take
        done = bytearray(_SCRATCH_AT)     # the completion's constant part, entry buffer, slot word
        done[:2] = bytes((1, Opcode.COMPLETION))
        self.buffers.local(self._completion(j), len(done))[:] = done
        self.buffers.local(self._buf(j, _COUNT_AT), 8)[:] = _ABOVE.to_bytes(8, self.order)
        scratch = Sge(b, self._scratch(j), 1)
        ib1 = c.p.written + 3 + len(_GUARD1)      # A, A2, X, the guard-1 CASes, then B1
        iww, isend = c.o.written, c.o.written + 1                 # LOAD: WRITE, SEND
        guard = offset_of("guard")
        # P: the handle for both entry Reads of LOAD, the STag to invalidate, guard 1
        ir1, ir2, ic2, ib2 = c.f.written, c.f.written + 1, c.f.written + 4, c.f.written + 6
        e.post(c.p, self._handle(j, c.f, ir1, self._sge(c.p, ib1, 1, 1)), doorbell=False)
        e.post(c.p, self._handle(j, c.f, ir2, scratch), doorbell=False)
        skey, saddr = self._field(c.o, iww, offset_of("remote_stag"))
        e.post(c.p, self._copy(skey, saddr, 4, [self._sge(c.o, isend, offset_of("invalidate"), 4)]),
               doorbell=False)
        b1 = Wqe(Op.ENABLE, 0, target=c.s.number, count=ALL)
        stages = {"load": c.f, "inline": c.fs, "read": c.fr}
        stages.update({"alloc-" + ("inline" if inline else "read"): q[0] for inline, q in c.alloc.items()})
        for opcode, flags, stage in _GUARD1:
            then = stages[stage]
            word = bytes((1, opcode)) + flags.to_bytes(2, "big")
            expect = int.from_bytes(word, self.order)
            e.post(c.p, self._guard(c.p, ib1, b1, word,
                                    Wqe(Op.ENABLE, 0, target=then.number, guard=expect, count=ALL)),
                   doorbell=False)
        e.post(c.p, b1, doorbell=False)
        # F (LOAD): the entry into the WRITE and guard 2, the entry into the completion
        entry_sges = [self._sge(c.f, ib2, guard, 2),                          # Flags
                      self._sge(c.f, ic2, offset_of("operand") + 6, 2)]       # Generation
        entry_sges += self._number(c.o, iww, sge_offset(0, "length"))         # Data Length
        entry_sges += self._shifted(c.o, iww, sge_offset(0, "addr"), scratch)  # Block Offset
        e.post(c.f, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.alias.stag, length=M.ENTRY_SIZE,
                        sges=entry_sges), doorbell=False)
        e.post(c.f, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.alias.stag, length=M.ENTRY_SIZE,
                        sges=[Sge(b, self._scratch(j), 2),
                              Sge(b, self._completion(j) + _H["generation"], 2),
                              Sge(b, self._completion(j) + _C_LENGTH, 4),
                              Sge(b, self._completion(j) + _C_OFFSET, 8)]), doorbell=False)
        # the byte count, exactly a request without inline data: PASS into guard 2 (where
        # the entry Flags' high octet, always 0, went) through the byte-count key
        count = self._byte_count(k)
        count.sges = [self._sge(c.f, ic2 - 1, offset_of("remote_offset") + (0 if self.little else 4), 4)]
        e.post(c.f, count, doorbell=False)
        e.post(c.f, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=self.exact.stag, length=1,
                        sges=[self._sge(c.f, ib2, guard, 1)]), doorbell=False)
        self._entry_guard(c, c.f, ib2, EntryFlag.VALID | EntryFlag.SEALED, c.o, checked=True)
        # O (LOAD): the block to the initiator, then the completion with Invalidate
        e.post(c.o, Wqe(Op.WRITE, 0, sges=[Sge(self.blocks.stag, 0, 0)]), doorbell=False)
        e.post(c.o, Wqe(Op.SEND, Flag.SIGNALED | Flag.INVALIDATE, wr_id=Opcode.LOAD << _TAG | k,
                        sges=[Sge(b, self._completion(j), _COMPLETION_SIZE)]), doorbell=False)
        self._store(c, k, ib1, ib2, iww, scratch, inline=True)
        self._store(c, k, ib1, ib2, iww, scratch, inline=False)
        for inline in (True, False):
            self.alloc.build(c, k, ib1, ib2, iww, scratch, inline=inline)
        # S: to software
        e.post(c.s, Wqe(Op.NOP, Flag.SIGNALED, wr_id=k), doorbell=False)
        for q in c.queues:
            e.ring(q)
        # the receive, and the control WQEs that start the chain
        e.post(self.rq, Wqe(Op.RECV, wr_id=k, sges=[
            self._sge(c.p, ib1, guard, 4),                                    # Version .. Flags
            Sge(b, self._completion(j) + _H["request_id"], 16),               # Request ID, handle
            self._sge(c.f, ib2, guard + 2, 2),                                # Generation
            Sge(b, self._scratch(j), 2),                                      # Status
            self._sge(c.o, iww, offset_of("remote_stag"), _DD_SIZE),          # Data Descriptor
            Sge(b, self._rest(j), max(self.rest, 0))]))                       # inline data
        e.post(self.ctl, Wqe(Op.WAIT, target=self.recv_cq.number, count=k + 1), doorbell=False)
        e.post(self.ctl, Wqe(Op.WAIT, target=self.done_cq.number, count=k), doorbell=False)
        e.post(self.ctl, Wqe(Op.ENABLE, target=c.p.number, count=ALL))
        if self.owed:
            self.owed -= 1
        else:
            self.qp.post_recv(1)
        self.built += 1

    def _store(self, c: Chain, k: int, ib1: int, load_b2: int, iww: int, scratch: Sge, *,
               inline: bool) -> None:
        """FS and OS: a mapped STORE with inline data; FR and OR: one whose data the chain
        RDMA-Reads from the request's Data Descriptor (docs/CHAINS.md, "Mapped Store")."""
        e, b, j = self.engine, self.buffers.stag, c.j
        front, out = (c.fs, c.os) if inline else (c.fr, c.or_)
        guard = offset_of("guard")
        entry = self._completion(j) + _COMPLETION_SIZE      # the entry's new octets 0 to 8
        fs = front.written
        ir1, ir2 = fs + 3, fs + 4
        ic2 = fs + (13 if inline else 16) + self.COUNT_WRS[inline]
        ib2 = ic2 + 2
        idata, iwe, isend = out.written, out.written + 1, out.written + 2
        # inline: the block is the Write's remote side; read: the Read's local side
        block_at = offset_of("remote_offset") if inline else sge_offset(0, "addr")
        # the handle into both entry Reads and the entry Write (own range: its own alias)
        for q, index in ((front, ir1), (front, ir2), (out, iwe)):
            e.post(front, self._handle(j, q, index, scratch), doorbell=False)
        e.post(front, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=self.own.stag,
                          length=M.ENTRY_SIZE, sges=[
                              scratch, self._sge(front, ib2, guard + 1, 1),       # Flags
                              self._sge(front, ic2, offset_of("operand") + 6, 2),  # Generation
                              Sge(b, self._scratch(j), 4),
                              *self._shifted(out, idata, block_at, scratch)]),   # Block Offset
               doorbell=False)
        e.post(front, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=self.own.stag,
                          length=M.ENTRY_SIZE, sges=[
                              Sge(b, self._scratch(j), 2), Sge(b, entry + 2, 2),   # Generation
                              Sge(b, self._scratch(j), 4),
                              Sge(b, self._completion(j) + _C_OFFSET, 8)]), doorbell=False)
        # the Generation, the Length and the flags where the entry and the completion want them
        e.post(front, self._copy(b, entry + 2, 2, [Sge(b, self._completion(j) + _H["generation"], 2)],
                                 fence=True), doorbell=False)
        lkey, laddr = self._field(c.o, iww, offset_of("length"))             # the DD's Length
        e.post(front, self._copy(lkey, laddr, 4, [self._sge(out, idata, sge_offset(0, "length"), 4)]),
               doorbell=False)
        e.post(front, self._copy(lkey, laddr, 4, self._number_back(b, entry + 4)), doorbell=False)
        e.post(front, self._copy(b, entry + 4, 4, [Sge(b, self._completion(j) + _C_LENGTH, 4)],
                                 fence=True), doorbell=False)
        # INLINE and SEAL have VALID's and SEALED's bit positions: the request's flags are
        # the entry's new Flags (guard 2 saw VALID without SEALED) ...
        fkey, faddr = self._field(c.p, ib1, guard + 2)
        e.post(front, self._copy(fkey, faddr, 2, [Sge(b, entry, 2)]), doorbell=False)
        if not inline:
            # ... and without INLINE (guard 1 let INVALIDATE through, and SEAL), a masked add
            # of VALID - INVALIDATE to the low octet, carry discarded, makes them so; the Data
            # Descriptor (where the receive put it, in LOAD's Write) into the Read, its STag
            # into the Send with Invalidate
            low = (EntryFlag.VALID - RequestFlag.INVALIDATE) & 0xFF
            e.post(front, Wqe(Op.FETCH_ADD, Flag.LOOPBACK | Flag.FENCE, remote_stag=b, remote_offset=entry,
                              operand=int.from_bytes(bytes((0, low)) + bytes(6), self.order),
                              operand2=_OCTETS), doorbell=False)
            dkey, daddr = self._field(c.o, iww, offset_of("remote_stag"))
            e.post(front, self._copy(dkey, daddr, _DD_SIZE,
                                     [self._sge(out, idata, offset_of("remote_stag"), _DD_SIZE)]),
                   doorbell=False)
            e.post(front, self._copy(dkey, daddr, 4, [self._sge(out, isend, offset_of("invalidate"), 4)]),
                   doorbell=False)
        self._length_check(front, k, c.o, iww, inline, self._sge(front, ib2, guard, 1))
        rkey, raddr = self._field(c.f, load_b2, guard + 2)    # the request's Generation
        e.post(front, self._copy(rkey, raddr, 2, [self._sge(front, ib2, guard + 2, 2)]), doorbell=False)
        self._entry_guard(c, front, ib2, EntryFlag.VALID, out, checked=True)
        # OS: the inline data into the block (through the block alias); OR: the Read of the
        # initiator's buffer into it; then the entry (after the data), the completion
        self._post_data(out, j, inline)
        e.post(out, Wqe(Op.WRITE, Flag.LOOPBACK | Flag.FENCE, remote_stag=self.own.stag,
                        sges=[Sge(b, entry, 8)]), doorbell=False)
        e.post(out, Wqe(Op.SEND, Flag.SIGNALED | (0 if inline else Flag.INVALIDATE),
                        wr_id=Opcode.STORE << _TAG | k,
                        sges=[Sge(b, self._completion(j), _COMPLETION_SIZE)]), doorbell=False)

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

    def _received(self) -> int:
        """Requests the RNIC has received on this connection (its receive completions). The
        idle rule asks before it weighs the session's usage: the handles chains bound count."""
        self.account()
        return self.recv_cq.count

    def _polled(self, cq: CompletionQueue) -> None:
        self.conn.liveness.heard = True     # once per batch: the peer is alive
        self.conn.state.heard_at = self.loop.time()     # and it sent requests
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

    def account(self) -> None:
        """Count the finished chains' requests, and bind in the session's books the handles
        ALLOC_STORE chains bound (the slot's buffer holds them until the slot is rebuilt)."""
        entries = self.done_cq.entries
        chained = Counter(entry.wr_id >> _TAG for entry in entries)
        chained.pop(0, None)                # software's own completions
        if chained[Opcode.ALLOC_STORE]:
            bound = self.conn.state.bound
            for entry in entries:
                if entry.wr_id >> _TAG == Opcode.ALLOC_STORE:
                    bound.add(self.alloc.bound(entry.wr_id % (1 << _TAG) % self.slots))
            self.conn.ring.settle()         # deferred frees of slots the chains consumed
        for opcode, n in chained.items():
            self.metrics.chained(opcode, n)
        entries.clear()

    def _fold(self, tickets: int) -> None:
        """The initiator's own new tickets, seen by a look of the ticket watch, into the
        ALLOC_STORE chains' usage counter (a host-posted loopback FetchAdd on a NIC), so their
        quota guard counts them from that look on (docs/CHAINS.md, finding 14)."""
        self.memory.fetch_add(self.alloc.words.local(0, 8), tickets)

    def refill(self) -> None:
        """Account for the chains that finished and build their successors (one batch);
        in a DIRECT_ALLOC session, look at the initiator's Head too (``_fold``)."""
        done = self.done_cq.count
        self.account()
        if self.watch is not None:
            self.watch.poll()
        if done <= self.refilled:
            return
        self.refilled = done
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
            # the counters of the last, partial batch; no rebuild: a failed work request's
            # error completion counts on the done CQ, and rebuilding its slot would wipe
            # what chain_tickets.recover reads
            self.account()

    async def _serve(self) -> bool:
        # A chain takes milliseconds to build, a connection's tens of them a few tenths of
        # a second. One connection builds at a time, a chain per turn of the loop, so
        # other connections' set-ups and requests run in between: built all at once, a
        # host's parallel connects timed out behind each other's chains (issue 32, T7).
        async with self.target.chain_builds:
            for _ in range(self.slots):
                if self.qp.error is not None:
                    raise self.qp.error
                self.build()
                await asyncio.sleep(0)
        attach(self.engine, self.qp, self.rq, self._lost)
        self.engine.run()
        self._poll_data()
        self.watchdog = chain_tickets.Watchdog(self, self.target.executor.allocate_timeout)
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            if self.ended is not None:
                raise self.ended
            if self.qp.error is not None:
                raise self.qp.error
            await self._backpressure()
            self.refill()
            while self.software:
                k = self.software.popleft()
                release = await self._software(k)
                if release is not None:
                    return release
            self.refill()

    async def _backpressure(self) -> None:
        """Once per batch: the answers the chains sent since the last look join the
        connection's backlog (``backlog.py``), covered by the port's last signaled Send
        (no frame of its own). While the peer has not taken them, the refill
        waits, so no receive is posted and the peer's requests stall after the chains
        already built; past ``backlog_timeout_s`` the connection ends, as in software."""
        future, sends, octets = self.port.covered
        if future is not None and sends > self.sent[0]:
            self.conn.backlog.posted(octets - self.sent[1], future, sends - self.sent[0])
            self.sent = (sends, octets)
        if self.conn.backlog.over:
            await self.conn._throttle()

    def _poll_data(self) -> None:
        """An RNIC re-reads the words its wait-on-data WQEs watch; the host's writes (a FREE
        filling a ring slot) reach no engine callback, so the engine looks again every 2 ms."""
        if self.engine.requester.data_waiters:
            self.engine.requester.memory_changed()
            self.engine.run()
        self.poll = self.loop.call_later(0.002, self._poll_data)

    def _lost(self, error: BaseException) -> None:
        self.ended = error
        self.wakeup.set()

    async def _software(self, k: int) -> bool | None:
        """Serve request ``k`` as the software target does; GOODBYE's RELEASE, or None."""
        conn = self.conn
        self.refill()                   # every chain before k has completed: account for them
        req, why = conn.parse(self.request_bytes(k))
        self.metrics.python_request(req["opcode"])
        outcome, why = await conn.execute(req, None, why)
        if outcome is None:
            return bool(req["flags"] & GoodbyeFlag.RELEASE)
        self._finish(k, req, outcome, why)
        return None

    def fail(self, k: int, status: int) -> None:
        """Answer request ``k`` with ``status`` from software, for a chain that cannot
        finish it (``chain_tickets.Watchdog``); every chain before it has completed."""
        self.refill()
        req, why = self.conn.parse(self.request_bytes(k))
        self.metrics.python_request(req["opcode"])
        self._finish(k, req, self.target.executor.failure(status, req["handle"]), why)

    def _finish(self, k: int, req: AnyMessage, outcome: Outcome, why: str) -> None:
        """The COMPLETION of request ``k``, then its done completion: the next chain runs."""
        self.conn._complete(req, outcome, why)
        self.alloc.resync()             # no chain in flight: the usage counter from the truth
        self.engine.signal(self.done_cq, k)

    def close(self) -> None:
        self.conn.state.received = None
        if self.watch is not None:
            self.watch.counted = None
        chain_tickets.recover(self)         # chains the connection's end cut short
        self.alloc.close()
        if self.poll is not None:
            self.poll.cancel()
        if self.watchdog is not None:
            self.watchdog.stop()
        for region in (self.alias, self.own, self.blocks, self.staging, self.buffers, self.block_limit,
                       self.inline_limit, self.exact, self.cqes):
            self.memory.deregister(region.stag)
        for q in self.engine.queues:
            self.memory.deregister(q.region.stag)

