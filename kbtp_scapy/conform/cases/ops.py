"""Operations: validation before memory is touched, every status code, quotas, isolation."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from ... import codec
from ...initiator import Initiator
from ...tables.messages import HEADER
from ...vocab import EntryFlag, Feature, Opcode, RequestFlag, Status
from ..context import Ctx, close_all, status_name
from ..registry import MUST, MUST_NOT, RULE, case
from .common import (
    bind,
    buffer,
    data,
    entry_of,
    holds,
    load_request,
    other_generation,
    unbound,
    untouched,
)

SECTION = "Operations"
VALIDATE = """It validates every request before touching memory: the handle MUST be within a range
    the initiator is authorized for (its own range for stores and frees), lengths MUST NOT exceed
    Block Size or the initiator's buffer, and, if the request Generation is non-zero, it MUST equal
    the entry's. A failed check completes the request with the corresponding status and has no
    other effect."""
UNPARSEABLE = """Version is 1. Opcodes are listed in (); MALFORMED: Request cannot be parsed"""
#: Octets a request needs for its Request ID to be there to echo.
RID_END = HEADER.offset("request_id") + HEADER.item("request_id").size


async def _not_executed(ctx: Ctx, raw: Callable[[Initiator, int], bytes], what: str,
                        sized: bool = True) -> None:
    """A request the target must not execute: any answer is not OK, the handle stays unbound.

    Which refusal is the project's choice (NOTES decision 4), but not every one is free: a
    failed check completes "with the corresponding status", and when every Length the
    request declares is within Block Size, Max Inline and the octets it carries (``sized``),
    TOO_LARGE ("Length exceeds block or buffer") names a check it passed. A COMPLETION
    echoes the Request ID when the octets hold one ("Request ID is chosen by the initiator
    and echoed in the completion"): without it the initiator cannot tell which request
    failed."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    octets = raw(a, h)
    got = await ctx.raw(a, octets)
    if got and got[0][0] is not None:
        c = got[0][0]
        ctx.check(c["status"] != Status.OK, f"{what}: not executed (a non-OK status)", "status OK")
        if len(octets) >= RID_END:
            rid = codec.decode_header(octets.ljust(codec.HEADER_SIZE, b"\0"), a.addr_le)["request_id"]
            ctx.check(c["request_id"] == rid, f"{what}: its Request ID {rid:#x} echoed", hex(c["request_id"]))
        if sized:
            ctx.check(c["status"] != Status.TOO_LARGE, f"{what}, whose every Length is within the "
                      "limits: not TOO_LARGE (the status of a check it passed)", "TOO_LARGE")
        if c["status"] != Status.MALFORMED:
            ctx.note(f"{what}: answered {status_name(c['status'])}; the reference answers MALFORMED "
                     "(NOTES decision 4)")
    else:
        ctx.note(f"{what}: no COMPLETION ({'connection closed' if a.qp.closed else 'none'}); "
                 "the reference answers MALFORMED echoing the Request ID (NOTES decision 4)")
    if a.qp.closed:
        a = await ctx.reconnect(a)
    await unbound(ctx, a, h, f"after {what}")


def _alloc_inline(ctx: Ctx, a: Initiator, h: int) -> bytes:
    return ctx.encode(a, {"opcode": Opcode.ALLOC_STORE, "handle": h, "inline_data": b"VERSION!"})


@case("ops.header.version", "Common Header", RULE, UNPARSEABLE)
async def version(ctx: Ctx) -> None:
    """ALLOC_STOREs with Versions below and above 1: none executed."""
    for v in (0, 2, 0xFF):
        await _not_executed(ctx, functools.partial(_with_version, ctx, v), f"an ALLOC_STORE with Version {v}")


def _with_version(ctx: Ctx, version: int, a: Initiator, h: int) -> bytes:
    return bytes([version]) + _alloc_inline(ctx, a, h)[1:]


@case("ops.header.opcode", "Common Header", RULE, UNPARSEABLE)
async def opcode(ctx: Ctx) -> None:
    await _not_executed(ctx, lambda a, h: (lambda m: m[:1] + b"\x7e" + m[2:])(_alloc_inline(ctx, a, h)),
                        "an ALLOC_STORE body under the unassigned opcode 0x7E")
    await _not_executed(ctx, lambda a, h: ctx.encode(a, {"opcode": Opcode.COMPLETION, "handle": h}),
                        "a COMPLETION sent as a request")


@case("ops.header.length", "Common Header", RULE, UNPARSEABLE)
async def length(ctx: Ctx) -> None:
    await _not_executed(ctx, lambda a, h: ctx.encode(a, {
        "opcode": Opcode.ALLOC_STORE, "handle": h, "flags": RequestFlag.INLINE, "dd.length": 12,
        "inline_data": b"SHORT"}), "an inline ALLOC_STORE with fewer octets than its Length",
        sized=False)
    await _not_executed(ctx, lambda a, h: _alloc_inline(ctx, a, h)[:30],
                        "an ALLOC_STORE truncated to 30 octets")


@case("ops.handle.own_range", SECTION, MUST, VALIDATE)
async def own_range(ctx: Ctx) -> None:
    """Isolation: a second initiator cannot store to, allocate in, or free the first's range."""
    a = await ctx.connect(features=0)
    b = await ctx.connect(features=0)
    h, other = await ctx.handles(a, 2)
    payload = data(100)
    r = await bind(ctx, a, h, payload, seal=False)
    await ctx.expect(b.store(h, b"intruder"), "INVALID_HANDLE", "STORE to another initiator's handle")
    await ctx.expect(b.free(h), "INVALID_HANDLE", "FREE of another initiator's handle")
    await ctx.expect(b.alloc_store(other, b"intruder"), "INVALID_HANDLE",
                     "ALLOC_STORE in another initiator's range")
    await holds(ctx, a, h, payload, "after the other initiator's attempts", r.generation)
    await unbound(ctx, a, other, "after the other initiator's ALLOC_STORE")


@case("ops.handle.outside_table", SECTION, MUST, VALIDATE)
async def outside(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    far = 0xFFFF_FFFF_FFFF_FF00
    await ctx.expect(a.load(far), "INVALID_HANDLE", "LOAD of a handle no initiator is authorized for")
    await ctx.expect(a.alloc_store(far, b"x"), "INVALID_HANDLE", "ALLOC_STORE outside every range")
    await ctx.expect(a.free(far), "INVALID_HANDLE", "FREE outside every range")


@case("ops.generation.stale", SECTION, MUST, VALIDATE)
async def stale(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, payload = await ctx.handle(a), data(64)
    r = await bind(ctx, a, h, payload, seal=False)
    wrong = other_generation(r.generation)
    await ctx.expect(a.load(h, generation=wrong, allow_unsealed=True), "STALE_GENERATION",
                     f"LOAD with Generation {wrong} (entry has {r.generation})")
    await ctx.expect(a.store(h, b"overwrite", generation=wrong), "STALE_GENERATION",
                     "STORE with a wrong Generation")
    await ctx.expect(a.free(h, generation=wrong), "STALE_GENERATION", "FREE with a wrong Generation")
    await holds(ctx, a, h, payload, "after the stale requests", r.generation)
    await ctx.ok(a.load(h, generation=r.generation, allow_unsealed=True), "LOAD with the right Generation")
    await ctx.ok(a.free(h, generation=r.generation), "FREE with the right Generation")


@case("ops.load.not_valid", "Block Load", MUST, """The entry MUST be VALID, and SEALED unless
      ALLOW_UNSEALED is set.""")
async def load_not_valid(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    region = buffer(a, 64)
    c = await ctx.answer(a, load_request(ctx, a, h, region, RequestFlag.ALLOW_UNSEALED), "LOAD of an unbound handle")
    ctx.check(c["status"] == Status.NOT_VALID, "LOAD of an unbound handle: NOT_VALID", status_name(c["status"]))
    ctx.check(untouched(region), "the initiator's buffer untouched", "octets written into it")


@case("ops.load.not_sealed", "Block Load", MUST, """The entry MUST be VALID, and SEALED unless
      ALLOW_UNSEALED is set.""")
async def load_not_sealed(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, payload = await ctx.handle(a), data(64)
    await bind(ctx, a, h, payload, seal=False)
    region = buffer(a, 64)
    c = await ctx.answer(a, load_request(ctx, a, h, region), "LOAD of an unsealed block")
    ctx.check(c["status"] == Status.NOT_SEALED, "LOAD of an unsealed block: NOT_SEALED", status_name(c["status"]))
    ctx.check(untouched(region), "the initiator's buffer untouched", "octets written into it")
    await holds(ctx, a, h, payload, "with ALLOW_UNSEALED")


@case("ops.load.too_large", "Block Load", MUST_NOT, """Data Length MUST NOT exceed the descriptor
      Length.""")
async def load_too_large(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    await bind(ctx, a, h, data(100))
    region = buffer(a, 60)
    c = await ctx.answer(a, load_request(ctx, a, h, region), "LOAD into a 60-octet buffer of 100 octets")
    ctx.check(c["status"] == Status.TOO_LARGE, "TOO_LARGE", status_name(c["status"]))
    ctx.check(untouched(region), "the initiator's buffer untouched", "octets written into it")


@case("ops.store.too_large", SECTION, MUST_NOT, VALIDATE)
async def store_too_large(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    (h, h2), size = await ctx.handles(a, 2), a.target.block_size
    await ctx.expect(a.alloc_store(h, bytes(size + 8), inline=False), "TOO_LARGE",
                     f"ALLOC_STORE of {size + 8} octets (Block Size {size})")
    await unbound(ctx, a, h, "after the refused ALLOC_STORE")
    payload = data(32)
    await bind(ctx, a, h2, payload, seal=False)
    await ctx.expect(a.store(h2, bytes(size + 8), inline=False), "TOO_LARGE",
                     f"STORE of {size + 8} octets")
    await holds(ctx, a, h2, payload, "after the refused STORE")


@case("ops.store.not_valid", "Block Mapped Store", MUST, """The target reads the table entry, which
      MUST be VALID and not SEALED and MUST belong to the initiator's handle range.""")
async def store_not_valid(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    await ctx.expect(a.store(h, b"nowhere"), "NOT_VALID", "STORE to an unbound handle")
    await unbound(ctx, a, h, "after the refused STORE")


@case("ops.store.sealed", "Block Mapped Store", MUST, """The target reads the table entry, which
      MUST be VALID and not SEALED and MUST belong to the initiator's handle range.""")
async def store_sealed(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, payload = await ctx.handle(a), data(64)
    r = await bind(ctx, a, h, payload, seal=True)
    await ctx.expect(a.store(h, b"changed"), "SEALED", "STORE to a sealed block")
    await holds(ctx, a, h, payload, "after the refused STORE", r.generation)


@case("ops.store.seal_flag", "Block Mapped Store", RULE, """It updates Data Length and, if SEAL is
      set, sets SEALED.""")
async def seal_flag(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    await bind(ctx, a, h, data(300), seal=False)
    new = data(40)
    r = await ctx.ok(a.store(h, new, seal=True), "STORE with SEAL")
    ctx.check(r.data_length == len(new), f"Data Length {len(new)} in the completion", r.data_length)
    got = await ctx.ok(a.load(h), "LOAD without ALLOW_UNSEALED after STORE with SEAL")
    ctx.check(got.data == new, f"the {len(new)} stored octets", f"{len(got.data)} octets that differ")


@case("ops.store.data", "Block Mapped Store", RULE, """It obtains the data, from the inline payload
      or by RDMA Read from the Data Descriptor, and writes it into the block.""")
async def store_data(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    (h, h2), size, inline = await ctx.handles(a, 2), a.target.block_size, a.target.max_inline
    writes = [(h, data(min(size, 3000)), False, "ALLOC_STORE"), (h, data(min(size, 1000)), False, "STORE")]
    if inline:
        writes += [(h2, data(min(inline, 100)), True, "ALLOC_STORE"), (h2, data(min(inline, 50)), True, "STORE")]
    for handle, payload, as_inline, op in writes:
        call = a.alloc_store if op == "ALLOC_STORE" else a.store
        await ctx.ok(call(handle, payload, inline=as_inline), f"{op}{' inline' if as_inline else ''}")
        await holds(ctx, a, handle, payload, f"after {op}{' inline' if as_inline else ' (RDMA Read)'}")


@case("ops.unmapped_store.already_bound", "Block Unmapped Store", MUST_NOT, """The handle MUST be in
      the initiator's range and its entry MUST NOT be VALID.""")
async def already_bound(ctx: Ctx) -> None:
    """Both kinds of bound entry: sealed, and unsealed (which a STORE may still change)."""
    a = await ctx.connect(features=0)
    for h, seal in zip(await ctx.handles(a, 2), (True, False)):
        what = "sealed" if seal else "unsealed"
        payload = data(64)
        r = await bind(ctx, a, h, payload, seal=seal)
        await ctx.expect(a.alloc_store(h, b"second"), "ALREADY_BOUND",
                         f"ALLOC_STORE to a handle bound to a {what} block")
        got = await holds(ctx, a, h, payload, f"({what}) after the refused ALLOC_STORE", r.generation)
        ctx.check(got.block_offset == r.block_offset, f"Block Offset {r.block_offset:#x} ({what})",
                  hex(got.block_offset))


@case("ops.unmapped_store.completion", "Block Unmapped Store", RULE, """It completes the request with
      the Block Offset and Generation. (Block Load: It completes the request () with the Block
      Offset, Data Length, and Generation of the entry.)""")
async def completion_values(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, payload = await ctx.handle(a), data(77)
    r = await bind(ctx, a, h, payload)
    got = await ctx.ok(a.load(h), "LOAD after ALLOC_STORE")
    seen = (hex(got.block_offset), got.generation, got.data_length)
    ctx.check(seen == (hex(r.block_offset), r.generation, len(payload)),
              f"LOAD completion with the entry's Block Offset {r.block_offset:#x}, Generation "
              f"{r.generation}, Data Length {len(payload)}", seen)


@case("ops.free.not_valid", "Block Free", MUST, "The handle MUST be in the initiator's range and VALID.")
async def free_not_valid(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    await ctx.expect(a.free(h), "NOT_VALID", "FREE of an unbound handle")
    await bind(ctx, a, h, b"once")
    await ctx.ok(a.free(h), "FREE of a bound handle")
    await ctx.expect(a.free(h), "NOT_VALID", "a second FREE of the same handle")


@case("ops.free.unbinds", "Block Free", RULE, """The target clears VALID and SEALED and increments
      the Generation (skipping zero) in the table entry. It returns the block to the ring""")
async def free_unbinds(ctx: Ctx) -> None:
    """Unbound to every request after FREE; with DIRECT_LOAD also in the entry itself."""
    a = await ctx.connect(features=Feature.DIRECT_LOAD)
    h = await ctx.handle(a)
    await bind(ctx, a, h, data(10), seal=True)
    freed = await ctx.ok(a.free(h), "FREE")
    await unbound(ctx, a, h, "after FREE")
    if a.target.features & Feature.DIRECT_LOAD:
        entry = await ctx.wait(entry_of(a, h), "an RDMA Read of the freed entry")
        ctx.check(not entry["entry.flags"] & (EntryFlag.VALID | EntryFlag.SEALED),
                  "the freed entry without VALID and SEALED",
                  f"Flags {entry['entry.flags']:#06x}")
        ctx.check(entry["entry.generation"] == freed.generation,
                  f"the freed entry's Generation {freed.generation}, as the FREE completion said",
                  entry["entry.generation"])
    await bind(ctx, a, h, data(10))


@case("ops.no_side_effect", SECTION, RULE, VALIDATE)
async def no_side_effect(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, h1, h2 = await ctx.handles(a, 3)
    sealed, unsealed = data(200), data(150)
    rs = await bind(ctx, a, h, sealed, seal=True)
    ru = await bind(ctx, a, h1, unsealed, seal=False)
    size = a.target.block_size
    failing = [
        (a.store(h, data(200)), "SEALED", "STORE to the sealed block"),
        (a.store(h, data(200), inline=False), "SEALED", "STORE (RDMA Read) to the sealed block"),
        (a.store(h1, data(150), generation=other_generation(ru.generation)), "STALE_GENERATION",
         "STORE with a wrong Generation"),
        (a.store(h1, bytes(size + 8), inline=False), "TOO_LARGE", "STORE larger than Block Size"),
        (a.alloc_store(h, data(20)), "ALREADY_BOUND", "ALLOC_STORE to a bound handle"),
        (a.alloc_store(h2, bytes(size + 8), inline=False), "TOO_LARGE", "ALLOC_STORE larger than Block Size"),
        (a.free(h, generation=other_generation(rs.generation)), "STALE_GENERATION", "FREE with a wrong Generation"),
    ]
    await ctx.expect_each(failing)
    await holds(ctx, a, h, sealed, "after the failed requests", rs.generation)
    await holds(ctx, a, h1, unsealed, "after the failed requests", ru.generation)
    await unbound(ctx, a, h2, "after the failed ALLOC_STORE")


QUOTA = """If a target observes an allocation by an initiator that exceeds its quota, it completes
    the request with NO_SPACE and MAY terminate the session. (the target releases one unit of
    usage when a FREE completes)"""


async def fill_quota(ctx: Ctx, a: Initiator, handles: list[int], what: str) -> None:
    """ALLOC_STORE to every handle of ``handles``, pipelined: each must complete OK. As
    many go at once as the Request Credits allow, and each such batch is given the
    checker's wait for an answer: a request is not timed while it waits its turn."""
    batch = max(1, min(a.target.request_credits, a.completion_credits))
    results = []
    for i in range(0, len(handles), batch):
        results += await ctx.wait(asyncio.gather(*(ctx.outcome(a.alloc_store(h, b"q", seal=True))
                                                   for h in handles[i:i + batch])),
                                  f"{len(handles)} ALLOC_STOREs")
    refused = [status for status, _ in results if status != "OK"]
    ctx.check(not refused, f"{len(handles)} ALLOC_STOREs within the quota of {a.target.quota} "
              f"{what} completed OK", f"{len(refused)} refused, first {refused[0] if refused else ''}")


def quota_of(ctx: Ctx, a: Initiator, extra: int) -> int:
    q, count = a.target.quota, a.target.handle_count
    if q + extra > count:
        ctx.skip(f"the quota ({q}) leaves too few handles of the range ({count}) for the case")
    if q > 4096:
        ctx.skip(f"a quota of {q} blocks would take too long to fill")
    return q


@case("ops.quota.no_space", "Allocation Quotas", RULE, QUOTA)
async def quota(ctx: Ctx) -> None:
    a = await ctx.connect(features=0, credits=32)
    q = quota_of(ctx, a, 1)
    hs = await ctx.handles(a, q + 1)
    await fill_quota(ctx, a, hs[:q], "")
    try:
        status, _ = await ctx.outcome(a.alloc_store(hs[q], b"one too many"))
    except Exception as exc:   # the text allows terminating the session
        if not a.qp.closed:
            raise
        ctx.note(f"the target terminated the session on the allocation beyond the quota ({exc})")
        return
    ctx.check(status == "NO_SPACE", "the allocation beyond the quota: NO_SPACE", status)
    await ctx.ok(a.free(hs[0]), "FREE within the full quota")
    await ctx.ok(a.alloc_store(hs[q], b"fits again"), "ALLOC_STORE after a FREE released one unit")


@case("ops.no_side_effect.quota", SECTION, RULE, VALIDATE)
async def no_side_effect_quota(ctx: Ctx) -> None:
    """Failed ALLOC_STOREs of every kind use no quota and no ticket: afterwards a whole
    quota of ALLOC_STOREs still succeeds. Once in a default-mode session (shared ring),
    once with DIRECT_ALLOC when offered, where the session's own ring has exactly a quota
    of blocks, so a ticket taken and dropped leaves the last allocation without one."""
    for features in (0, Feature.DIRECT_ALLOC) if ctx.info.features & Feature.DIRECT_ALLOC else (0,):
        a = await ctx.connect(features=features)
        ring = "its own ring" if a.target.features & Feature.DIRECT_ALLOC else "the shared ring"
        q = quota_of(ctx, a, 1)
        hs = await ctx.handles(a, q + 1)
        size, outside = a.target.block_size, 0xFFFF_FFFF_FFFF_FF00
        r = await bind(ctx, a, hs[0], b"bound")
        failing = [
            (a.alloc_store(hs[1], bytes(size + 8), inline=False), "TOO_LARGE", "ALLOC_STORE larger than Block Size"),
            (a.alloc_store(hs[1], bytes(size + 8), inline=False), "TOO_LARGE", "ALLOC_STORE larger than Block Size"),
            (a.alloc_store(hs[0], b"again"), "ALREADY_BOUND", "ALLOC_STORE to a bound handle"),
            (a.alloc_store(outside, b"x"), "INVALID_HANDLE", "ALLOC_STORE outside every range"),
            (a.free(hs[1]), "NOT_VALID", "FREE of an unbound handle"),
            (a.alloc_store(hs[0], b"again", generation=other_generation(r.generation)), "STALE_GENERATION",
             "ALLOC_STORE with a wrong Generation"),
        ]
        try:
            for coro, _status, what in failing:
                got, _ = await ctx.outcome(coro)
                ctx.check(got != "OK", f"{what}: refused", "completed OK")
        finally:
            close_all(coro for coro, _, _ in failing)
        await fill_quota(ctx, a, hs[1:q], f"after {len(failing)} failed requests ({ring})")


