"""The chain engine without sockets: each primitive on registered memory, and its wire output.

A recording port stands in for the connection: it keeps the work requests the engine
hands out and lets the test complete them, as a peer's responses would.
"""
from __future__ import annotations

import asyncio

import pytest

from kbtp_scapy import codec
from kbtp_scapy.ring import add_mask
from kbtp_scapy.rnic.chains import Cond, Engine, Flag, Op, Sge, Wqe
from kbtp_scapy.rnic.chains.alias import handle_offset, register_handle_alias
from kbtp_scapy.rnic.chains.cqe import CQE
from kbtp_scapy.rnic.chains.driver import QueuePairPort
from kbtp_scapy.rnic.chains.wqe import ALL, offset_of
from kbtp_scapy.rnic.memory import Access, AccessError, Fault, MemoryTable
from kbtp_scapy.rnic.qp import QueuePair, Verb, WorkRequest
from kbtp_scapy.tables import RING_COUNTER
from kbtp_scapy.tables.messages import DATA_DESCRIPTOR

RW = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[WorkRequest, object]] = []

    def transmit(self, wr: WorkRequest, done) -> None:
        self.sent.append((wr, done))


def engine(little: bool = False) -> tuple[Engine, Recorder, MemoryTable]:
    memory = MemoryTable("little" if little else "big")
    port = Recorder()
    return Engine(memory, port, little), port, memory


@pytest.mark.parametrize("little", [False, True])
def test_wqe_round_trip_and_the_descriptor_layout(little: bool) -> None:
    w = Wqe(Op.CAS, Flag.LOOPBACK | Flag.FENCE, 3, 0x01100008, 0xABCD, 1 << 40, 77, 5, 1,
            0x1122334455667788, 0x99, 42, 0xFEED, [Sge(1, 2, 3), Sge(4, 5, 6)])
    assert Wqe.decode(w.encode(little), little) == w
    # the remote fields lie as a KBTP Data Descriptor does, so one scatter entry places it
    dd = codec.encode_struct(DATA_DESCRIPTOR, {"stag": 0x1234, "offset": 0x5678,
                                               "length": 99}, little)
    raw = bytearray(Wqe(Op.WRITE).encode(little))
    raw[offset_of("remote_stag"):offset_of("remote_stag") + len(dd)] = dd
    got = Wqe.decode(raw, little)
    assert (got.remote_stag, got.remote_offset, got.length) == (0x1234, 0x5678, 99)


def test_a_receive_scatters_into_a_later_wqe_and_wait_enable_start_it() -> None:
    e, port, memory = engine()
    rcq, scq = e.create_cq(), e.create_cq()
    rq = e.create_queue(2, rcq, receive=True)
    ctl = e.create_queue(4, scq)
    sq = e.create_queue(4, scq, managed=True)
    data = memory.register(bytearray(b"block data here!"), RW)
    index = e.post(sq, Wqe(Op.WRITE, sges=[Sge(data.stag, 0, 10)]))
    at = offset_of("remote_stag")
    e.post(rq, Wqe(Op.RECV, sges=[Sge(sq.region.stag, sq.at(index) + at, 12)]))
    e.post(ctl, Wqe(Op.WAIT, target=rcq.number, count=1))
    e.post(ctl, Wqe(Op.ENABLE, target=sq.number, count=ALL))
    e.run()
    assert port.sent == [] and ctl.next == 0          # WAIT holds the control queue
    e.deliver(rq, (0xAA).to_bytes(4, "big") + (0x1000).to_bytes(8, "big"))
    (wr, done), = port.sent
    assert (wr.verb, wr.stag, wr.offset, wr.payload) == (Verb.WRITE, 0xAA, 0x1000, b"block data")
    assert done is None and rcq.count == 1


@pytest.mark.parametrize("little", [False, True])
def test_a_receive_cqe_in_memory_gives_its_byte_count_to_a_loopback_read(little: bool) -> None:
    """A CQ with a CQE ring in registered memory (mlx5's CQ buffer is host memory): each
    receive's byte count lands in its CQE, where a loopback Read places it into a WQE."""
    e, _, memory = engine(little)
    rcq, scq = e.create_cq(cqes=2), e.create_cq()
    assert rcq.ring is not None
    rq = e.create_queue(3, rcq, receive=True)
    sq = e.create_queue(4, scq)
    sink = memory.register(bytearray(64), RW)
    for _ in range(3):
        e.post(rq, Wqe(Op.RECV, wr_id=7, sges=[Sge(sink.stag, 0, 64)]))
    for size in (40, 52, 9):              # the third wraps the two-entry ring onto the first
        e.deliver(rq, bytes(size))
    order = "little" if little else "big"
    at = CQE.offset("byte_count")
    counts = [int.from_bytes(rcq.ring.local(rcq.cqe(i) + at, 4), order) for i in (0, 1)]
    assert counts == [9, 52]
    e.post(sq, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=rcq.ring.stag,
                   remote_offset=rcq.cqe(1) + at, length=4, sges=[Sge(sink.stag, 8, 4)]))
    e.run()
    assert int.from_bytes(sink.local(8, 4), order) == 52
    assert int.from_bytes(rcq.ring.local(rcq.cqe(1) + CQE.offset("wr_id"), 8), order) == 7


def test_cas_on_a_control_word_turns_a_wqe_on_or_leaves_it_off() -> None:
    """RedN's conditional: a WQE posted as NOP runs as a WRITE only if the CAS matched."""
    for value, runs in ((7, True), (8, False)):
        e, port, memory = engine()
        cq = e.create_cq()
        sq = e.create_queue(4, cq)
        data = memory.register(bytearray(8), RW)
        off = Wqe(Op.NOP, guard=7, sges=[Sge(data.stag, 0, 8)])
        on = Wqe(Op.WRITE, guard=7, sges=[Sge(data.stag, 0, 8)])
        at = sq.at(1)
        # the value under test goes into the guard of the target WQE (as a scatter would)
        e.post(sq, Wqe(Op.CAS, Flag.LOOPBACK, remote_stag=sq.region.stag, remote_offset=at,
                       operand=off.control(False), operand2=on.control(False)), doorbell=False)
        e.post(sq, off, doorbell=False)
        sq.region.local(at + offset_of("guard"), 4)[:] = value.to_bytes(4, "big")
        e.ring(sq)
        e.run()
        assert bool(port.sent) is runs and sq.next == 2


def test_fence_waits_for_a_read_that_patches_the_next_wqe() -> None:
    e, port, memory = engine()
    cq = e.create_cq()
    sq = e.create_queue(4, cq)
    local = memory.register(bytearray(16), RW)
    patch = Sge(sq.region.stag, sq.at(1) + offset_of("remote_offset"), 8)
    read = e.post(sq, Wqe(Op.READ, remote_stag=9, length=8, sges=[patch]), doorbell=False)
    e.post(sq, Wqe(Op.WRITE, Flag.FENCE, remote_stag=5, sges=[Sge(local.stag, 0, 4)]), doorbell=False)
    e.ring(sq)
    e.run()
    assert read == 0 and len(port.sent) == 1 and sq.inflight == 1      # the WRITE waits
    _, done = port.sent[0]
    done(bytearray((0x4321).to_bytes(8, "big")), None)
    e.run()
    wr, _ = port.sent[1]
    assert (wr.verb, wr.stag, wr.offset) == (Verb.WRITE, 5, 0x4321)


@pytest.mark.parametrize("cond,start,fires", [(Cond.EQ, 0x00FF, False), (Cond.EQ, 0x12FF, True),
                                              (Cond.NE, 0x12FF, False), (Cond.NE, 0x13FF, True)])
def test_wait_on_data_compares_under_a_mask(cond: Cond, start: int, fires: bool) -> None:
    e, port, memory = engine()
    cq = e.create_cq(polled=True)
    sq = e.create_queue(4, cq)
    word = memory.register(bytearray(start.to_bytes(8, "big")), RW)
    e.post(sq, Wqe(Op.WAIT_DATA, remote_stag=word.stag, operand=0x1200, operand2=0xFF00, cond=cond))
    e.post(sq, Wqe(Op.NOP, Flag.SIGNALED, wr_id=1))
    e.run()
    assert (cq.count == 1) is fires
    word.local(0, 8)[:] = (0x12AA).to_bytes(8, "big")    # the host changes the word
    e.kick()
    assert cq.count == (1 if fires or cond is Cond.EQ else 0)


def test_masked_fetch_add_is_the_specifications_ring_counter() -> None:
    """Spec "Examples": N = 4, Add Data 0x0000000100000010, Add Mask 0x8000000080000020;
    each FetchAdd's original value lands in a later WQE's remote offset."""
    e, port, memory = engine(little=True)
    cq = e.create_cq()
    sq = e.create_queue(16, cq)
    head = memory.register(bytearray(8), RW)
    for _ in range(5):
        e.post(sq, Wqe(Op.FETCH_ADD, Flag.LOOPBACK, remote_stag=head.stag,
                       operand=RING_COUNTER.masked_add_data, operand2=add_mask(2),
                       sges=[Sge(sq.region.stag, sq.at(sq.written + 1) + offset_of("remote_offset"), 8)]),
               doorbell=False)
        e.post(sq, Wqe(Op.NOP), doorbell=False)
    e.ring(sq)
    e.run()
    got = [Wqe.decode(sq.slot(i), True).remote_offset for i in range(1, 10, 2)]
    assert [(v >> 32, v & 0xFF) for v in got] == [(0, 0), (1, 16), (2, 32), (3, 48), (4, 0)]
    assert int.from_bytes(head.local(0, 8), "little") == 0x0000000500000010


def test_the_handle_alias_reaches_entries_and_reads_zero_elsewhere() -> None:
    memory = MemoryTable("big")
    table = bytearray(range(48))                   # three 16-octet entries
    alias = register_handle_alias(memory, table, 0x4000, 3, 16)
    assert bytes(memory.remote(alias.stag, handle_offset(0x4001), 16, 1)) == table[16:32]
    for outside in (0x3FFF, 0x4003, 1 << 40):
        assert bytes(memory.remote(alias.stag, handle_offset(outside), 16, 1)) == bytes(16)
    # a handle whose top octet is set aliases: the chain checks that octet itself
    assert handle_offset(0x4001 + (1 << 56)) == handle_offset(0x4001)


def test_a_loopback_fault_puts_the_queue_in_error() -> None:
    e, port, memory = engine()
    cq = e.create_cq(polled=True)
    sq = e.create_queue(2, cq)
    e.post(sq, Wqe(Op.READ, Flag.LOOPBACK, remote_stag=0xDEAD, length=8, sges=[]))
    e.run()
    assert sq.error is not None and "invalid STag" in sq.error and cq.entries[0].status == sq.error


def test_the_engines_work_requests_are_the_qps_own() -> None:
    """Wire output: what the engine posts on a QueuePair is the WorkRequest the software
    target posts for the same operation (so the transport frames it the same way)."""
    class Capture(QueuePair):
        transport = "roce"

        def __init__(self) -> None:
            super().__init__(MemoryTable("big"))
            self.posted_wrs: list[WorkRequest] = []

        def _transmit(self, wr: WorkRequest) -> None:
            self.posted_wrs.append(wr)

    async def main() -> None:
        direct, chained = Capture(), Capture()
        payload = bytes(range(40))
        direct.write(0x11, 0x2000, b"data", signaled=False)
        direct.send(payload, invalidate=0x11, signaled=False)
        e = Engine(chained.memory, QueuePairPort(chained), False)
        buf = chained.memory.register(bytearray(b"data" + payload), RW)
        sq = e.create_queue(4, e.create_cq())
        e.post(sq, Wqe(Op.WRITE, remote_stag=0x11, remote_offset=0x2000, sges=[Sge(buf.stag, 0, 4)]))
        e.post(sq, Wqe(Op.SEND, Flag.INVALIDATE | Flag.SIGNALED, invalidate=0x11,
                       sges=[Sge(buf.stag, 4, 40)]))
        e.run()
        fields = lambda wr: (wr.verb, wr.payload, wr.stag, wr.offset, wr.length, wr.invalidate,
                             wr.solicited, wr.imm, wr.future is None)
        assert [fields(w) for w in chained.posted_wrs] == [fields(w) for w in direct.posted_wrs]
    asyncio.run(main())


def test_no_peer_reaches_the_engines_queues() -> None:
    """WQE slots are the chain's to write, through its loopback QP only: a peer's RDMA
    Write naming their STag is refused (a window bound to the loopback)."""
    e, _, memory = engine()
    sq = e.create_queue(2, e.create_cq())
    peer = object()
    with pytest.raises(AccessError) as refused:
        memory.remote_write(sq.region.stag, sq.at(0), b"\0" * 8, peer)
    assert refused.value.fault is Fault.WRONG_CONNECTION
