"""Faults: a lossy, reordering RoCEv2 path, and a TCP connection that drops mid-session."""
from __future__ import annotations

import asyncio
import os
import random

import pytest

from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.audit import audit

from .kbtp_harness import TargetThread, fresh_hosts
from .relay import Relay

LOSSY_CONFIG = TargetConfig(blocks=128, block_size=4096, max_initiators=2, ticket_timeout_ms=5000)


async def mixed_workload(url: str, **options) -> None:
    """150 random operations of every kind on 24 handles, each checked against what was
    stored, then a pipelined burst of loads; ends with GOODBYE RELEASE."""
    ini = await Initiator.connect(url, **options)
    rng = random.Random(5)
    h = ini.target.handle_base
    stored: dict[int, bytes] = {}
    direct = "partition.stag" in ini.target.fields     # DIRECT_ALLOC granted (not on siw)
    for _ in range(150):
        handle = h + rng.randrange(24)
        if handle not in stored:
            data = rng.randbytes(rng.choice((8, 1000, 4096)))
            if rng.random() < 0.3 and direct:
                r = await ini.direct_alloc(handle, data)
            else:
                r = await ini.alloc_store(handle, data, seal=True, inline=rng.random() < 0.5)
            assert r.data_length == len(data)
            stored[handle] = data
        elif rng.random() < 0.6:
            loader = ini.direct_load if rng.random() < 0.3 else ini.load
            assert (await loader(handle)).data == stored[handle]
        else:
            await ini.free(handle)
            del stored[handle]
    results = await asyncio.gather(*(ini.load(k) for k in stored))
    assert [r.data for r in results] == list(stored.values())
    await ini.goodbye(release=True)


@pytest.mark.slow
def test_every_operation_completes_through_a_lossy_roce_path():
    t = TargetThread("roce", LOSSY_CONFIG)
    relay_host, = fresh_hosts(1)

    async def main():
        relay = Relay((relay_host, 4791), (t.host, 4791), loss=0.05, reorder=0.1, seed=11).start()
        try:
            await mixed_workload(f"roce://{relay_host}", local=t.initiator_hosts[0])
            assert relay.stats["lost"] > 20 and relay.stats["delayed"] > 20, relay.stats
        finally:
            relay.close()
    try:
        asyncio.run(asyncio.wait_for(main(), 120))
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


def test_dropped_tcp_connection_then_reconnect_finds_bindings():
    t = TargetThread("iwarp", TargetConfig(blocks=64, max_initiators=2))
    ident = os.urandom(16)

    async def main():
        ini = await Initiator.connect(t.url, initiator_id=ident)
        h = ini.target.handle_base
        blocks = {h + i: os.urandom(100 + i) for i in range(8)}
        for handle, data in blocks.items():
            await ini.alloc_store(handle, data, seal=True)
        ini.qp._tp.abort()                         # RST: no GOODBYE, no FIN
        await asyncio.sleep(0.2)
        again = await Initiator.connect(t.url, initiator_id=ident)
        assert again.target.handle_base == h
        for handle, data in blocks.items():
            assert (await again.load(handle)).data == data
        with pytest.raises(KbtpError, match="ALREADY_BOUND"):
            await again.alloc_store(h, b"x")
        await again.goodbye(release=True)
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


@pytest.mark.slow
def test_roce_initiator_that_vanished_is_detected_on_reconnect():
    """No DREQ, no traffic: the old session looks active until the target probes it."""
    t = TargetThread("roce", TargetConfig(blocks=64, max_initiators=2))
    ident = os.urandom(16)

    async def main():
        ini = await Initiator.connect(t.url, initiator_id=ident, local=t.initiator_hosts[0])
        h = ini.target.handle_base
        await ini.alloc_store(h, b"survives", seal=True)
        ini.qp._dev.close()                        # the initiator's host is gone
        loop = asyncio.get_running_loop()
        started = loop.time()
        again = await Initiator.connect(t.url, initiator_id=ident, local=t.initiator_hosts[1])
        assert loop.time() - started < 10
        assert (await again.load(h)).data == b"survives"
        await again.goodbye(release=True)
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        t.stop()
