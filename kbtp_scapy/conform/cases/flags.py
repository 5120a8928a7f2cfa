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
from typing import NamedTuple

from ... import codec
from ...initiator import Initiator
from ...rnic import Access
from ...tables import memory as M
from ...vocab import AnyMessage, Feature, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..registry import RULE, case
from .common import SENTINEL, bind, buffer, data

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


class Answer(NamedTuple):
    status: int
    record: bool                 # a completion record, not a COMPLETION message
    invalidated: int | None      # the STag a COMPLETION's Send with Invalidate revoked


async def _request(ctx: Ctx, a: Initiator, values: AnyMessage, what: str) -> Answer:
    """Send ``values`` (with a Completion Descriptor when RECORD is set) and judge how it
    completed: a completion record where the session was granted RECORD_COMPLETION and the
    request has RECORD, else a COMPLETION message (the slot untouched)."""
    flags = values["flags"]
    records = bool(flags & F.RECORD and a.target.features & Feature.RECORD_COMPLETION)
    slot = None
    if flags & F.RECORD:
        slot = a.memory.register(bytearray([SENTINEL]) * M.COMPLETION_RECORD.size, Access.REMOTE_WRITE)
        values = {**values, "cd.stag": slot.stag, "cd.offset": 0, "cd.reserved": 0}
    got = await ctx.raw(a, ctx.encode(a, values))
    ctx.check(bool(got), f"{what}: a completion", "none")
    c, msg = got[0]
    if records:
        assert slot is not None                    # RECORD set: a slot was registered
        ctx.check(msg.write_imm, f"{what}: a completion record (RECORD_COMPLETION granted)", "a Send")
        return Answer(codec.decode_struct(M.COMPLETION_RECORD, bytes(slot.view), a.addr_le)["record.status"],
                      True, None)
    ctx.check(c is not None and not msg.write_imm, f"{what}: a COMPLETION message", "something else")
    assert c is not None                           # the check above ended the case otherwise
    if slot is not None:
        ctx.check(bytes(slot.view) == bytes([SENTINEL]) * len(slot.view), f"{what}: the Completion "
                  "Descriptor's slot untouched (RECORD_COMPLETION not granted)", "octets written into it")
    return Answer(c["status"], False, msg.invalidated)


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
    got = await _request(ctx, a, values, what)
    ctx.check(got.status == Status.OK, f"{what}: OK", status_name(got.status))
    if source is not None and not got.record:    # an inline store names no STag to revoke
        revoke = bool(flags & F.INVALIDATE)
        ctx.check(got.invalidated == (source.stag if revoke else None), f"{what}: its COMPLETION "
                  f"{'a Send with Invalidate of the source STag' if revoke else 'a plain Send'}",
                  "a plain Send" if got.invalidated is None else f"Send with Invalidate of {got.invalidated:#x}")
    await _sealed_as(ctx, a, h, payload, bool(flags & F.SEAL), f"after {what}")


async def _sealed_as(ctx: Ctx, a: Initiator, h: int, payload: bytes, sealed: bool, when: str) -> None:
    """A LOAD without ALLOW_UNSEALED is OK with ``payload`` exactly when the block is sealed."""
    status, got = await ctx.outcome(a.load(h))
    want = "OK" if sealed else "NOT_SEALED"
    ctx.check(status == want, f"LOAD without ALLOW_UNSEALED {when}: {want} (the block "
              f"{'sealed' if sealed else 'not sealed'})", status)
    if sealed and got is not None:
        ctx.check(got.data == payload, f"the stored octets {when}", "other octets")


def _record_offered(ctx: Ctx) -> int:
    """RECORD_COMPLETION when the target offers it, so that RECORD is judged both ways."""
    return ctx.info.features & Feature.RECORD_COMPLETION


@case("ops.flags.stores", "Common Header", RULE, FLAGS)
async def store_flags(ctx: Ctx) -> None:
    """ALLOC_STORE and STORE with every combination of INLINE, SEAL, RECORD, INVALIDATE and
    ALLOW_UNSEALED (inline only where the data fits Max Inline): each completes OK (by a
    record exactly when RECORD is set and granted) with the data stored, the block sealed
    exactly when SEAL was set, and the source STag revoked by the COMPLETION exactly when
    INVALIDATE was set."""
    a = await ctx.connect(features=_record_offered(ctx))
    h = await ctx.handle(a)
    payload = data(min(48, a.target.block_size))
    inline = F.INLINE if a.target.max_inline >= len(payload) else 0
    for flags in _combinations(*(f for f in (inline, F.SEAL, F.RECORD, F.INVALIDATE, F.ALLOW_UNSEALED) if f)):
        await _store(ctx, a, Opcode.ALLOC_STORE, h, payload, flags)
        await ctx.ok(a.free(h), f"FREE after ALLOC_STORE with {named(flags)}")
        await bind(ctx, a, h, data(16), seal=False)
        await _store(ctx, a, Opcode.STORE, h, payload, flags)
        await ctx.ok(a.free(h), f"FREE after STORE with {named(flags)}")


@case("ops.flags.load_free", "Common Header", RULE, FLAGS)
async def load_free_flags(ctx: Ctx) -> None:
    """LOADs of an unsealed block with every combination of ALLOW_UNSEALED, INVALIDATE, RECORD
    and SEAL: OK exactly with ALLOW_UNSEALED, the buffer's STag revoked exactly with
    INVALIDATE on an OK LOAD answered by a COMPLETION, and the block still unsealed (a LOAD
    stores nothing, so SEAL seals nothing); then FREEs with each flag but INLINE: each
    unbinds."""
    a = await ctx.connect(features=_record_offered(ctx))
    h = await ctx.handle(a)
    payload = data(40)
    await bind(ctx, a, h, payload, seal=False)
    for flags in _combinations(F.ALLOW_UNSEALED, F.INVALIDATE, F.RECORD, F.SEAL):
        what = f"LOAD of an unsealed block with {named(flags)}"
        region = buffer(a, 64)
        got = await _request(ctx, a, {
            "opcode": Opcode.LOAD, "handle": h, "flags": flags, "dd.stag": region.stag, "dd.offset": 0,
            "dd.length": region.length}, what)
        want = Status.OK if flags & F.ALLOW_UNSEALED else Status.NOT_SEALED
        ctx.check(got.status == want, f"{what}: {status_name(want)}", status_name(got.status))
        if want == Status.OK:
            ctx.check(bytes(region.view[:len(payload)]) == payload, f"{what}: the data", "other octets")
            if not got.record:
                revoke = bool(flags & F.INVALIDATE)
                ctx.check(got.invalidated == (region.stag if revoke else None) and region.valid != revoke,
                          f"{what}: the buffer's STag {'revoked' if revoke else 'still valid'}",
                          "valid" if region.valid else f"revoked ({got.invalidated})")
        await _sealed_as(ctx, a, h, payload, False, f"after {what}")
    every = F.SEAL | F.RECORD | F.INVALIDATE | F.ALLOW_UNSEALED
    for flags in (F.SEAL, F.RECORD, F.INVALIDATE, F.ALLOW_UNSEALED, every):
        what = f"FREE with {named(flags)}"
        got = await _request(ctx, a, {"opcode": Opcode.FREE, "handle": h, "flags": flags}, what)
        ctx.check(got.status == Status.OK, f"{what}: OK", status_name(got.status))
        await ctx.expect(a.load(h, allow_unsealed=True), "NOT_VALID", f"LOAD after {what}")
        await bind(ctx, a, h, payload, seal=False)
