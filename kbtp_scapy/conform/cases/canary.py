"""Octets a target must not touch: canaries around every buffer it writes.

A LOAD writes Data Length octets at the start of the Data Descriptor and nothing else; a
completion record is 24 octets at the Completion Descriptor; a store writes its own block
and no other. Each buffer here is registered with canary octets before and after the
part the request names (and, for a LOAD, after the part the data fills), so a write one
octet too early, too long or padded to the descriptor's Length shows.
"""
from __future__ import annotations

from ... import codec
from ...initiator import Initiator
from ...rnic import Access
from ...rnic.memory import MemoryRegion
from ...tables import memory as M
from ...vocab import AnyMessage, Feature, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..registry import MUST, RULE, case
from .common import SENTINEL, bind, data, holds

CANARY = 40          # octets of canary on each side of a named part
BASE = 1 << 40       # the canary buffers' Tagged Offset: wide, and not zero


def fenced(ini: Initiator, length: int) -> MemoryRegion:
    """A writable buffer of ``length`` octets with CANARY sentinel octets on each side;
    the named part starts at Tagged Offset ``BASE + CANARY``."""
    return ini.memory.register(bytearray([SENTINEL]) * (CANARY + length + CANARY),
                               Access.REMOTE_WRITE, base=BASE)


def touched(region: MemoryRegion, start: int, end: int) -> list[str]:
    """Octets outside ``[start, end)`` of the region that are no longer the sentinel."""
    view = bytes(region.view)
    bad = [i for i in range(len(view)) if not start <= i < end and view[i] != SENTINEL]
    if not bad:
        return []
    return [f"{len(bad)} octet(s) outside the part the target may write, at buffer offsets "
            f"{bad[0]}..{bad[-1]} (the part is {start}..{end - 1})"]


@case("ops.load.canaries", "Block Load", RULE, """It RDMA-writes Data Length octets of the block to
      the Data Descriptor. Data Length MUST NOT exceed the descriptor Length.""")
async def load_canaries(ctx: Ctx) -> None:
    """LOADs into a descriptor longer than the data, and one exactly as long: the data at
    the start, every other octet of the buffer (before, after the data, after the
    descriptor) untouched; a refused LOAD touches nothing."""
    a = await ctx.connect(features=0)
    h, empty = await ctx.handles(a, 2)
    payload = data(100)
    await bind(ctx, a, h, payload)
    for length in (len(payload) + 60, len(payload)):
        region = fenced(a, length)
        c = await ctx.answer(a, ctx.encode(a, {
            "opcode": Opcode.LOAD, "handle": h, "dd.stag": region.stag, "dd.offset": BASE + CANARY,
            "dd.length": length}), f"a LOAD of {len(payload)} octets into a {length}-octet descriptor")
        ctx.check(c["status"] == Status.OK, "the LOAD: OK", status_name(c["status"]))
        got = bytes(region.view[CANARY:CANARY + len(payload)])
        ctx.check(got == payload, "the data at the start of the descriptor",
                  f"{sum(x != y for x, y in zip(got, payload))} octets that differ")
        bad = touched(region, CANARY, CANARY + len(payload))
        ctx.check(not bad, f"only the {len(payload)} octets of Data Length written into a "
                  f"{length}-octet descriptor", "; ".join(bad))
    for handle, length, status in ((h, len(payload) - 1, "TOO_LARGE"), (empty, 64, "NOT_VALID")):
        region = fenced(a, length)
        c = await ctx.answer(a, ctx.encode(a, {
            "opcode": Opcode.LOAD, "handle": handle, "dd.stag": region.stag, "dd.offset": BASE + CANARY,
            "dd.length": length}), f"a LOAD answered {status}")
        ctx.check(c["status"] == Status[status], status, status_name(c["status"]))
        bad = touched(region, 0, 0)
        ctx.check(not bad, f"a LOAD answered {status} writes nothing", "; ".join(bad))


@case("completion.record.canaries", "Completion", RULE, """the target instead writes a 24-octet
      completion record to the Completion Descriptor: Request ID (64 bits), Status (16 bits),
      Generation (16 bits), Data Length (32 bits), and Block Offset (64 bits).""",
      transport="roce", features=Feature.RECORD_COMPLETION)
async def record_canaries(ctx: Ctx) -> None:
    """Records of a LOAD, a FREE and a refused LOAD, each into a slot with canaries on
    both sides: 24 octets written, with the values the request's completion has."""
    a = await ctx.connect(need=Feature.RECORD_COMPLETION)
    h, empty = await ctx.handles(a, 2)
    payload = data(48)
    r = await bind(ctx, a, h, payload)
    dest = a.memory.register(bytearray(len(payload)), Access.REMOTE_WRITE)
    size = M.COMPLETION_RECORD.size
    expected: tuple[tuple[str, AnyMessage, tuple[int, int | None, int | None]], ...] = (
        ("a LOAD", {"opcode": Opcode.LOAD, "handle": h, "dd.stag": dest.stag, "dd.offset": 0,
                    "dd.length": len(payload)}, (Status.OK, len(payload), r.block_offset)),
        ("a LOAD of an unbound handle", {"opcode": Opcode.LOAD, "handle": empty, "dd.stag": dest.stag,
                                         "dd.offset": 0, "dd.length": len(payload)},
         (Status.NOT_VALID, None, None)),
        ("a FREE", {"opcode": Opcode.FREE, "handle": h}, (Status.OK, None, None)))
    for what, values, want in expected:
        slot = fenced(a, size)
        rid = ctx.rid() | 0xABCD << 48
        got = await ctx.raw(a, codec.encode({**values, "request_id": rid, "flags": RequestFlag.RECORD,
                                             "cd.stag": slot.stag, "cd.offset": BASE + CANARY,
                                             "cd.reserved": 0}, a.addr_le))
        ctx.check(bool(got) and got[0][1].write_imm, f"{what}: a completion record (RDMA Write with "
                  "Immediate)", "none" if not got else "a Send")
        bad = touched(slot, CANARY, CANARY + size)
        ctx.check(not bad, f"{what}: the 24 octets of the record written and no others", "; ".join(bad))
        d = codec.decode_struct(M.COMPLETION_RECORD, bytes(slot.view[CANARY:CANARY + size]), a.addr_le)
        seen = (hex(d["record.request_id"]), d["record.status"], d["record.data_length"],
                d["record.block_offset"])
        status, length, offset = want
        ok = (seen[0] == hex(rid) and seen[1] == status and (length is None or seen[2] == length)
              and (offset is None or seen[3] == offset))
        ctx.check(ok, f"{what}: the record with Request ID {rid:#x}, Status {status_name(status)}"
                  + (f", Data Length {length}" if length is not None else "")
                  + (f", Block Offset {offset:#x}" if offset is not None else ""),
                  f"{seen[0]}, {status_name(seen[1])}, {seen[2]}, {seen[3]:#x}")


@case("ops.store.neighbours", "Block Mapped Store", MUST, """The target reads the table entry, which
      MUST be VALID and not SEALED and MUST belong to the initiator's handle range. It obtains the
      data ... and writes it into the block.""")
async def store_neighbours(ctx: Ctx) -> None:
    """Whole-block stores into one of three bound blocks: the other two keep their data
    (and, read through the Pool STag when DIRECT_LOAD is offered, so do the blocks just
    before and after the stored one in the pool)."""
    a = await ctx.connect(features=Feature.DIRECT_LOAD)
    hs = await ctx.handles(a, 3)
    size = a.target.block_size
    contents = {h: data(size) for h in hs}
    bound = {h: await bind(ctx, a, h, contents[h], seal=h != hs[1], inline=False) for h in hs}
    pool = a.target.fields.get("pool.stag") if a.target.features & Feature.DIRECT_LOAD else None
    target = bound[hs[1]].block_offset
    around = [o for o in (target - size, target + size)
              if pool is not None and a.target.fields["pool.offset"] <= o
              and o + size <= a.target.fields["pool.offset"] + a.target.fields["pool.count"] * size]

    async def read_pool(o: int) -> bytes:
        assert pool is not None                  # ``around`` is empty without a Pool STag
        return await ctx.wait(a.qp.read(pool, o, size), "an RDMA Read of a block")

    before = {o: await read_pool(o) for o in around}
    for inline in (False, True) if a.target.max_inline >= size else (False,):
        new = data(size)
        await ctx.ok(a.store(hs[1], new, inline=inline), f"STORE of a whole block{' inline' if inline else ''}")
        contents[hs[1]] = new
    for h in hs:
        await holds(ctx, a, h, contents[h], f"after whole-block STOREs to 0x{hs[1]:x}", bound[h].generation)
    for o, old in before.items():
        now = await read_pool(o)
        ctx.check(now == old, f"the block at {o:#x}, beside the stored one at {target:#x}, unchanged",
                  f"{sum(x != y for x, y in zip(now, old))} octets changed")
