"""One walk through every KBTP operation and status code, for the RDMA lab's both directions.

``walk(url, **options)`` drives the reference initiator (whatever RDMA layer ``options``
pick: the soft RNIC on the host, or ``io="verbs"`` on rxe or siw in the guest) against a
target configured as ``LAB_TARGET`` says, and raises AssertionError at the first outcome
the specification does not allow. Run as a script in the guest, it prints "walk: OK" or
the failure; the host runs it in-process. Expected values come from the text (statuses,
Generations counting from 1, data read back), never from the target's code.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import sys

from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.rnic import Access, ConnectionLost, RemoteError
from kbtp_scapy.vocab import Feature, Opcode, RequestFlag, Status

#: The lab's own addresses (tools/rdma_lab.py), trusted with the direct modes as the
#: host's loopback is by default.
LAB_NETWORKS = ("10.99.0.0/16", "10.97.0.0/16", "127.0.0.0/8", "::1/128")
#: the target the walk expects: kbtp target options, and the same as TargetConfig fields
LAB_TARGET = {"blocks": 64, "block_size": 32768, "max_initiators": 4, "quota": 8,
              "handles_per_initiator": 32, "request_credits": 16, "max_inline": 1024,
              "ticket_timeout_ms": 400, "direct_partitions": 2,
              "trust": LAB_NETWORKS}
TARGET_ARGS = ["--blocks", "64", "-S", "32768", "--max-initiators", "4", "--quota", "8",
               "--handles", "32", "--credits", "16", "--max-inline", "1024",
               "--ticket-timeout", "400", "--direct-partitions", "2",
               *(arg for net in LAB_NETWORKS for arg in ("--trust", net))]


async def expect_status(name: str, call) -> None:
    try:
        result = await call
    except KbtpError as exc:
        assert exc.name == name, f"expected {name}, got {exc.name}"
        return
    raise AssertionError(f"expected {name}, got OK ({result})")


async def walk(url: str, *, direct_alloc: bool, record: bool, **options) -> list[str]:
    """Every operation and status; returns the steps done (for the report)."""
    steps: list[str] = []
    ident = secrets.token_bytes(16)
    size = LAB_TARGET["block_size"]
    ini = await Initiator.connect(url, initiator_id=ident, **options)
    t = ini.target
    assert (t.block_size, t.quota, t.handle_count) == (size, 8, 32), t
    assert t.feature(Feature.DIRECT_LOAD), "DIRECT_LOAD not granted"
    assert t.feature(Feature.DIRECT_ALLOC) == direct_alloc, f"DIRECT_ALLOC granted: {t.feature(Feature.DIRECT_ALLOC)}"
    assert t.feature(Feature.RECORD_COMPLETION) == record, f"RECORD_COMPLETION: {t.feature(Feature.RECORD_COMPLETION)}"
    h = t.handle_base
    steps.append("hello")

    small, block = b"KV block from the lab", os.urandom(size)
    r = await ini.alloc_store(h, small, seal=True)                      # inline
    assert (r.generation, r.data_length) == (1, len(small)), r
    assert (await ini.load(h)).data == small
    r = await ini.alloc_store(h + 1, block, seal=True, inline=False)    # RDMA Read, multi-packet
    assert r.data_length == size, r
    assert (await ini.load(h + 1)).data == block                        # RDMA Write, multi-packet
    steps += ["alloc_store inline", "alloc_store by RDMA Read", "load by RDMA Write"]

    await ini.alloc_store(h + 2, b"draft")                              # bound, not sealed
    await expect_status("NOT_SEALED", ini.load(h + 2))
    assert (await ini.load(h + 2, allow_unsealed=True)).data == b"draft"
    r = await ini.store(h + 2, block[:5000], seal=True, inline=False)
    assert r.data_length == 5000 and (await ini.load(h + 2)).data == block[:5000]
    await expect_status("SEALED", ini.store(h + 2, b"again"))
    await expect_status("ALREADY_BOUND", ini.alloc_store(h + 2, b"again"))
    await expect_status("STALE_GENERATION", ini.load(h + 2, generation=7))
    await expect_status("NOT_VALID", ini.load(h + 3))
    await expect_status("NOT_VALID", ini.store(h + 3, b"x"))
    await expect_status("INVALID_HANDLE", ini.alloc_store(h + t.handle_count, b"x"))
    await expect_status("TOO_LARGE", ini.alloc_store(h + 3, bytes(size + 8), inline=False))
    await expect_status("TOO_LARGE", ini.load(h + 1, length=size // 2))
    steps += ["store", "NOT_SEALED", "SEALED", "ALREADY_BOUND", "STALE_GENERATION",
              "NOT_VALID", "INVALID_HANDLE", "TOO_LARGE"]

    r = await ini.free(h + 2)
    assert r.generation == 2, r                                        # the next Generation
    await expect_status("NOT_VALID", ini.load(h + 2))
    await expect_status("NOT_VALID", ini.free(h + 2))
    steps.append("free")

    # Send with Invalidate: the target revokes the STag of the Data Descriptor. libsiw
    # never says so in a completion (rdma-core 44 to this day): there, show it by effect.
    # On InfiniBand only a memory window can be invalidated by the peer, and rxe's windows
    # do not bound an access (docs/DECISIONS.md, "Memory windows on rxe"): no step there.
    reported = 0
    if ini.qp.remote_invalidate:
        buf = bytearray(size)
        region = ini.memory.register(buf, Access.REMOTE_WRITE)
        got = await ini.raw(_load_request(ini, h + 1, region), timeout=10)
        assert got and _status(ini, got[0].payload) == 0, got
        assert bytes(buf) == block
        reported = got[0].invalidated
        assert reported in (region.stag, None), f"invalidated 0x{reported:x}, not 0x{region.stag:x}"
        ini.memory.deregister(region.stag)
        steps.append("Send with Invalidate")

    if record:                                           # RoCEv2: Write with Immediate
        r = await ini.load(h + 1, record=True)
        assert r.record and r.data == block, r
        steps.append("RECORD by Write with Immediate")

    r = await ini.direct_load(h + 1)
    assert r.data == block and r.generation == 1
    await expect_status("NOT_VALID", ini.direct_load(h + 3))
    steps.append("DIRECT_LOAD")

    if direct_alloc:
        r = await ini.direct_alloc(h + 4, block[:777])
        assert (await ini.load(h + 4)).data == block[:777]
        ticket, offset = await ini.take_ticket()
        slot = await ini.wait_slot(ticket, offset, 2)
        await asyncio.sleep(LAB_TARGET["ticket_timeout_ms"] / 1000 * 3)
        await expect_status("TICKET_ABANDONED", ini.bind(h + 5, ticket, 8, slot))
        steps += ["DIRECT_ALLOC", "TICKET_ABANDONED"]

    bound = {h: small, h + 1: block}
    for k in range(6, 32):                              # fill the quota: then NO_SPACE
        try:
            await ini.alloc_store(h + k, b"q")
        except KbtpError as exc:
            assert exc.name == "NO_SPACE", exc.name
            break
    else:
        raise AssertionError("no NO_SPACE within the handle range")
    for k in range(6, 32):
        try:
            await ini.free(h + k)
        except KbtpError:
            break
    steps.append("NO_SPACE")

    got = await ini.raw(bytes(24), timeout=10)           # opcode 0 is no request
    assert got and _status(ini, got[0].payload) == Status.MALFORMED, got
    steps.append("MALFORMED")

    # GOODBYE without RELEASE: the target closes (DREQ or FIN); bindings stay.
    await ini.goodbye()
    ini = await Initiator.connect(url, initiator_id=ident, **options)
    for handle, data in bound.items():
        assert (await ini.load(handle)).data == data
    steps.append("GOODBYE, then a reconnect finds its bindings")
    # the initiator ends the connection itself first (DREQ or FIN), no GOODBYE
    await ini.qp.close()
    ini = await Initiator.connect(url, initiator_id=ident, **options)
    assert (await ini.load(h + 1)).data == block
    await ini.goodbye(release=True)
    ini = await Initiator.connect(url, initiator_id=ident, **options)
    await expect_status("NOT_VALID", ini.load(h + 1))
    await ini.goodbye(release=True)
    steps += ["a disconnect from the initiator, then a reconnect", "GOODBYE RELEASE"]
    if reported is None:
        await invalidated_by_effect(url, **options)
        steps.append("the invalidated STag refuses the target's next Write")
    return steps


async def invalidated_by_effect(url: str, **options) -> None:
    """A LOAD with INVALIDATE, then one more into the same STag: the target's RDMA Write
    meets an invalid STag, which ends the connection (the binding's error, never data)."""
    ini = await Initiator.connect(url, **options)
    h = ini.target.handle_base
    await ini.alloc_store(h, b"once", seal=True)
    buf = bytearray(64)
    region = ini.memory.register(buf, Access.REMOTE_WRITE)
    got = await ini.raw(_load_request(ini, h, region), timeout=10)
    assert got and bytes(buf[:4]) == b"once", got
    buf[:4] = b"----"
    try:
        again = await ini.raw(_load_request(ini, h, region), timeout=10)
    except (ConnectionLost, RemoteError):
        again = []
    assert not again or ini.qp.closed, f"a Write into an invalidated STag completed: {again}"
    assert bytes(buf[:4]) == b"----", "the target wrote into an invalidated STag"
    await ini.close()


def _load_request(ini: Initiator, handle: int, region) -> bytes:
    from kbtp_scapy import codec
    return codec.encode({"opcode": Opcode.LOAD, "request_id": 0x7A11, "handle": handle,
                         "generation": 0, "flags": RequestFlag.INVALIDATE, "dd.stag": region.stag,
                         "dd.offset": region.base, "dd.length": region.length}, ini.addr_le)


def _status(ini: Initiator, payload: bytes) -> int:
    from kbtp_scapy import codec
    return codec.decode(payload, ini.addr_le)["status"]


if __name__ == "__main__":         # in the guest: walk URL DEVICE DIRECT_ALLOC RECORD
    url, device, direct, rec = sys.argv[1:5]
    try:
        done = asyncio.run(asyncio.wait_for(walk(url, direct_alloc=direct == "1", record=rec == "1",
                                                 io="verbs", device=device), 600))
    except Exception as exc:
        import traceback
        traceback.print_exc()
        print(f"walk: FAILED: {type(exc).__name__}: {exc}")
        sys.exit(1)
    print(f"walk: OK: {'; '.join(done)}")
