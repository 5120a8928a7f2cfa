"""``--execution chains``: LOAD run by the chain engine, everything else in software.

The real initiator talks to the real target over loopback sockets on both bindings; the
target's counters say which requests ran KBTP Python code.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.tables.enums import OPCODES
from kbtp_scapy.target import TargetConfig

from .kbtp_harness import TargetThread

OP = OPCODES.by_name()


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(params=[("iwarp", False), ("roce", False), ("roce", True), ("iwarp", True)],
                ids=["iwarp", "roce", "roce-addr_le", "iwarp-addr_le"])
def chains(request):
    transport, addr_le = request.param
    config = TargetConfig(blocks=64, block_size=4096, max_initiators=4, ticket_timeout_ms=300,
                          request_credits=4, addr_le=addr_le, execution="chains")
    t = TargetThread(transport, config)
    yield t
    t.stop()


async def connect(t: TargetThread, index: int = 0, **kw) -> Initiator:
    return await Initiator.connect(t.url, **t.connect_options(index), **kw)


def ended(t: TargetThread) -> None:
    """Wait until the target has served the GOODBYE (its last batch is counted then)."""
    for _ in range(500):
        if not t.run(lambda: any(s.active for s in t.target.sessions.by_id.values())):
            return
        asyncio.run(asyncio.sleep(0.01))
    raise AssertionError("the session did not end")


def test_loads_run_without_kbtp_python(chains):
    """Stores in software, then 20 LOADs (5 batches of refills) all by chains, right data."""
    async def main():
        ini = await connect(chains, 0, credits=4)
        h = ini.target.handle_base
        blocks = [os.urandom(100 + 37 * i) for i in range(4)]
        for i, data in enumerate(blocks):
            await ini.alloc_store(h + i, data, seal=True, inline=i % 2 == 0)
        results = []
        for _ in range(5):
            results += await asyncio.gather(*(ini.load(h + i) for i in range(4)))
        for i, r in enumerate(results):
            assert r.data == blocks[i % 4] and r.generation == 1 and r.status == 0
        stored = await ini.load(h + 1, generation=1)          # the Generation checked
        assert stored.data == blocks[1]
        await ini.close()
    run(main())
    ended(chains)
    m = chains.target.metrics
    assert m.python[OP["LOAD"]] == 0 and m.chain[OP["LOAD"]] == 21
    assert m.python[OP["ALLOC_STORE"]] == 4 and m.operations[OP["LOAD"], 0] == 21


def test_failed_checks_go_to_software(chains):
    async def main():
        ini = await connect(chains, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"sealed", seal=True)
        await ini.alloc_store(h + 1, b"open")
        for coro, name in ((ini.load(h + 1), "NOT_SEALED"), (ini.load(h + 2), "NOT_VALID"),
                           (ini.load(h, generation=9), "STALE_GENERATION"),
                           (ini.load(1), "INVALID_HANDLE"), (ini.load(h + (1 << 56)), "INVALID_HANDLE")):
            with pytest.raises(KbtpError) as failed:
                await coro
            assert failed.value.name == name
        assert (await ini.load(h + 1, allow_unsealed=True)).data == b"open"
        assert (await ini.load(h)).data == b"sealed"
        await ini.close()
    run(main())
    ended(chains)
    m = chains.target.metrics
    assert m.chain[OP["LOAD"]] == 1 and m.python[OP["LOAD"]] == 6
