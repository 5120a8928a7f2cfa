"""Generation rules: never zero once bound, one step per bind and per unbind."""
from __future__ import annotations

from ... import codec
from ...initiator import Initiator
from ...rnic import Access
from ...vocab import AnyMessage, Opcode
from ..context import Ctx, status_name
from ..registry import MUST, RULE, case
from .common import bind, data, next_generation

VALIDATE_GENERATION = """if the request Generation is non-zero, it MUST equal the entry's. (Generation: A
    16-bit counter of a table entry that changes whenever the handle is bound or unbound)"""

SECTION = "Block Table"
CYCLES = 65536       # bind/free cycles at most: two Generation steps each, so a wrap twice over
WRAPPED = 0xFFFF


def cycling(a: Initiator) -> tuple[int, AnyMessage]:
    """ALLOC_STORE/FREE pairs per round (every credit in use) and the store's data fields
    (one inline octet, or one read from a buffer when the target takes no inline data)."""
    pairs = max(1, min(a.target.request_credits, a.completion_credits) // 2)
    if a.target.max_inline:
        return pairs, {"inline_data": b"g"}
    source = a.memory.register(bytearray(b"g"), Access.REMOTE_READ)
    return pairs, {"dd.stag": source.stag, "dd.offset": 0, "dd.length": 1}


async def bind_free_round(ctx: Ctx, a: Initiator, h: int, store: AnyMessage, pairs: int,
                          cycles: int) -> list[tuple[str, int, AnyMessage]]:
    """``pairs`` ALLOC_STOREs and FREEs of ``h`` pipelined, cycles ``cycles`` on: each
    (opcode name, cycle, COMPLETION) in request order, every one checked OK."""
    ops: dict[int, tuple[str, int]] = {}
    messages = []
    for cycle in range(cycles, cycles + pairs):
        free: AnyMessage = {}
        for op, values in (("ALLOC_STORE", store), ("FREE", free)):
            rid = ctx.rid()
            ops[rid] = (op, cycle)
            messages.append(codec.encode({"opcode": Opcode[op], "request_id": rid, "handle": h, **values},
                                         a.addr_le))
    ctx.send(a, messages)
    got = await ctx.collect(a, len(messages))
    ctx.check(len(got) == len(messages) and None not in got,
              f"{len(messages)} COMPLETIONs of pipelined ALLOC_STOREs and FREEs of 0x{h:x}",
              f"{sum(c is not None for c in got)}")
    done = []
    for c in sorted((c for c in got if c is not None), key=lambda c: c["request_id"]):   # all: checked
        op, cycle = ops.get(c["request_id"], ("?", cycles + pairs))
        ctx.check(c["status"] == 0, f"{op} of cycle {cycle + 1} completed OK", status_name(c["status"]))
        done.append((op, cycle, c))
    return done


@case("generation.never_zero", SECTION, RULE, """Generation never takes the value zero. (Block
      Unmapped Store: the next Generation (incremented by one, skipping zero))""",
      slow="up to 65,536 bind/free cycles of one handle, until its Generation wraps",
      budget=900)
async def never_zero(ctx: Ctx) -> None:
    """Bind and free one handle, pipelined with every credit in use, until its Generation
    has gone past 65535 (at most 32,768 cycles when each bind and each free steps it): no
    completion may show 0, and the step from 65535 must be to 1."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    pairs, store = cycling(a)
    last, first, cycles, wrapped = None, None, 0, False
    while cycles < CYCLES and not wrapped:
        for op, cycle, c in await bind_free_round(ctx, a, h, store, pairs, cycles):
            g = c["generation"]
            ctx.check(g != 0, "no completion of a bound or freed entry with Generation 0",
                      f"Generation 0 in the {op} completion of cycle {cycle + 1} (after {last})")
            if last is not None and g < last:
                ctx.check(last == WRAPPED and g == 1, "Generation 1 after 65535 (skipping zero)",
                          f"{last} then {g} ({op} of cycle {cycle + 1})")
                wrapped = True
            first = g if first is None else first
            last = g
        cycles += pairs
    if not wrapped:
        ctx.note(f"the Generation did not wrap within {cycles} bind/free cycles "
                 f"(from {first} to {last})")


@case("generation.next", "Block Unmapped Store", RULE, """It writes the table entry with the Block
      Offset and Data Length, then with VALID, SEALED if requested, and the next Generation
      (incremented by one, skipping zero). (Block Free: increments the Generation (skipping zero))""")
async def increments(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    g1 = (await bind(ctx, a, h, data(8))).generation
    freed = (await ctx.ok(a.free(h), "FREE")).generation
    ctx.check(freed == next_generation(g1), f"FREE completion with the entry's current Generation "
              f"{next_generation(g1)} (bound at {g1})", freed)
    g3 = (await bind(ctx, a, h, data(8))).generation
    want = next_generation(next_generation(g1))
    ctx.check(g3 == want, f"the rebind at Generation {want} (bind {g1}, free, bind)", g3)


@case("ops.generation.full_width", "Operations", MUST, VALIDATE_GENERATION)
async def full_width(ctx: Ctx) -> None:
    """A handle bound and freed until its Generation needs the upper octet, then bound:
    LOAD, STORE and FREE carrying exactly that Generation are executed, and a LOAD whose
    Generation differs from it in the upper octet only is STALE_GENERATION."""
    a = await ctx.connect(features=0)
    h = await ctx.handle(a)
    pairs, store = cycling(a)
    g, cycles = 0, 0
    while g < 0x100 and cycles < 0x100:     # 128 cycles from 0; 256 whatever the start
        g = (await bind_free_round(ctx, a, h, store, pairs, cycles))[-1][2]["generation"]
        cycles += pairs
    payload = data(32)
    r = await bind(ctx, a, h, payload, seal=False)
    if r.generation < 0x100:
        ctx.skip(f"the Generation of 0x{h:x} stayed below 0x100 over {cycles} bind/free cycles")
    wrong = r.generation ^ (0x0100 if r.generation != 0x0100 else 0x0200)   # non-zero
    await ctx.expect(a.load(h, generation=wrong, allow_unsealed=True), "STALE_GENERATION",
                     f"LOAD with Generation {wrong:#06x} (entry has {r.generation:#06x})")
    await ctx.ok(a.load(h, generation=r.generation, allow_unsealed=True),
                 f"LOAD with the entry's Generation {r.generation:#06x}")
    await ctx.ok(a.store(h, b"same", generation=r.generation),
                 f"STORE with the entry's Generation {r.generation:#06x}")
    await ctx.ok(a.free(h, generation=r.generation), f"FREE with the entry's Generation {r.generation:#06x}")
