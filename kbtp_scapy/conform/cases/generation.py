"""Generation rules: never zero once bound, one step per bind and per unbind."""
from __future__ import annotations

from ..context import Ctx
from ..registry import RULE, case
from .common import bind, data, next_generation

SECTION = "Block Table"


@case("generation.never_zero", SECTION, RULE, "Generation never takes the value zero.")
async def never_zero(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = a.target.handle_base
    seen = []
    for _ in range(3):
        r = await bind(ctx, a, h, data(8))
        seen += [("ALLOC_STORE", r.generation),
                 ("LOAD", (await ctx.ok(a.load(h), "LOAD")).generation),
                 ("FREE", (await ctx.ok(a.free(h), "FREE")).generation)]
    zero = [op for op, g in seen if g == 0]
    ctx.check(not zero, "no completion of a bound or freed entry with Generation 0",
              f"Generation 0 in {', '.join(zero)} (sequence {[g for _, g in seen]})")


@case("generation.next", "Block Unmapped Store", RULE, """It writes the table entry with the Block
      Offset and Data Length, then with VALID, SEALED if requested, and the next Generation
      (incremented by one, skipping zero). (Block Free: increments the Generation (skipping zero))""")
async def increments(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = a.target.handle_base
    g1 = (await bind(ctx, a, h, data(8))).generation
    freed = (await ctx.ok(a.free(h), "FREE")).generation
    ctx.check(freed == next_generation(g1), f"FREE completion with the entry's current Generation "
              f"{next_generation(g1)} (bound at {g1})", freed)
    g3 = (await bind(ctx, a, h, data(8))).generation
    want = next_generation(next_generation(g1))
    ctx.check(g3 == want, f"the rebind at Generation {want} (bind {g1}, free, bind)", g3)
