"""Every request flag of every opcode, alone and together, each judged by its own effect.

A target that reads one flag bit for another (SEAL from INLINE's bit, say) still passes
every case that sends the two together, as an initiator's stores usually do. Here each
store is sent with every combination of INLINE, SEAL, INVALIDATE and ALLOW_UNSEALED, and
each LOAD and FREE with every combination of the flags that mean something to it, or
nothing: SEAL seals exactly the blocks stored with it, INLINE decides only where the data
comes from, INVALIDATE revokes the Data Descriptor's STag and nothing else changes, and a
flag that means nothing to an opcode changes nothing.
"""
from __future__ import annotations

import itertools

from ...initiator import Initiator
from ...rnic import Access
from ...vocab import AnyMessage, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..registry import RULE, case
from .common import bind, buffer, data, load_request

F = RequestFlag
FLAGS = """Flags are interpreted per opcode; for LOAD, STORE, ALLOC_STORE, and FREE they are: 0x0001
    INLINE: data follows the request. 0x0002 SEAL: seal the block after the store. 0x0008 INVALIDATE:
    the target completes with Send with Invalidate , invalidating the STag of the initiator's Data
    Descriptor. 0x0010 ALLOW_UNSEALED: a load may return an unsealed block."""


def named(flags: int) -> str:
    return "|".join(f.name or "" for f in F if f & flags) or "no flags"


def _combinations(*bits: int) -> list[int]:
    """Every OR of a subset of ``bits``, the empty one first."""
    return [sum(chosen) for n in range(len(bits) + 1) for chosen in itertools.combinations(bits, n)]


async def _store(ctx: Ctx, a: Initiator, opcode: Opcode, h: int, payload: bytes, flags: int) -> None:
    """One store with exactly ``flags``: OK, the right STag revoked, the block sealed exactly
    when SEAL was set, the data stored."""
    what = f"{opcode.name} with {named(flags)}"
    values: AnyMessage = {"opcode": opcode, "handle": h, "flags": flags}
    source = None
    if flags & F.INLINE:
        values["inline_data"] = payload
    else:
        source = a.memory.register(bytearray(payload), Access.REMOTE_READ)
        values.update({"dd.stag": source.stag, "dd.offset": 0, "dd.length": len(payload)})
    got = await ctx.raw(a, ctx.encode(a, values))
    ctx.check(bool(got) and got[0][0] is not None, f"{what}: a COMPLETION", "none")
    c, msg = got[0]
    assert c is not None                       # the check above ended the case otherwise
    ctx.check(c["status"] == Status.OK, f"{what}: OK", status_name(c["status"]))
    if source is not None:                    # an inline store names no STag to revoke
        revoked = msg.invalidated == source.stag
        ctx.check(revoked == bool(flags & F.INVALIDATE), f"{what}: its COMPLETION "
                  f"{'a Send with Invalidate of the source STag' if flags & F.INVALIDATE else 'a plain Send'}",
                  "a plain Send" if msg.invalidated is None else f"Send with Invalidate of {msg.invalidated:#x}")
    await _sealed_as(ctx, a, h, payload, bool(flags & F.SEAL), f"after {what}")


async def _sealed_as(ctx: Ctx, a: Initiator, h: int, payload: bytes, sealed: bool, when: str) -> None:
    """A LOAD without ALLOW_UNSEALED is OK with ``payload`` exactly when the block is sealed."""
    status, got = await ctx.outcome(a.load(h))
    want = "OK" if sealed else "NOT_SEALED"
    ctx.check(status == want, f"LOAD without ALLOW_UNSEALED {when}: {want} (the block "
              f"{'sealed' if sealed else 'not sealed'})", status)
    if sealed and got is not None:
        ctx.check(got.data == payload, f"the stored octets {when}", "other octets")


@case("ops.flags.stores", "Common Header", RULE, FLAGS)
async def store_flags(ctx: Ctx) -> None:
    """ALLOC_STORE and STORE with every combination of INLINE, SEAL, INVALIDATE and
    ALLOW_UNSEALED (inline only where the data fits Max Inline): each completes OK with the
    data stored, the block sealed exactly when SEAL was set, and the source STag revoked
    exactly when INVALIDATE was set."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    payload = data(min(48, a.target.block_size))
    inline = F.INLINE if a.target.max_inline >= len(payload) else 0
    for flags in _combinations(*(f for f in (inline, F.SEAL, F.INVALIDATE, F.ALLOW_UNSEALED) if f)):
        await _store(ctx, a, Opcode.ALLOC_STORE, h, payload, flags)
        await ctx.ok(a.free(h), f"FREE after ALLOC_STORE with {named(flags)}")
        await bind(ctx, a, h, data(16), seal=False)
        await _store(ctx, a, Opcode.STORE, h, payload, flags)
        await ctx.ok(a.free(h), f"FREE after STORE with {named(flags)}")


@case("ops.flags.load_free", "Common Header", RULE, FLAGS)
async def load_free_flags(ctx: Ctx) -> None:
    """LOADs of an unsealed block with every combination of ALLOW_UNSEALED, INVALIDATE and
    SEAL: OK exactly with ALLOW_UNSEALED, the buffer's STag revoked exactly with
    INVALIDATE on an OK LOAD, and the block still unsealed (a LOAD stores nothing, so SEAL
    seals nothing); then FREEs with SEAL, INVALIDATE and ALLOW_UNSEALED: each unbinds."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    payload = data(40)
    await bind(ctx, a, h, payload, seal=False)
    for flags in _combinations(F.ALLOW_UNSEALED, F.INVALIDATE, F.SEAL):
        what = f"LOAD of an unsealed block with {named(flags)}"
        region = buffer(a, 64)
        c = await ctx.answer(a, load_request(ctx, a, h, region, flags), what)
        want = Status.OK if flags & F.ALLOW_UNSEALED else Status.NOT_SEALED
        ctx.check(c["status"] == want, f"{what}: {status_name(want)}", status_name(c["status"]))
        if want == Status.OK:
            ctx.check(bytes(region.view[:len(payload)]) == payload, f"{what}: the data", "other octets")
            ctx.check(region.valid != bool(flags & F.INVALIDATE), f"{what}: the buffer's STag "
                      f"{'revoked' if flags & F.INVALIDATE else 'still valid'}",
                      "valid" if region.valid else "revoked")
        await _sealed_as(ctx, a, h, payload, False, f"after {what}")
    for flags in (F.SEAL, F.INVALIDATE, F.ALLOW_UNSEALED, F.SEAL | F.INVALIDATE | F.ALLOW_UNSEALED):
        what = f"FREE with {named(flags)}"
        c = await ctx.answer(a, ctx.encode(a, {"opcode": Opcode.FREE, "handle": h, "flags": flags}), what)
        ctx.check(c["status"] == Status.OK, f"{what}: OK", status_name(c["status"]))
        await ctx.expect(a.load(h, allow_unsealed=True), "NOT_VALID", f"LOAD after {what}")
        await bind(ctx, a, h, payload, seal=False)
