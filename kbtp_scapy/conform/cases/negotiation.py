"""Negotiation: a feature the HELLO_ACK did not grant is not honoured in that session.

Features are what the HELLO requested and the target offers (ADDR_LE is the target's own
choice). A session that was not granted RECORD_COMPLETION is answered with COMPLETION
messages even for requests that carry RECORD and a Completion Descriptor; one that was
not granted DIRECT_ALLOC has no ring, so a BIND in it binds nothing, and its target-executed
allocations take blocks from the ring shared by all such sessions, not from a partition.
"""
from __future__ import annotations

import asyncio

from ... import codec
from ...rnic import Access
from ...tables import memory as M
from ...vocab import AnyMessage, Feature, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..registry import RULE, Fail, SetupFailed, case
from .common import SENTINEL, bind, data, entry_of, unbound
from .ops import quota_of

DESCRIPTORS = {Feature.DIRECT_LOAD: ("table.stag", "pool.stag"),
               Feature.DIRECT_ALLOC: ("partition.stag", "ring.stag", "head.stag")}


@case("session.features.not_granted", "Completion", RULE, """If the target advertised
      RECORD_COMPLETION and the request has the RECORD flag, the target instead writes a 24-octet
      completion record (HELLO_ACK: Direct-mode descriptors (present per Features))""")
async def not_granted(ctx: Ctx) -> None:
    """HELLOs requesting one feature each, and none: the HELLO_ACK grants nothing more
    (bar ADDR_LE) and carries the descriptors of what it granted only. In the session
    granted nothing, a LOAD and a FREE with RECORD complete by COMPLETION message with the
    record slot untouched, and a BIND is refused and binds nothing."""
    for requested in (Feature.DIRECT_LOAD, Feature.DIRECT_ALLOC, Feature.RECORD_COMPLETION, 0):
        ini = await ctx.connect(features=requested)
        granted = ini.target.features & ~Feature.ADDR_LE
        ctx.check(not granted & ~requested, f"HELLO_ACK Features within the requested {requested:#06x} "
                  "(and ADDR_LE)", f"{ini.target.features:#06x}")
        for feature, keys in DESCRIPTORS.items():
            present = [k for k in keys if k in ini.target.fields]
            ctx.check(bool(present) == bool(granted & feature), "descriptors only for the direct modes "
                      f"granted ({granted:#06x})", f"descriptors {sorted(ini.target.fields)}")
    a = ini
    h, other = await ctx.handles(a, 2)
    payload = data(32)
    r = await bind(ctx, a, h, payload)
    dest = a.memory.register(bytearray(len(payload)), Access.REMOTE_WRITE)
    requests: tuple[tuple[str, AnyMessage], ...] = (
        ("a LOAD", {"opcode": Opcode.LOAD, "handle": h, "dd.stag": dest.stag, "dd.offset": 0,
                    "dd.length": len(payload)}),
        ("a FREE", {"opcode": Opcode.FREE, "handle": h}))
    for what, values in requests:
        slot = a.memory.register(bytearray([SENTINEL]) * M.COMPLETION_RECORD.size, Access.REMOTE_WRITE)
        got = await ctx.raw(a, ctx.encode(a, {**values, "flags": RequestFlag.RECORD, "cd.stag": slot.stag,
                                              "cd.offset": 0, "cd.reserved": 0}))
        ctx.check(bool(got) and got[0][0] is not None and not got[0][1].write_imm,
                  f"{what} with RECORD in a session not granted RECORD_COMPLETION: a COMPLETION message",
                  "none" if not got else "a completion record" if got[0][1].write_imm else "something else")
        c = got[0][0]
        assert c is not None                     # the check above ended the case otherwise
        ctx.check(c["opcode"] == Opcode.COMPLETION and c["status"] == Status.OK, f"{what}: COMPLETION OK",
                  f"opcode {c['opcode']:#x}, {status_name(c['status'])}")
        ctx.check(bytes(slot.view) == bytes([SENTINEL]) * len(slot.view),
                  f"{what}: the Completion Descriptor's slot untouched", "octets written into it")
    ctx.check(bytes(dest.view) == payload, "the LOAD's data", "other octets")
    status, _ = await ctx.outcome(a.bind(other, 0, 0, r.block_offset))
    ctx.check(status != "OK", "a BIND in a session not granted DIRECT_ALLOC refused", "completed OK")
    await unbound(ctx, a, other, "after a BIND in a session not granted DIRECT_ALLOC")


@case("session.features.shared_ring", "Allocation Quotas", RULE, """Target-executed allocations take
      blocks from a ring shared by all initiators that the target serves this way.""")
async def shared_ring(ctx: Ctx) -> None:
    """Sessions not granted DIRECT_ALLOC allocate from the one shared ring, which must hold
    a block for every ticket each of them may take ("When all initiators respect their
    quotas, the ring always holds a block for every ticket taken"): with two such sessions
    admitted, at least two quotas of free blocks. One of them allocates its whole quota and
    frees it; the freed blocks go in at the Tail, behind at least a quota of others, so its
    next allocation is none of them. A target that reserved a ring of its own for the
    session (a partition of exactly its quota, as for DIRECT_ALLOC) hands one of them back.
    Once with every offered feature requested but DIRECT_ALLOC, once with none, and once
    with DIRECT_ALLOC alone, where it counts only if neither session was granted it (a
    target may grant fewer features than asked, but a session it does not serve by
    DIRECT_ALLOC is served from the shared ring, not from a partition kept for it)."""
    offered = ctx.info.features & ~(Feature.DIRECT_ALLOC | Feature.ADDR_LE)
    judged = False
    for requested in dict.fromkeys((offered, 0, Feature.DIRECT_ALLOC)):
        try:
            a = await ctx.connect(features=requested)
            b = await ctx.connect(features=requested)
        except SetupFailed as refused:
            if judged:
                break          # a round was judged; the next needs two sessions the target has no room for
            ctx.skip(f"the target admits no two sessions on the shared ring beside those of earlier "
                     f"cases ({refused.seen.split(',')[0]})")
        if requested & Feature.DIRECT_ALLOC and (a.target.features | b.target.features) & Feature.DIRECT_ALLOC:
            for ini in (a, b):
                await ctx.goodbye(ini, release=True)
            continue           # served by DIRECT_ALLOC: a partition of its own is the rule there
        for ini in (a, b):
            ctx.check(not ini.target.features & Feature.DIRECT_ALLOC, f"HELLO_ACK to a HELLO requesting "
                      f"{requested:#06x}: DIRECT_ALLOC not granted", f"{ini.target.features:#06x}")
        q = quota_of(ctx, a, 1)
        hs = await ctx.handles(a, q + 1)
        bound = await ctx.wait(asyncio.gather(*(ctx.setup(a.alloc_store(h, b"s"), f"ALLOC_STORE to 0x{h:x}")
                                                for h in hs[:q])), f"{q} ALLOC_STOREs")
        freed = await asyncio.gather(*(ctx.outcome(a.free(h)) for h in hs[:q]))
        ctx.check(all(s == "OK" for s, _ in freed), f"FREE of the {q} blocks", [s for s, _ in freed])
        r = await ctx.ok(a.alloc_store(hs[q], b"next"), "ALLOC_STORE after the whole quota was freed")
        blocks = {x.block_offset for x in bound}
        ctx.check(r.block_offset not in blocks, f"with a second session ({requested:#06x}) on the shared "
                  f"ring, the allocation after {q} allocated and freed a block other than those {q}",
                  f"{r.block_offset:#x}, one of them")
        await ctx.ok(a.free(hs[q]), "FREE")
        for ini in (a, b):     # the next round's two sessions take their places
            await ctx.goodbye(ini, release=True)
        judged = True


EVERY_FEATURE = Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC | Feature.RECORD_COMPLETION | Feature.ADDR_LE


@case("session.features.requested_not_granted", "Conventions and Definitions", RULE, """All fields
      in messages and in memory structures read by remote peers are in network byte order, except
      the address fields listed in when the target selects little-endian address fields. (If the
      target advertised RECORD_COMPLETION and the request has the RECORD flag, the target instead
      writes a 24-octet completion record)""")
async def requested_not_granted(ctx: Ctx) -> None:
    """A feature requested in HELLO but not granted in HELLO_ACK is not in effect: HELLOs
    requesting every feature bit at once, ADDR_LE alone and RECORD_COMPLETION alone, and in
    each session every bit requested and not granted is checked as absent. ADDR_LE: address fields in network
    byte order both ways (a non-inline store from, and a LOAD into, buffers whose STags,
    Tagged Offsets and Lengths differ when read the other way round; the handle echoed);
    RECORD_COMPLETION: a COMPLETION message, the record slot untouched; DIRECT_ALLOC: a
    BIND binds nothing; DIRECT_LOAD: no Table or Pool descriptors."""
    for requested in (EVERY_FEATURE, Feature.ADDR_LE, Feature.RECORD_COMPLETION):
        a = await ctx.connect(features=requested)
        absent = requested & ~a.target.features
        for feature, keys in DESCRIPTORS.items():
            ctx.check(not (absent & feature and any(k in a.target.fields for k in keys)),
                      f"no {feature.name} descriptors in a HELLO_ACK that did not grant it",
                      f"descriptors {sorted(a.target.fields)}")
        when = f"in a session that requested {requested:#06x} and was granted {a.target.features:#06x}"
        try:
            h, other = await ctx.handles(a, 2)
        except SetupFailed as failed:    # FREEs making room: in this session they are under test too
            raise Fail(f"{failed.step} {when}: {failed.expected}", failed.seen) from None
        await _byte_order(ctx, a, h, when)
        if absent & Feature.RECORD_COMPLETION:
            await _no_record(ctx, a, h, when)
        if absent & Feature.DIRECT_ALLOC:
            r = await ctx.ok(a.load(h, allow_unsealed=True), f"LOAD {when}")
            status, _ = await ctx.outcome(a.bind(other, 0, 0, r.block_offset))
            ctx.check(status != "OK", f"a BIND {when} refused", "completed OK")
            await unbound(ctx, a, other, f"after a BIND {when}")
        await ctx.ok(a.free(h), f"FREE {when}")
        await ctx.goodbye(a, release=True)


async def _byte_order(ctx: Ctx, a, h: int, when: str) -> None:
    """A non-inline ALLOC_STORE from, and a LOAD into, buffers at a Tagged Offset whose
    octets differ when reversed, in the order the HELLO_ACK set: the data stored and loaded,
    the handle echoed."""
    payload = data(200)
    base = 0x0102_0304_0506_0700
    src = a.memory.register(bytearray(payload), Access.REMOTE_READ, base=base)
    c = await ctx.answer(a, ctx.encode(a, {"opcode": Opcode.ALLOC_STORE, "handle": h, "dd.stag": src.stag,
                                           "dd.offset": base, "dd.length": len(payload)}),
                         f"a non-inline ALLOC_STORE {when}")
    ctx.check((c["status"], c["handle"]) == (Status.OK, h), f"the ALLOC_STORE {when}: OK, echoing "
              f"handle {h:#x} (address fields {'little' if a.addr_le else 'big'}-endian, as granted)",
              f"{status_name(c['status'])}, handle {c['handle']:#x}")
    dest = a.memory.register(bytearray([SENTINEL]) * (len(payload) + 8), Access.REMOTE_WRITE, base=base)
    c = await ctx.answer(a, ctx.encode(a, {"opcode": Opcode.LOAD, "handle": h, "flags": RequestFlag.ALLOW_UNSEALED,
                                           "dd.stag": dest.stag, "dd.offset": base,
                                           "dd.length": len(payload) + 8}), f"a LOAD {when}")
    ctx.check(c["status"] == Status.OK, f"the LOAD {when}: OK", status_name(c["status"]))
    ctx.check(bytes(dest.view[:len(payload)]) == payload, f"the stored octets loaded {when}", "other octets")
    offset = c["completion.block_offset"]
    if "table.stag" in a.target.fields:        # the entry, read as the HELLO_ACK's byte order says
        entry = await ctx.wait(entry_of(a, h), f"an RDMA Read of the entry {when}")
        at = (hex(entry["entry.block_offset"]), entry["entry.data_length"])
        ctx.check(at == (hex(offset), len(payload)), f"the table entry {when}: the COMPLETION's Block "
                  f"Offset {offset:#x} and Data Length {len(payload)}", at)
    if a.target.features & Feature.RECORD_COMPLETION:
        slot = a.memory.register(bytearray(M.COMPLETION_RECORD.size), Access.REMOTE_WRITE)
        rid = ctx.rid()
        got = await ctx.raw(a, codec.encode({
            "opcode": Opcode.LOAD, "request_id": rid, "handle": h,
            "flags": RequestFlag.RECORD | RequestFlag.ALLOW_UNSEALED, "dd.stag": dest.stag, "dd.offset": base,
            "dd.length": dest.length, "cd.stag": slot.stag, "cd.offset": 0, "cd.reserved": 0}, a.addr_le))
        d = codec.decode_struct(M.COMPLETION_RECORD, bytes(slot.view), a.addr_le)
        seen = (bool(got), hex(d["record.request_id"]), d["record.status"], hex(d["record.block_offset"]))
        ctx.check(seen == (True, hex(rid), Status.OK, hex(offset)), f"a completion record {when}: the Request "
                  f"ID, Status OK, the Block Offset {offset:#x}", seen)


async def _no_record(ctx: Ctx, a, h: int, when: str) -> None:
    """A LOAD with RECORD and a Completion Descriptor: a COMPLETION message, the slot untouched."""
    slot = a.memory.register(bytearray([SENTINEL]) * M.COMPLETION_RECORD.size, Access.REMOTE_WRITE)
    dest = a.memory.register(bytearray(256), Access.REMOTE_WRITE)
    got = await ctx.raw(a, ctx.encode(a, {"opcode": Opcode.LOAD, "handle": h,
                                          "flags": RequestFlag.RECORD | RequestFlag.ALLOW_UNSEALED,
                                          "dd.stag": dest.stag, "dd.offset": 0, "dd.length": dest.length,
                                          "cd.stag": slot.stag, "cd.offset": 0, "cd.reserved": 0}))
    ctx.check(bool(got) and got[0][0] is not None and not got[0][1].write_imm,
              f"a LOAD with RECORD {when}: a COMPLETION message",
              "none" if not got else "a completion record" if got[0][1].write_imm else "something else")
    ctx.check(bytes(slot.view) == bytes([SENTINEL]) * len(slot.view),
              f"a LOAD with RECORD {when}: the Completion Descriptor's slot untouched", "octets written into it")
