"""ALLOC_STORE as a work-request chain: quota, entry, free-block ring, data, entry, completion.

Built for both memory orders. iWARP's masked FetchAdd on Head returns the ticket's Slot
Offset as an address a chain can place. RoCEv2's unmasked Head returns the ticket only, and
the slot, ``16 * (ticket mod N)``, comes from a slot alias key: Tagged Offset ``t * 256``
reaches slot ``t mod N`` for the ticket's ``ceil(n / 8)`` low octets t, a key spanning
``2 ** (8 * octets + 8)`` octets, so rings of any size. The Generation's successor is a
masked FetchAdd and a CAS for its wrap in big-endian memory; in little-endian memory
(ADDR_LE: the network-order Generation's carry would run the wrong way) it is a loopback
Read of a successor table through one more alias key, indexed by the old Generation
(docs/CHAINS.md, "ALLOC_STORE, WR by WR"). In a DIRECT_ALLOC session the chains take tickets
from the partition's ring, and tell the ticket watch which before it looks (a scan of the
chain slots, per look rather than per request).

The quota is a counter in the chain's memory, ``2^32 - quota + usage``: the chain adds 1 and
goes on only while the original value's top half is 0. The target's Python sets it from the
session's usage whenever no chain of the connection is in flight (before a software request
completes), and learns the handles chains bound at each refill, from their completion buffers.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from ..rnic.chains import Flag, Op, Sge, Wqe
from ..rnic.chains.alias import register_alias
from ..rnic.chains.engine import LOOPBACK_ACCESS
from ..rnic.chains.queues import WorkQueue
from ..rnic.chains.wqe import Cond, offset_of, sge_offset
from ..rnic.memory import Access
from ..tables import memory as M
from ..tables.messages import COMPLETION, HEADER
from ..vocab import EntryFlag, Opcode, RequestFlag
from .table import next_generation

if TYPE_CHECKING:
    from .chains import Chain, ChainRunner

_COMPLETION_SIZE = HEADER.size + COMPLETION.size
_C_LENGTH, _C_OFFSET = (HEADER.size + COMPLETION.offset(f) for f in ("data_length", "block_offset"))
_GENERATION, _HANDLE = HEADER.offset("generation"), HEADER.offset("handle")
_E_GENERATION = M.TABLE_ENTRY.offset("generation")
_GENERATION_SIZE = M.TABLE_ENTRY.item("generation").size
_SLOT_WORD = 56                 # a slot's buffer: the ticket's Slot Offset, as an 8-octet address
_ONES = M.SLOT_CONSUMED.to_bytes(8, "big")
_U64 = (1 << 64) - 1
# Add Mask of the entry's first word (Flags, Generation, Data Length): each Flags octet adds
# on its own, the Generation as 16 bits, Data Length as 32
_ENTRY_MASK = (1 << 63) | (1 << 55) | (1 << 47) | (1 << 31)
_OCTETS = int.from_bytes(b"\x80" * 8, "big")
_OPERAND = offset_of("operand")
_REMOTE = offset_of("remote_offset")


def ticket_octets(n: int) -> int:
    """The ticket's low octets an unmasked Head's chain places (shifted, ``t * 256``) to reach
    slot ``t mod 2**n`` through the slot alias key: enough to hold n bits."""
    return max(1, -(-n // 8))


@functools.cache
def successors() -> bytes:
    """The successor table: entry g is the Generation after g (skipping zero), in network
    order, as the Generation is in a table entry."""
    return b"".join(next_generation(g).to_bytes(_GENERATION_SIZE, "big")
                    for g in range(1 << 8 * _GENERATION_SIZE))


class Steps(NamedTuple):
    """Where a chain's WQEs sit on its output queue: how far it got is ``out.next`` against
    them (the host's look at a chain caught between its ticket and its Send, chain_tickets.py)."""

    out: WorkQueue
    ticket: int             # the FetchAdd on Head
    wait: int               # WD1, whose Operand holds the ticket
    consume: int            # CW: the slot consumed
    entry: int              # WE1: the entry's Data Length and Block Offset
    valid: int              # FAE: the entry VALID
    send: int


class AllocStage:
    """The regions an ALLOC_STORE chain uses beyond the runner's, and its builder."""

    def __init__(self, runner: ChainRunner) -> None:
        self.runner = runner
        memory, loopback = runner.memory, runner.engine.loopback
        ring = runner.conn.ring
        self.ring = ring
        slots = ring.slots.obj
        if ring.masked:             # Tagged Offset: the Slot Offset Head returns
            self.slots = memory.register(slots, LOOPBACK_ACCESS, connection=loopback)
            # Tagged Offset o reaches a slot's octet o + 8 (its Block Offset): no placement adds 8
            self.slot_blocks = memory.register(slots, LOOPBACK_ACCESS, start=8, connection=loopback)
        else:                       # Tagged Offset: the ticket's low octets * 256
            self.octets = ticket_octets(ring.n)
            self.slots, self.slot_blocks = (
                register_alias(memory, slots, 0, 1 << 8 * self.octets, M.SLOT_SIZE - at,
                               pitch=M.SLOT_SIZE, start=at, wrap=ring.size, connection=loopback)
                for at in (0, 8))
        self.head = memory.register(ring.head.obj, LOOPBACK_ACCESS, connection=loopback)
        # 0: the usage counter; 8: all ones (what consumes a slot)
        self.words = memory.register(bytearray(8) + bytearray(_ONES), LOOPBACK_ACCESS,
                                     connection=loopback)
        t, own = runner.target, runner.conn.state
        # the entry's octets 4 to 16 at h * 256: Data Length and Block Offset go first
        self.tail = register_alias(memory, t.memory.table_buffer, own.handle_base, own.handle_count,
                                   M.ENTRY_SIZE - 4, pitch=M.ENTRY_SIZE,
                                   start=(own.handle_base - t.memory.table.base_handle) * M.ENTRY_SIZE + 4,
                                   connection=loopback)
        self.regions = [self.slots, self.slot_blocks, self.head, self.words, self.tail]
        if runner.little:           # Tagged Offset g * 256: the successor of Generation g
            self.successor = register_alias(memory, successors(), 0, 1 << 8 * _GENERATION_SIZE,
                                            _GENERATION_SIZE, pitch=_GENERATION_SIZE,
                                            connection=loopback, access=Access.REMOTE_READ)
            self.regions.append(self.successor)
        # chain slot -> (output queue, index of its FetchAdd on Head) not yet told to the watch
        self.unreported: dict[int, list[tuple[WorkQueue, int]]] = {}
        self.steps: dict[tuple[int, bool], Steps] = {}     # (chain slot, inline): its last build
        self.watch = runner.conn.state.watch
        if self.watch is not None:
            self.watch.before_poll = self.report
        self.resync()

    def report(self) -> None:
        """Tell the ticket watch the tickets chains took (the ticket is in the operand of the
        wait-on-data WQE after the FetchAdd, in network order as a slot's Sequence), so it
        does not take them for the initiator's."""
        if self.watch is None:
            return
        for outs in self.unreported.values():
            for out, at in list(outs):
                if out.next > at:
                    self.watch.taken_by_target(self.ticket(out, at + (5 if self.ring.masked else 6)))
                    outs.remove((out, at))

    @staticmethod
    def ticket(out: WorkQueue, wd1: int) -> int:
        """The ticket a chain took: the FetchAdd put it into its wait-on-data WQE's Operand."""
        return Wqe.decode(out.slot(wd1), False).operand >> 32

    def resync(self) -> None:
        """The usage counter from the session's usage (no chain of this connection in flight)."""
        state = self.runner.conn.state
        value = ((1 << 32) - state.quota + state.usage) & _U64
        self.words.local(0, 8)[:] = value.to_bytes(8, self.runner.order)

    def bound(self, j: int) -> int:
        """The handle of the ALLOC_STORE chain slot ``j`` ran (from its completion buffer)."""
        r = self.runner
        return int.from_bytes(r.buffers.local(r._completion(j) + _HANDLE, 8), r.order)

    def _top_half_low_octet(self, wanted: Sge, scratch: int) -> list[Sge]:
        """Scatter entries for a counter's original value (8 octets, memory order): the low
        octet of its top half into ``wanted``, the others to scratch."""
        b = self.runner.buffers.stag
        before, after = (4, 3) if self.runner.little else (3, 4)
        return [Sge(b, scratch, before), wanted, Sge(b, scratch, after)]

    def build(self, c: Chain, k: int, ib1: int, load_b2: int, iww: int, scratch: Sge, *,
              inline: bool) -> None:
        """The three stages of one ALLOC_STORE variant: entry guard, quota guard, output."""
        r, ring, little = self.runner, self.ring, self.runner.little
        e, b, j = r.engine, r.buffers.stag, c.j
        front, quota, out = c.alloc[inline]
        guard = offset_of("guard")
        comp = r._completion(j)
        entry = comp + _COMPLETION_SIZE                 # E: the entry's new octets 0 to 16
        word = r._buf(j, _SLOT_WORD)
        n_front = front.written
        o = out.written
        step = 0 if ring.masked else 1          # unmasked Head: one more Read, the ticket's octets
        scratch4 = Sge(b, r._scratch(j), 4)
        if inline:
            self.report()               # the last chain of this slot is done with its ticket
            self.unreported[j] = []
        self.unreported[j].append((out, o))
        wd1, wd2, rs, cw, idata, iwe1, igen = (o + step + i for i in (5, 6, 7, 8, 12, 13, 14))
        # the Generation's successor: the entry's first word (FetchAdd, CAS, its Generation
        # read back), or through the successor table (read the Generation, its successor,
        # write Flags and successor)
        bind = (igen + 3, igen + 4, igen + 5) if not little else (igen, igen + 2)
        isend = bind[-1] + 1
        places = [(out, iwe1), *((out, i) for i in bind)]
        ir1 = n_front + 1 + len(places)
        ic2 = ir1 + (7 if inline else 10) + r.COUNT_WRS[inline]
        ib2 = ic2 + 2
        self.steps[j, inline] = Steps(out, o, wd1, cw, iwe1, bind[0] if not little else bind[-1], isend)
        block_at = offset_of("remote_offset") if inline else sge_offset(0, "addr")
        # front: the handle wherever the entry is read or written, then guard 2 (not VALID)
        for q, index in ((front, ir1), *places):
            e.post(front, r._handle(j, q, index, scratch), doorbell=False)
        # Block Offset's last three octets into the quota branch's Guard: all ones in an unbound
        # entry (docs/NOTES.md decision 1), zeros through the null key (outside the range)
        ib3 = quota.written + 2
        e.post(front, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=r.own.stag,
                          length=M.ENTRY_SIZE, sges=[
                              scratch, r._sge(front, ib2, guard + 1, 1),        # Flags
                              r._sge(front, ic2, _OPERAND + 6, 2),              # Generation
                              Sge(b, r._scratch(j), 9),
                              r._sge(quota, ib3, guard + 1, 3)]), doorbell=False)
        fkey, faddr = r._field(c.p, ib1, guard + 2)                        # the request's Flags
        e.post(front, r._copy(fkey, faddr, 2, [Sge(b, entry, 2)]), doorbell=False)
        lkey, laddr = r._field(c.o, iww, offset_of("length"))              # the DD's Length
        e.post(front, r._copy(lkey, laddr, 4, r._number_back(b, entry + 4)), doorbell=False)
        e.post(front, r._copy(lkey, laddr, 4, [r._sge(out, idata, sge_offset(0, "length"), 4)]),
               doorbell=False)
        if not inline:                  # VALID - INVALIDATE into the low Flags octet
            low = (EntryFlag.VALID - RequestFlag.INVALIDATE) & 0xFF
            e.post(front, Wqe(Op.FETCH_ADD, Flag.LOOPBACK | Flag.FENCE, remote_stag=b, remote_offset=entry,
                              operand=int.from_bytes(bytes((0, low)) + bytes(6), r.order),
                              operand2=_OCTETS), doorbell=False)
            dkey, daddr = r._field(c.o, iww, offset_of("remote_stag"))
            e.post(front, r._copy(dkey, daddr, 16, [r._sge(out, idata, offset_of("remote_stag"), 16)]),
                   doorbell=False)
            e.post(front, r._copy(dkey, daddr, 4, [r._sge(out, isend, offset_of("invalidate"), 4)]),
                   doorbell=False)
        r._length_check(front, k, c.o, iww, inline, r._sge(front, ib2, guard, 1))
        rkey, raddr = r._field(c.f, load_b2, guard + 2)                    # the request's Generation
        e.post(front, r._copy(rkey, raddr, 2, [r._sge(front, ib2, guard + 2, 2)]), doorbell=False)
        r._entry_guard(c, front, ib2, 0, quota, checked=True)
        # quota: add 1 to the usage counter; the low octet of its original top half (0 while
        # usage < quota, else 1) into the branch's Guard, beside the Block Offset's octets
        e.post(quota, Wqe(Op.FETCH_ADD, Flag.LOOPBACK, remote_stag=self.words.stag, operand=1,
                          sges=self._top_half_low_octet(r._sge(quota, ib3, guard, 1), r._scratch(j))),
               doorbell=False)
        fail = Wqe(Op.ENABLE, 0, target=c.s.number)
        e.post(quota, r._guard(quota, ib3, fail, bytes(1) + _ONES[:3], Wqe(Op.ENABLE, 0, target=out.number)),
               doorbell=False)
        e.post(quota, fail, doorbell=False)
        # out: a ticket (FetchAdd on Head) into WD1's operand in network order (a slot's
        # Sequence is), the Slot Offset (masked Head) or nothing (unmasked) into A
        ticket = r._number(out, wd1, _OPERAND)
        low_half = Sge(b, word + (0 if little else 4), 4) if ring.masked else scratch4
        e.post(out, Wqe(Op.FETCH_ADD, Flag.LOOPBACK, remote_stag=self.head.stag, operand=ring.add,
                        operand2=ring.mask or 0,
                        sges=[low_half, *ticket] if little else [*ticket, low_half]), doorbell=False)
        if not ring.masked:         # the ticket's low octets, shifted one octet up, into A
            m = self.octets
            tkey, taddr = r._field(out, wd1, _OPERAND + 4 - m)
            into = [Sge(b, word + m - i, 1) for i in range(m)] if little else [Sge(b, word + 7 - m, m)]
            e.post(out, r._copy(tkey, taddr, m, into, fence=True), doorbell=False)
        for index in (wd1, wd2, rs, cw):
            e.post(out, r._copy(b, word, 8, [r._sge(out, index, _REMOTE, 8)], fence=True), doorbell=False)
        e.post(out, Wqe(Op.WAIT_DATA, remote_stag=self.slots.stag, cond=Cond.EQ,           # Sequence
                        operand2=int.from_bytes(_ONES[:4] + bytes(4), r.order)), doorbell=False)
        e.post(out, Wqe(Op.WAIT_DATA, remote_stag=self.slot_blocks.stag, cond=Cond.NE,
                        operand=M.SLOT_CONSUMED, operand2=_U64), doorbell=False)  # a block in it
        e.post(out, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.slots.stag, length=M.SLOT_SIZE,
                        sges=[Sge(b, r._scratch(j), 8), Sge(b, comp + _C_OFFSET, 8)]), doorbell=False)
        e.post(out, Wqe(Op.WRITE, Flag.LOOPBACK, remote_stag=self.slot_blocks.stag,
                        sges=[Sge(self.words.stag, 8, 8)]), doorbell=False)       # consumed
        # the block where the data, the entry and the completion want it
        e.post(out, r._copy(b, comp + _C_OFFSET, 8, r._shifted(out, idata, block_at, scratch),
                            fence=True), doorbell=False)
        e.post(out, r._copy(b, comp + _C_OFFSET, 8, [Sge(b, entry + 8, 8)]), doorbell=False)
        e.post(out, r._copy(b, entry + 4, 4, [Sge(b, comp + _C_LENGTH, 4)]), doorbell=False)
        r._post_data(out, j, inline)
        # the entry: Data Length and Block Offset, then Flags and the Generation's successor
        e.post(out, Wqe(Op.WRITE, Flag.LOOPBACK | Flag.FENCE, remote_stag=self.tail.stag,
                        sges=[Sge(b, entry + 4, 12)]), doorbell=False)
        if little:
            self._successor_from_table(out, igen, comp, entry)
        else:
            self._successor_by_add(out, igen + 3, comp, entry, r._scratch(j))
        e.post(out, Wqe(Op.SEND, Flag.SIGNALED | (0 if inline else Flag.INVALIDATE),
                        wr_id=Opcode.ALLOC_STORE << 56 | k,
                        sges=[Sge(b, comp, _COMPLETION_SIZE)]), doorbell=False)
        assert out.written - o == isend - o + 1 and front.written - n_front == ib2 - n_front + 1

    def _successor_by_add(self, out: WorkQueue, ifa: int, comp: int, entry: int, scratch: int) -> None:
        """Big-endian memory: the new Flags and Generation + 1 added to the entry's first word
        at once (the one write that makes it VALID), a CAS for the wrap to zero, then the
        Generation read back into the completion. The handle is in FAE, CASW and GRB."""
        r = self.runner
        e, b = r.engine, r.buffers.stag
        icas = ifa + 1
        e.post(out, r._copy(b, entry, 2, [r._sge(out, ifa, _OPERAND, 2)]), doorbell=False)
        e.post(out, r._copy(b, entry, 8, [r._sge(out, icas, _OPERAND, 8)]), doorbell=False)
        e.post(out, r._copy(b, entry, 8, [r._sge(out, icas, offset_of("operand2"), 2), Sge(b, scratch, 2),
                                          r._sge(out, icas, offset_of("operand2") + 4, 4)]), doorbell=False)
        e.post(out, Wqe(Op.FETCH_ADD, Flag.LOOPBACK | Flag.FENCE, remote_stag=r.own.stag,
                        operand=1 << 32, operand2=_ENTRY_MASK), doorbell=False)
        e.post(out, Wqe(Op.CAS, Flag.LOOPBACK | Flag.FENCE, remote_stag=r.own.stag,
                        operand2=1 << 32), doorbell=False)                       # Generation 0 -> 1
        e.post(out, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=r.own.stag, length=4,
                        sges=[Sge(b, scratch, 2), Sge(b, comp + _GENERATION, 2)]), doorbell=False)

    def _successor_from_table(self, out: WorkQueue, igr: int, comp: int, entry: int) -> None:
        """Little-endian memory, where no add carries a network-order Generation: its two
        octets read from the entry into the successor Read's Tagged Offset (reversed, as
        ``g * 256`` in a little-endian field), the successor into the completion, then one
        Write of the new Flags and that successor over the entry's octets 0 to 4, which makes
        it VALID. The handle is in GR (its low octet posted: the Generation's place in the
        entry) and WF."""
        r = self.runner
        e, b = r.engine, r.buffers.stag
        isucc = igr + 1
        e.post(out, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=r.own.stag, remote_offset=_E_GENERATION,
                        length=2, sges=[r._sge(out, isucc, _REMOTE + 2, 1), r._sge(out, isucc, _REMOTE + 1, 1)]),
               doorbell=False)
        e.post(out, Wqe(Op.READ, Flag.LOOPBACK | Flag.FENCE, remote_stag=self.successor.stag, length=2,
                        sges=[Sge(b, comp + _GENERATION, 2)]), doorbell=False)
        e.post(out, Wqe(Op.WRITE, Flag.LOOPBACK | Flag.FENCE, remote_stag=r.own.stag,
                        sges=[Sge(b, entry, _E_GENERATION),              # Flags: the octets before it
                              Sge(b, comp + _GENERATION, 2)]), doorbell=False)

    def close(self) -> None:
        if self.watch is not None:
            self.report()
            self.watch.before_poll = None
        for region in self.regions:
            self.runner.memory.deregister(region.stag)
