"""Every operation and every status code, against the real target over real loopback sockets.

The target runs in its own thread (tests/kbtp_harness.py); the real initiator talks to it
over iWARP (kernel TCP) and RoCEv2 (UDP). Expected values come from the specification's
rules, and the target's registered memory is read back to check what it holds.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from kbtp_scapy import codec
from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.rnic import Access
from kbtp_scapy.rnic.qp import ConnectionLost, RemoteError
from kbtp_scapy.tables import memory as M
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.audit import audit
from kbtp_scapy.vocab import Opcode, RequestFlag, Status

from .kbtp_harness import TargetThread

TRANSPORTS = ["iwarp", "roce"]


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(params=TRANSPORTS)
def target(request):
    config = TargetConfig(blocks=64, block_size=4096, max_initiators=4, ticket_timeout_ms=300)
    t = TargetThread(request.param, config)
    yield t
    t.stop()


async def connect(t: TargetThread, index: int = 0, **kw) -> Initiator:
    return await Initiator.connect(t.url, **t.connect_options(index), **kw)


async def status_of(coro) -> str:
    try:
        await coro
    except KbtpError as exc:
        return exc.name
    return "OK"


def test_every_operation_and_status(target):
    async def main():
        a = await connect(target, 0)
        b = await connect(target, 1)
        h, bs = a.target.handle_base, a.target.block_size
        seen = set()

        async def expect(name, coro):
            got = await status_of(coro)
            assert got == name
            seen.add(name)

        data = os.urandom(3000)
        r = await a.alloc_store(h, data, seal=True, inline=False)
        assert (r.generation, r.data_length) == (1, 3000)
        assert (await a.load(h)).data == data
        assert (await b.load(h)).data == data              # any initiator may load any handle
        await expect("OK", a.alloc_store(h + 1, b"unsealed", inline=True))
        await expect("NOT_SEALED", a.load(h + 1))
        assert (await a.load(h + 1, allow_unsealed=True)).data == b"unsealed"
        r = await a.store(h + 1, b"now sealed", seal=True)
        assert (r.generation, r.data_length) == (1, 10)
        await expect("SEALED", a.store(h + 1, b"again"))
        await expect("NOT_VALID", a.load(h + 2))
        await expect("STALE_GENERATION", a.load(h, generation=7))
        await expect("ALREADY_BOUND", a.alloc_store(h, b"x"))
        await expect("INVALID_HANDLE", a.alloc_store(h + a.target.handle_count, b"x"))
        await expect("INVALID_HANDLE", b.free(h))           # not b's range
        await expect("TOO_LARGE", a.alloc_store(h + 3, bytes(bs + 8), inline=False))
        await expect("TOO_LARGE", a.load(h, length=100))    # buffer smaller than the data
        r = await a.free(h)
        assert (r.generation, r.data_length) == (2, 0)      # docs/NOTES.md decision 3
        await expect("NOT_VALID", a.load(h))
        # Quota: a's usage is h+1 plus what the loop binds; the quota-th binding fails.
        results = [await status_of(a.alloc_store(h + 10 + i, b"q")) for i in range(a.target.quota)]
        assert results.count("NO_SPACE") == 1 and results[-1] == "NO_SPACE"
        seen.add("NO_SPACE")
        # MALFORMED: a request that cannot be parsed, answered with its Request ID echoed.
        bad = bytearray(codec.encode({"opcode": Opcode.LOAD, "request_id": 4242, "handle": h,
                                      "dd.stag": 1, "dd.length": 8}))
        bad[0] = 2                                           # Version 2
        got = await a.raw(bytes(bad))
        c = codec.decode(got[0].payload)
        assert (c["opcode"], c["request_id"], c["status"]) == (Opcode.COMPLETION, 4242, Status.MALFORMED)
        seen.add("MALFORMED")
        # INTERNAL: a slot that never fills (a fault injected into the ring's memory).
        state = target.run(lambda: target.target.sessions.by_id[b.initiator_id])
        ring = state.partition.ring if state.partition else target.target.memory.shared_ring

        lost = []

        async def break_slot(ticket):
            lost.append(ring.slot(ring.offset_of(ticket))[1])
            ring._write_slot(ring.offset_of(ticket), ticket + 1, M.SLOT_CONSUMED)
        ex = target.target.executor
        target.run(lambda: setattr(ex, "before_slot_read", break_slot))
        target.run(lambda: setattr(ex, "allocate_timeout", 0.2))
        await expect("INTERNAL", b.alloc_store(b.target.handle_base, b"x"))
        target.run(lambda: setattr(ex, "before_slot_read", None))
        # TICKET_ABANDONED: take a ticket and never bind it within the Ticket Timeout.
        await a.free(h + 10)                                 # a's quota is full: make room
        ticket, offset = await a.take_ticket()
        block = await a.wait_slot(ticket, offset, 1.0)
        await asyncio.sleep(a.target.ticket_timeout_ms / 1000 * 2)
        await expect("TICKET_ABANDONED", a.bind(h + 30, ticket, 1, block))
        seen.add("OK")
        assert seen == set(Status.__members__), set(Status.__members__) - seen
        assert target.run(lambda: audit(target.target)) == \
            [f"block offset 0x{lost[0]:x} is neither free nor bound (lost)"]
        await b.goodbye(release=True)     # b's partition comes back whole, the lost block too
        # a's abandoned block went back to its ring only after the Partition STag died.
        assert target.run(lambda: audit(target.target)) == []
        with pytest.raises((RemoteError, ConnectionLost)):
            await a.qp.write(a.target.fields["partition.stag"], block, b"late")
            await a.load(h + 1)
    run(main())


def test_invalidate_and_clearing(target):
    async def main():
        a = await connect(target, 0, features=0)          # shared ring: blocks are cleared
        h = a.target.handle_base
        r = await a.alloc_store(h, b"secret" * 100, seal=True)
        region = a.memory.register(bytearray(4096), Access.REMOTE_WRITE)
        load = codec.encode({"opcode": Opcode.LOAD, "request_id": 77, "handle": h,
                             "flags": RequestFlag.INVALIDATE, "dd.stag": region.stag,
                             "dd.offset": 0, "dd.length": 4096}, a.addr_le)
        [got] = await a.raw(load)
        assert got.invalidated == region.stag and not region.valid   # Send with Invalidate
        assert bytes(region.view[:600]) == b"secret" * 100
        await a.free(h)
        block = target.run(lambda: bytes(target.target.memory.block(r.block_offset)))
        assert block == bytes(len(block))                       # cleared before reuse
        await a.goodbye(release=True)
    run(main())


def test_a_completion_for_a_cancelled_request_leaves_the_session_working():
    """The caller gives up just as its COMPLETION arrives: a RoCEv2 frame listener, which
    sees each frame before the RNIC acts on it, cancels the LOAD on the completion's Send,
    the one moment such a race can hit. The completion is dropped; the session goes on."""
    t = TargetThread("roce", TargetConfig(blocks=64, block_size=4096, max_initiators=4))
    try:
        async def main():
            armed: dict[str, asyncio.Task] = {}
            errors: list[dict] = []
            asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))

            def listener(direction: str, frame: bytes, ns: int) -> None:
                task = armed.get("load")          # BTH after Ethernet, IPv4 and UDP
                if direction == "rx" and task is not None and frame[42] in (0x04, 0x17):
                    task.cancel()
                    armed.clear()

            a = await connect(t, 0, frame_listeners=[listener])
            h = a.target.handle_base
            await a.alloc_store(h, b"kept", seal=True)
            load = armed["load"] = asyncio.create_task(a.load(h))
            with pytest.raises(asyncio.CancelledError):
                await load
            assert not armed, "the listener never saw the completion"
            assert (await a.load(h)).data == b"kept"
            assert a.unmatched.empty() and not errors
            await a.goodbye()
        run(main())
    finally:
        t.stop()
