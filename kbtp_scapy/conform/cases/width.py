"""Full field widths: 64-bit Request IDs, Block Handles and Tagged Offsets, 128-bit Initiator IDs.

A target that keeps a field in fewer bits than the text gives it works for every value
whose upper half is zero, which is what most initiators send. These cases send values
that differ from one another only in their upper half, so a truncated field makes two
different values one.
"""
from __future__ import annotations

import secrets

from ... import codec
from ...rnic import Access
from ...vocab import AnyMessage, Opcode, RequestFlag
from ..context import Ctx, status_name
from ..registry import MUST, RULE, case
from .common import SENTINEL, bind, data, holds, unbound

UPPER_BITS = (1 << 32, 1 << 47, 1 << 63)


@case("completion.request_id.full_width", "Common Header", RULE, """Request ID is chosen by the
      initiator and echoed in the completion.""")
async def request_id_full_width(ctx: Ctx) -> None:
    """Pipelined requests whose Request IDs share their low 32 bits: each COMPLETION must
    echo all 64 bits of its own request's ID, in request order."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    low = secrets.randbits(32) | 1
    rids = [low | (upper << 32) for upper in (0, 1, 0x8000_0000, 0xFFFF_FFFF, secrets.randbits(32))]
    inline = RequestFlag.INLINE
    steps: list[AnyMessage] = [
        {"opcode": Opcode.ALLOC_STORE, "handle": h, "flags": inline, "inline_data": b"wide"},
        {"opcode": Opcode.STORE, "handle": h, "flags": inline, "inline_data": b"wider"},
        {"opcode": Opcode.FREE, "handle": h},
        {"opcode": Opcode.FREE, "handle": h},
        {"opcode": Opcode.ALLOC_STORE, "handle": h, "flags": inline, "inline_data": b"again"}]
    ctx.send(a, [codec.encode({**s, "request_id": rid}, a.addr_le) for s, rid in zip(steps, rids)])
    got = await ctx.collect(a, len(rids))
    seen = [c["request_id"] if c else None for c in got]
    ctx.check(seen == rids, "COMPLETIONs echoing every 64 bits of Request IDs that share their low "
              "32 bits, in request order", [hex(r) if r is not None else r for r in seen])
    statuses = [status_name(c["status"]) if c else "none" for c in got]
    ctx.check(statuses == ["OK", "OK", "OK", "NOT_VALID", "OK"],
              "ALLOC_STORE, STORE, FREE OK, a second FREE NOT_VALID, ALLOC_STORE OK", statuses)


@case("ops.handle.upper_half", "Operations", MUST, """the handle MUST be within a range the initiator
      is authorized for (its own range for stores and frees) (Block Handle: A 64-bit name, chosen
      by an initiator within the handle range assigned to it)""")
async def handle_upper_half(ctx: Ctx) -> None:
    """Handles equal to a bound one of the range in their low 32 bits, differing above:
    all outside every range, so every request on them is INVALID_HANDLE and the bound
    handle is untouched."""
    a = await ctx.connect(features=0)
    h, spare = await ctx.handles(a, 2)
    payload = data(90)
    r = await bind(ctx, a, h, payload, seal=False)
    for bit in UPPER_BITS:
        far, near = h ^ bit, spare ^ bit
        what = f"0x{far:x} (0x{h:x} with bit {bit.bit_length() - 1} set)"
        await ctx.expect(a.load(far, allow_unsealed=True), "INVALID_HANDLE", f"LOAD of {what}")
        await ctx.expect(a.store(far, b"upper"), "INVALID_HANDLE", f"STORE to {what}")
        await ctx.expect(a.free(far), "INVALID_HANDLE", f"FREE of {what}")
        await ctx.expect(a.alloc_store(near, b"upper"), "INVALID_HANDLE",
                         f"ALLOC_STORE to 0x{near:x} (0x{spare:x} with bit {bit.bit_length() - 1} set)")
    await holds(ctx, a, h, payload, "after requests on handles differing only in their upper half",
                r.generation)
    await unbound(ctx, a, spare, "after ALLOC_STOREs to handles differing from it only in their upper half")


#: Tagged Offsets of the checker's buffers, each with upper half bits set.
WIDE_BASES = (1 << 32, (1 << 63) | 0x40, 0xFFFF_FFFF_FFFF_0000)


@case("ops.descriptor.offset_full_width", "Descriptors", RULE, """A Data Descriptor is 16 octets: STag
      (32 bits), Tagged Offset (64 bits), and Length (32 bits), naming a buffer of the initiator.""")
async def offset_full_width(ctx: Ctx) -> None:
    """Buffers whose Tagged Offsets need all 64 bits: a LOAD must write, and a non-inline
    store must read, exactly the octets named."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    size = min(a.target.block_size, 512)
    for base in WIDE_BASES:
        payload = data(size)
        src = a.memory.register(bytearray(payload), Access.REMOTE_READ, base=base)
        store = ctx.encode(a, {"opcode": Opcode.ALLOC_STORE if base == WIDE_BASES[0] else Opcode.STORE,
                               "handle": h, "dd.stag": src.stag, "dd.offset": base, "dd.length": size})
        c = await ctx.answer(a, store, f"a store from Tagged Offset {base:#x}")
        ctx.check(c["status"] == 0, f"the store reading {size} octets at Tagged Offset {base:#x}: OK",
                  status_name(c["status"]))
        dest = a.memory.register(bytearray([SENTINEL]) * size, Access.REMOTE_WRITE, base=base)
        load = ctx.encode(a, {"opcode": Opcode.LOAD, "handle": h, "flags": RequestFlag.ALLOW_UNSEALED,
                              "dd.stag": dest.stag, "dd.offset": base, "dd.length": size})
        c = await ctx.answer(a, load, f"a LOAD to Tagged Offset {base:#x}")
        ctx.check(c["status"] == 0, f"the LOAD to Tagged Offset {base:#x}: OK", status_name(c["status"]))
        ctx.check(bytes(dest.view) == payload, f"the stored octets at Tagged Offset {base:#x}",
                  f"{sum(x != y for x, y in zip(dest.view, payload))} octets that differ")


@case("session.initiator_id.full_width", "Session Establishment", MUST, """a target uses it [the
      Initiator ID] to restore the initiator's handle range and bindings after a reconnection ...
      a target MUST reject a HELLO whose Initiator ID belongs to a session that is still active.""")
async def initiator_id_full_width(ctx: Ctx) -> None:
    """A retained session, then HELLOs with Initiator IDs equal to its ID in one half
    only: each is another initiator (accepted while the first is retained, with a range
    of its own, and without the first's bindings), and the first still gets its own back."""
    first = ctx.new_id()
    a = await ctx.connect(features=0, initiator_id=first)
    h, payload = await ctx.handle(a), data(64)
    r = await bind(ctx, a, h, payload)
    own = (a.target.handle_base, a.target.handle_count)
    await ctx.goodbye(a, release=False)
    others = []
    for what, ident in (("its upper 64 bits", first[:8] + secrets.token_bytes(8)),
                        ("its lower 64 bits", secrets.token_bytes(8) + first[8:])):
        status, other = await ctx.hello_status(ident)
        ctx.check(other is not None, f"a HELLO with an Initiator ID sharing only {what} with a retained "
                  "session accepted as another initiator", f"HELLO_ACK Status {status}")
        assert other is not None                 # the check above ended the case otherwise
        seen = (other.target.handle_base, other.target.handle_count)
        ctx.check(seen != own, f"the Initiator ID sharing only {what} given a range other than the "
                  f"retained session's ({own[0]:#x}, {own[1]})", f"({seen[0]:#x}, {seen[1]})")
        others.append(other)
    b = await ctx.reconnect(a)
    seen = (b.target.handle_base, b.target.handle_count)
    ctx.check(seen == own, f"the retained session's range ({own[0]:#x}, {own[1]}) back for its own "
              "Initiator ID", f"({seen[0]:#x}, {seen[1]})")
    await holds(ctx, b, h, payload, "after HELLOs with Initiator IDs sharing one half with it",
                r.generation)
