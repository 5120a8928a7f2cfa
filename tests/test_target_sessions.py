"""Sessions, direct modes, isolation and bad input, against the real target on loopback."""
from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest

from kbtp_scapy import codec
from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.rnic.qp import ConnectionLost, RemoteError
from kbtp_scapy.tables import memory as M
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.audit import audit
from kbtp_scapy.vocab import Feature, Opcode, Status

from .kbtp_harness import TargetThread

TRANSPORTS = ["iwarp", "roce"]


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


BASE = dict(blocks=64, block_size=4096, max_initiators=4, retention_s=30)


@pytest.fixture(params=TRANSPORTS)
def make(request):
    """Start a target of this binding with the test's settings (other backends, such as
    the raw-socket one in tests/test_rnic_roce_raw.py, give their own ``make``)."""
    def start(**config) -> TargetThread:
        return TargetThread(request.param, TargetConfig(**{**BASE, **config}))
    return start


async def connect(t: TargetThread, index: int = 0, **kw) -> Initiator:
    return await Initiator.connect(t.url, **t.connect_options(index), **kw)


def test_deferred_free_example(make):
    """The text's example: X's allocation is held between its FetchAdd and its slot read
    while Y allocates, and Y's free finds X's slot unconsumed and is deferred."""
    t = make(blocks=4, max_initiators=2, features=0, clear_freed=False)
    try:
        held = threading.Event()
        release = asyncio.Event()      # belongs to the target's loop; set from there

        async def hold(ticket):
            if ticket == 0:
                held.set()
                await release.wait()
        t.run(lambda: setattr(t.target.executor, "before_slot_read", hold))
        ring = t.target.memory.shared_ring
        size = t.target.memory.block_size

        async def main():
            x = await connect(t, 0)
            y = await connect(t, 1)
            hx, hy = x.target.handle_base, y.target.handle_base
            xa = asyncio.create_task(x.alloc_store(hx, b"X's block"))
            while not held.is_set():
                await asyncio.sleep(0.01)
            r1 = await y.alloc_store(hy, b"Y1")
            r2 = await y.alloc_store(hy + 1, b"Y2")
            assert (r1.block_offset, r2.block_offset) == (1 * size, 2 * size)
            await y.free(hy)                                    # block 1: Tail ticket 4 -> slot 0
            assert t.run(lambda: ring.deferred) == 1            # slot 0 not consumed yet
            t.run(release.set)
            rx = await xa
            assert rx.block_offset == 0                          # X got slot 0's block
            assert t.run(lambda: ring.deferred) == 0
            assert t.run(lambda: ring.slot(0)) == (4, 1 * size)  # the deferred write, ticket 4
            r3 = await y.alloc_store(hy + 2, b"Y3")              # ticket 3
            r4 = await x.alloc_store(hx + 1, b"X2")              # ticket 4 gets Y's freed block
            assert (r3.block_offset, r4.block_offset) == (3 * size, 1 * size)
            assert t.run(lambda: audit(t.target)) == []
            await x.goodbye(release=True)
            await y.goodbye(release=True)
        run(main())
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def test_reconnect_finds_bindings_and_active_id_is_refused(make):
    t = make()
    try:
        ident = os.urandom(16)

        async def main():
            a = await connect(t, 0, initiator_id=ident)
            h = a.target.handle_base
            data = os.urandom(2048)
            await a.alloc_store(h, data, seal=True)
            with pytest.raises(KbtpError) as refused:          # same ID while active
                await connect(t, 1, initiator_id=ident)
            assert refused.value.name == "ALREADY_BOUND"
            await a.qp.close()                                 # the connection drops, no GOODBYE
            await asyncio.sleep(0.3)
            b = await connect(t, 1, initiator_id=ident)
            assert b.target.handle_base == h
            assert (await b.load(h)).data == data
            await b.goodbye(release=True)                      # RELEASE frees everything
            await asyncio.sleep(0.2)
            c = await connect(t, 2, initiator_id=ident)
            with pytest.raises(KbtpError, match="NOT_VALID"):
                await c.load(h)
            await c.goodbye(release=True)
        run(main())
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def test_direct_load_and_direct_alloc(make):
    t = make()
    try:
        async def main():
            a = await connect(t, 0)
            assert a.target.feature(Feature.DIRECT_LOAD) and a.target.feature(Feature.DIRECT_ALLOC)
            h = a.target.handle_base
            data = os.urandom(4096)
            r = await a.direct_alloc(h, data)
            assert r.data_length == 4096
            assert (await a.load(h)).data == data
            d = await a.direct_load(h)
            assert (d.data, d.generation, d.block_offset) == (data, r.generation, r.block_offset)
            await a.free(h)
            with pytest.raises(KbtpError, match="NOT_VALID"):
                await a.direct_load(h)
            # A BIND for a block that is not the ticket's is refused.
            ticket, offset = await a.take_ticket()
            block = await a.wait_slot(ticket, offset, 1.0)
            with pytest.raises(KbtpError, match="MALFORMED"):
                await a.bind(h + 1, ticket, 8, block + 4096)
            await a.bind(h + 1, ticket, 0, block)
            await a.goodbye(release=True)
        run(main())
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def test_completion_records_only_on_roce(make):
    t = make()
    try:
        async def main():
            a = await connect(t, 0)
            h = a.target.handle_base
            r = await a.alloc_store(h, b"recorded", seal=True, record=True)
            assert r.record == (t.transport == "roce")
            assert a.target.feature(Feature.RECORD_COMPLETION) == (t.transport == "roce")
            r = await a.load(h, record=True)
            assert (r.record, r.data) == (t.transport == "roce", b"recorded")
            await a.goodbye(release=True)
        run(main())
    finally:
        t.stop()


def test_addr_le_session_keeps_memory_little_endian(make):
    t = make(addr_le=True)
    try:
        async def main():
            a = await connect(t, 0)
            assert a.addr_le
            h = a.target.handle_base
            r = await a.alloc_store(h, b"little", seal=True)
            assert (await a.load(h)).data == b"little"
            assert (await a.direct_load(h)).data == b"little"
            table = t.target.memory.table
            at = (h - table.base_handle) * M.ENTRY_SIZE
            raw = bytes(table.view[at:at + M.ENTRY_SIZE])
            assert raw[8:16] == r.block_offset.to_bytes(8, "little")   # Block Offset: address
            assert raw[4:8] == (6).to_bytes(4, "big")                  # Data Length: network
            await a.goodbye(release=True)
        run(main())
    finally:
        t.stop()


def test_isolation(make):
    t = make()
    try:
        async def main():
            a = await connect(t, 0)
            b = await connect(t, 1, features=0)               # b asks for no direct mode
            assert b.target.features == 0 and "pool.stag" not in b.target.fields
            ha = a.target.handle_base
            await a.alloc_store(ha, b"a's", seal=True)
            for op in (b.store(ha, b"x"), b.free(ha), b.alloc_store(ha + 1, b"x"),
                       b.bind(ha + 2, 0, 1, 0)):
                with pytest.raises(KbtpError) as exc:
                    await op
                assert exc.value.name in ("INVALID_HANDLE", "MALFORMED")
            assert (await a.load(ha)).data == b"a's"
            # b cannot reach target memory through any STag: not even the ones a was granted.
            c_id = os.urandom(16)          # one intruder, reconnecting after each refusal
            for key in ("pool", "table", "partition", "ring", "head"):
                stag = a.target.fields[f"{key}.stag"]
                c = await connect(t, 2, features=0, initiator_id=c_id)
                with pytest.raises((RemoteError, ConnectionLost)):
                    if key == "head":
                        await c.qp.fetch_add(stag, 0, 1)
                    elif key == "partition":
                        await c.qp.write(stag, a.target.fields["partition.offset"], b"evil")
                    else:
                        await c.qp.read(stag, 0, 16)
                    await c.load(ha)        # a refused Write fails the connection after the fact
                await c.close()
            assert (await a.load(ha)).data == b"a's"
            await a.goodbye(release=True)
            await b.goodbye(release=True)
        run(main())
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def _bad_requests(h: int) -> list[tuple[str, bytes, int]]:
    """(what, bytes, Request ID to be echoed) for requests the target must call MALFORMED."""
    good = codec.encode({"opcode": Opcode.LOAD, "request_id": 11, "handle": h, "dd.stag": 5,
                         "dd.length": 64})
    inline = codec.encode({"opcode": Opcode.ALLOC_STORE, "request_id": 12, "handle": h,
                           "inline_data": b"abcd"})
    out = [
        ("version 2", bytes([2]) + good[1:], 11),
        ("unknown opcode", good[:1] + bytes([0x7F]) + good[2:], 11),
        ("truncated", good[:30], 11),
        ("trailing octets", good + b"xx", 11),
        ("inline length lies", inline[:-1], 12),
        ("COMPLETION as a request", codec.encode({"opcode": Opcode.COMPLETION, "request_id": 13}), 13),
        ("HELLO mid-session", codec.encode({"opcode": Opcode.HELLO, "request_id": 14}), 14),
    ]
    rng = random.Random(7)
    for i in range(20):
        junk = bytearray(rng.randbytes(rng.randrange(0, 120)))
        if len(junk) >= 12:
            junk[0] = 1
            junk[4:12] = (100 + i).to_bytes(8, "big")
        out.append((f"random {i}", bytes(junk), 100 + i if len(junk) >= 12 else 0))
    return out


def test_bad_input_gets_malformed_and_others_are_served(make):
    t = make()
    try:
        async def main():
            a = await connect(t, 0)
            b = await connect(t, 1)
            hb = b.target.handle_base
            for i, (what, raw, rid) in enumerate(_bad_requests(a.target.handle_base)):
                got = await a.raw(raw)
                assert len(got) == 1, what
                try:
                    c = codec.decode(got[0].payload)
                except codec.Malformed:
                    pytest.fail(f"{what}: the answer is not a COMPLETION")
                if c["status"] != Status.MALFORMED:
                    # random bytes may happen to form a valid request; it must then be answered
                    assert what.startswith("random"), what
                    continue
                assert (c["opcode"], c["request_id"]) == (Opcode.COMPLETION, rid), what
                await b.alloc_store(hb + i, b"still served", seal=True)
                assert (await b.load(hb + i)).data == b"still served"
                await b.free(hb + i)
            await a.goodbye(release=True)
            await b.goodbye(release=True)
        run(main(), 120)
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def test_a_released_partition_comes_back_whole(make):
    """A trusted initiator may FetchAdd its Head with wrong Add Data (the RNIC executes it
    unchecked); once it is gone, the next owner of the partition gets a sound ring."""
    t = make(max_initiators=2, direct_partitions=1)
    try:
        async def main():
            a = await connect(t, 0)
            f = a.target.fields
            await a.alloc_store(a.target.handle_base, b"before", seal=True)
            await a.qp.fetch_add(f["head.stag"], f["head.offset"], 0x0000000300000005)
            await a.goodbye(release=True)
            b = await connect(t, 1)
            assert b.target.fields["partition.stag"] != f["partition.stag"]
            hb = b.target.handle_base
            assert (await b.direct_alloc(hb, b"direct")).data_length == 6
            await b.alloc_store(hb + 1, b"target-executed", seal=True)
            assert (await b.load(hb + 1)).data == b"target-executed"
            await b.goodbye(release=True)
        run(main())
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def test_a_wild_head_value_is_not_walked(make):
    """A FetchAdd with a wild Add Data moves Head by a million tickets for a moment: the
    target's Ticket Timeout watch must neither walk them nor stop serving."""
    t = make(max_initiators=2, direct_partitions=1, ticket_timeout_ms=400)
    try:
        async def main():
            a = await connect(t, 0)
            f = a.target.fields
            jump = 1 << 52                                   # +2**20 tickets
            await a.qp.fetch_add(f["head.stag"], f["head.offset"], jump)
            await asyncio.sleep(0.3)                         # the watch looks every 0.1 s
            await a.qp.fetch_add(f["head.stag"], f["head.offset"], -jump & (1 << 64) - 1)
            state = t.run(lambda: t.target.sessions.by_id[a.initiator_id])
            assert t.run(lambda: len(state.watch._pending)) == 0
            h = a.target.handle_base
            assert (await a.direct_alloc(h, b"still fine")).data_length == 10
            assert (await a.load(h)).data == b"still fine"
            await a.goodbye(release=True)
        run(main())
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()
