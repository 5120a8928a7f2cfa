"""Completion: Request ID echo, request order, INVALIDATE, data before COMPLETION, records."""
from __future__ import annotations

from ... import codec
from ...initiator.client import ALL_FEATURES
from ...rnic import Access, MemoryRegion
from ...tables import memory as M
from ...vocab import AnyMessage, Feature, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..hold import SETTLE
from ..registry import MUST, MUST_NOT, RULE, case
from .common import SENTINEL, bind, buffer, data, load_request

SECTION = "Completion"


@case("completion.request_id", "Common Header", RULE, """Request ID is chosen by the initiator and
      echoed in the completion.""")
async def request_id(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, h2 = await ctx.handles(a, 2)
    rid = 0xFEDC_BA98_7654_3210
    requests: tuple[tuple[str, AnyMessage], ...] = (
            ("an ALLOC_STORE", {"opcode": Opcode.ALLOC_STORE, "handle": h, "inline_data": b"echo"}),
            ("a failing LOAD", {"opcode": Opcode.LOAD, "handle": h2, "dd.stag": 1, "dd.length": 8}))
    for what, values in requests:
        c = await ctx.answer(a, codec.encode({**values, "request_id": rid}, a.addr_le), what)
        ctx.check(c["request_id"] == rid, f"{what}: Request ID {rid:#x} echoed", hex(c["request_id"]))
        ctx.check(c["version"] == 1, "Version 1 in the COMPLETION", c["version"])
        rid -= 1


@case("completion.order", "Operations", RULE, "A target processes the requests of one connection in order.")
async def order(ctx: Ctx) -> None:
    """Seven pipelined requests on one handle, each depending on the one before; then a
    non-inline ALLOC_STORE whose data the checker holds back, and a LOAD behind it: the
    LOAD must not complete, nor be executed, before the store has its data."""
    a = await ctx.connect(features=0)
    h, held = await ctx.handles(a, 2)
    if min(a.target.request_credits, a.completion_credits) < 7:
        ctx.skip("fewer than 7 Request Credits: cannot pipeline the sequence")
    one, two, three = data(40), data(30), data(20)
    regions = [buffer(a, 64) for _ in range(3)]
    steps: list[tuple[AnyMessage | MemoryRegion, str]] = [
        ({"opcode": Opcode.ALLOC_STORE, "handle": h, "inline_data": one}, "OK"),
        ({"opcode": Opcode.STORE, "handle": h, "inline_data": two}, "OK"),
        (regions[0], "OK"),
        ({"opcode": Opcode.FREE, "handle": h}, "OK"),
        (regions[1], "NOT_VALID"),
        ({"opcode": Opcode.ALLOC_STORE, "handle": h, "flags": RequestFlag.INLINE | RequestFlag.SEAL,
          "inline_data": three}, "OK"),
        (regions[2], "OK"),
    ]
    messages = [load_request(ctx, a, h, step, RequestFlag.ALLOW_UNSEALED) if isinstance(step, MemoryRegion)
                else ctx.encode(a, step) for step, _ in steps]
    await _in_order(ctx, a, messages, [want for _, want in steps])
    ctx.check(bytes(regions[0].view[:len(two)]) == two and bytes(regions[2].view[:len(three)]) == three,
              "each LOAD saw the stores before it", "other data")

    payload = data(min(a.target.block_size, 512))
    source = a.memory.register(bytearray(payload), Access.REMOTE_READ)
    loaded = buffer(a, len(payload))
    messages = [ctx.encode(a, {"opcode": Opcode.ALLOC_STORE, "handle": held, "dd.stag": source.stag,
                               "dd.offset": 0, "dd.length": len(payload)}),
                load_request(ctx, a, held, loaded, RequestFlag.ALLOW_UNSEALED)]
    hold = ctx.hold_reads(a)
    hold.hold()
    try:
        ctx.send(a, messages)
        if not await hold.wait_requested(ctx.timeout):
            ctx.check(False, "an RDMA Read of the data of a non-inline ALLOC_STORE",
                      f"none within {ctx.timeout:g} s")
        early = await ctx.collect(a, len(messages), SETTLE)
    finally:
        hold.release()
    ctx.check(not early, "no COMPLETION while the ALLOC_STORE waits for its data (the checker holds "
              "its RDMA Read Response back), since the LOAD after it may not overtake it",
              f"{len(early)} came first: " + ", ".join(_describe(c) for c in early))
    await _in_order(ctx, a, [], ["OK", "OK"], rids=[codec.decode(m, a.addr_le)["request_id"] for m in messages])
    ctx.check(bytes(loaded.view) == payload, "the LOAD behind the held ALLOC_STORE saw its data",
              "other data")


def _describe(c: AnyMessage | None) -> str:
    return "something that is no COMPLETION" if c is None else \
        f"Request ID {c['request_id']:#x} {status_name(c['status'])}"


async def _in_order(ctx: Ctx, a, messages: list[bytes], statuses: list[str],
                    rids: list[int] | None = None) -> None:
    """Send ``messages`` pipelined (or only collect, when empty): their COMPLETIONs must come
    back in request order with ``statuses``."""
    rids = rids or [codec.decode(m, a.addr_le)["request_id"] for m in messages]
    ctx.send(a, messages)
    got = await ctx.collect(a, len(rids))
    ctx.check(len(got) == len(rids), f"{len(rids)} COMPLETIONs", len(got))
    seen = [c["request_id"] if c else None for c in got]
    ctx.check(seen == rids, "COMPLETIONs in request order", [hex(r) if r else r for r in seen])
    got_statuses = [status_name(c["status"]) for c in got if c is not None]   # all, by the check above
    ctx.check(got_statuses == statuses, f"statuses {statuses}", got_statuses)


@case("completion.invalidate", "Common Header", RULE, """0x0008 INVALIDATE: the target completes
      with Send with Invalidate , invalidating the STag of the initiator's Data Descriptor.""")
async def invalidate(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h, h2 = await ctx.handles(a, 2)
    payload = data(100)
    await bind(ctx, a, h, payload)
    region = buffer(a, 128)
    got = await ctx.raw(a, load_request(ctx, a, h, region, RequestFlag.INVALIDATE))
    ctx.check(bool(got) and got[0][0] is not None, "a COMPLETION", "none")
    ctx.check(got[0][1].invalidated == region.stag and not region.valid,
              f"a Send with Invalidate of STag {region.stag:#010x}",
              "a plain Send" if got[0][1].invalidated is None else f"STag {got[0][1].invalidated:#x}")
    ctx.check(bytes(region.view[:100]) == payload, "the loaded data", "other octets")
    src = a.memory.register(bytearray(payload), Access.REMOTE_READ)
    store = ctx.encode(a, {"opcode": Opcode.STORE, "handle": h2, "flags": RequestFlag.INVALIDATE,
                           "dd.stag": src.stag, "dd.offset": 0, "dd.length": len(payload)})
    await bind(ctx, a, h2, b"first", seal=False)
    got = await ctx.raw(a, store)
    ctx.check(bool(got) and got[0][1].invalidated == src.stag,
              "the STORE's COMPLETION as a Send with Invalidate of its source STag",
              "a plain Send" if got and got[0][1].invalidated is None else "none")


@case("completion.load_data", SECTION, RULE, """receipt of the completion implies that the loaded
      data is in the initiator's buffer.""")
async def load_data(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    payload = data(a.target.block_size)
    await bind(ctx, a, h, payload, inline=False)
    got = await ctx.ok(a.load(h), "LOAD of a whole block")
    ctx.check(got.data == payload, f"the {len(payload)} octets in the buffer at the COMPLETION",
              f"{sum(x != y for x, y in zip(got.data, payload))} octets differ")


@case("completion.record.rdmap", SECTION, MUST_NOT, """RDMAP does not guarantee this (rules 3 and 5
      of ), so a target MUST NOT advertise RECORD_COMPLETION in the RDMAP binding.""", transport="iwarp")
async def record_rdmap(ctx: Ctx) -> None:
    a = await ctx.connect(features=ALL_FEATURES)
    ctx.check(not a.target.features & Feature.RECORD_COMPLETION, "HELLO_ACK Features without RECORD_COMPLETION",
              f"Features {a.target.features:#06x}")


@case("completion.record.write_imm", "InfiniBand and RoCEv2", MUST, """Completion records on these
      transports MUST be written with RDMA Write with Immediate, so that the initiator learns of
      completion from its completion queue rather than by polling memory.""",
      transport="roce", features=Feature.RECORD_COMPLETION)
async def record_write_imm(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.RECORD_COMPLETION)
    h = await ctx.handle(a)
    payload = data(50)
    r = await bind(ctx, a, h, payload)
    region = buffer(a, 64)
    record = a.memory.register(bytearray(M.COMPLETION_RECORD.size), Access.REMOTE_WRITE)
    rid = ctx.rid()
    message = codec.encode({"opcode": Opcode.LOAD, "request_id": rid, "handle": h, "flags": RequestFlag.RECORD,
                            "dd.stag": region.stag, "dd.offset": 0, "dd.length": region.length,
                            "cd.stag": record.stag, "cd.offset": 0, "cd.reserved": 0}, a.addr_le)
    got = await ctx.raw(a, message)
    ctx.check(bool(got), "a completion", "none")
    ctx.check(got[0][1].write_imm, "an RDMA Write with Immediate of the completion record",
              "a Send" if got[0][0] else "something else")
    d = codec.decode_struct(M.COMPLETION_RECORD, bytes(record.view), a.addr_le)
    seen = (hex(d["record.request_id"]), d["record.status"], d["record.generation"],
            d["record.data_length"], hex(d["record.block_offset"]))
    ctx.check(seen == (hex(rid), Status.OK, r.generation, len(payload), hex(r.block_offset)),
              "the record: Request ID, Status OK, Generation, Data Length, Block Offset", seen)
    ctx.check(bytes(region.view[:len(payload)]) == payload, "the loaded data", "other octets")
    if got[0][1].imm != rid & 0xFFFFFFFF:
        ctx.note("the Immediate Data is not the low 32 bits of the Request ID, as the reference "
                 "target's is")


@case("completion.invalidate.two_descriptors", "Common Header", RULE, """0x0008 INVALIDATE: the target
      completes with Send with Invalidate , invalidating the STag of the initiator's Data
      Descriptor. (Completion: If the target advertised RECORD_COMPLETION and the request has the
      RECORD flag, the target instead writes a 24-octet completion record)""")
async def invalidate_two_descriptors(ctx: Ctx) -> None:
    """Requests with INVALIDATE that carry a Completion Descriptor (RECORD) beside a Data
    Descriptor (a LOAD, a non-inline STORE and ALLOC_STORE) or none with a STag (an inline
    STORE, a FREE). In a session not granted RECORD_COMPLETION each completes by a COMPLETION
    OK, a Send with Invalidate of the Data Descriptor's STag where it has one, the Completion
    Descriptor's STag still valid and its slot untouched; where RECORD_COMPLETION is granted,
    the record is written to a slot whose STag stays valid."""
    for features in (0, Feature.RECORD_COMPLETION) if ctx.info.features & Feature.RECORD_COMPLETION else (0,):
        a = await ctx.connect(features=features)
        records = bool(a.target.features & Feature.RECORD_COMPLETION)
        if features and not records:
            break
        h, h2, fresh = await ctx.handles(a, 3)
        payload = data(100)
        await bind(ctx, a, h, payload)
        await bind(ctx, a, h2, b"first", seal=False)
        steps: list[tuple[str, AnyMessage, MemoryRegion | None]] = [
            ("a LOAD", {"opcode": Opcode.LOAD, "handle": h}, buffer(a, 128))]
        for opcode, handle in ((Opcode.STORE, h2), (Opcode.ALLOC_STORE, fresh)):
            src = a.memory.register(bytearray(payload), Access.REMOTE_READ)
            steps.append((f"a non-inline {opcode.name}", {"opcode": opcode, "handle": handle}, src))
        if a.target.max_inline >= 8:
            steps.append(("an inline STORE", {"opcode": Opcode.STORE, "handle": h2, "inline_data": b"inline!!"},
                          None))
        steps.append(("a FREE", {"opcode": Opcode.FREE, "handle": fresh}, None))
        for what, values, dd in steps:
            await _two_descriptors(ctx, a, what, values, dd, records)
        await ctx.goodbye(a, release=True)


async def _two_descriptors(ctx: Ctx, a, what: str, values: AnyMessage, dd: MemoryRegion | None,
                           records: bool) -> None:
    """One request of ``invalidate_two_descriptors``, judged."""
    slot = a.memory.register(bytearray([SENTINEL]) * M.COMPLETION_RECORD.size, Access.REMOTE_WRITE)
    flags = RequestFlag.RECORD | RequestFlag.INVALIDATE
    if dd is not None:
        values = {**values, "dd.stag": dd.stag, "dd.offset": 0, "dd.length": dd.length}
    elif "inline_data" in values:
        flags |= RequestFlag.INLINE
    got = await ctx.raw(a, ctx.encode(a, {**values, "flags": flags, "cd.stag": slot.stag, "cd.offset": 0,
                                          "cd.reserved": 0}))
    what = f"{what} with RECORD and INVALIDATE ({'' if records else 'not '}granted RECORD_COMPLETION)"
    ctx.check(bool(got), f"{what}: a completion", "none")
    c, msg = got[0]
    ctx.check(slot.valid, f"{what}: the Completion Descriptor's STag still valid",
              "revoked" + (" (by the Send with Invalidate)" if msg.invalidated == slot.stag else ""))
    if records:
        d = codec.decode_struct(M.COMPLETION_RECORD, bytes(slot.view), a.addr_le)
        ctx.check(msg.write_imm and d["record.status"] == Status.OK, f"{what}: a completion record with "
                  "Status OK", "a Send" if not msg.write_imm else status_name(d["record.status"]))
        return
    ctx.check(c is not None and not msg.write_imm and c["status"] == Status.OK, f"{what}: a COMPLETION OK",
              "something else" if c is None or msg.write_imm else status_name(c["status"]))
    ctx.check(bytes(slot.view) == bytes([SENTINEL]) * len(slot.view),
              f"{what}: the Completion Descriptor's slot untouched", "octets written into it")
    if dd is not None:
        ctx.check(msg.invalidated == dd.stag and not dd.valid,
                  f"{what}: a Send with Invalidate of the Data Descriptor's STag {dd.stag:#010x}",
                  "a plain Send" if msg.invalidated is None else f"STag {msg.invalidated:#x} revoked")
