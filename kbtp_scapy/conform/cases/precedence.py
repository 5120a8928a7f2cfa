"""Which status wins when a request fails two checks at once.

The text orders the checks: first those every request passes ("It validates every
request before touching memory": the handle's range, the lengths, the Generation), then
the steps of the operation in their numbered order (the entry VALID, not SEALED, ...;
the block allocated from the ring; the data fitting the descriptor). A request failing
two of them completes with the status of the first. Range and lengths are not ordered
against each other by anything in the text beyond the order of a list, and targets
differ there, so that pair is not judged (docs/DECISIONS.md, "Which status wins when a
request fails two checks").
"""
from __future__ import annotations

from ...vocab import Feature
from ..context import Ctx
from ..registry import RULE, case
from .common import bind, data, other_generation, unbound
from .ops import fill_quota, quota_of

VALIDATE_THEN_STEPS = """It validates every request before touching memory: the handle MUST be
    within a range the initiator is authorized for (its own range for stores and frees), lengths
    MUST NOT exceed Block Size or the initiator's buffer, and, if the request Generation is
    non-zero, it MUST equal the entry's. A failed check completes the request with the
    corresponding status and has no other effect."""
FAR = 0xFFFF_FFFF_FFFF_FF00


@case("ops.status.precedence", "Operations", RULE, VALIDATE_THEN_STEPS)
async def precedence(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    b = await ctx.connect(features=0)
    sealed, unsealed, empty, theirs = (*await ctx.handles(a, 3), await ctx.handle(b))
    size = a.target.block_size
    rs = await bind(ctx, a, sealed, data(64), seal=True)
    ru = await bind(ctx, a, unsealed, data(64), seal=False)
    rt = await bind(ctx, b, theirs, data(64), seal=False)
    await bind(ctx, a, empty, b"x")
    gone = await ctx.ok(a.free(empty), "FREE (leaving an unbound entry with a Generation)")
    big = bytes(size + 1)
    pairs = [
        # range before Generation
        (a.load(FAR, generation=7), "INVALID_HANDLE", "LOAD outside every range, with a Generation"),
        (a.store(theirs, b"x", generation=other_generation(rt.generation)), "INVALID_HANDLE",
         "STORE to another initiator's handle with a wrong Generation"),
        (a.free(theirs, generation=other_generation(rt.generation)), "INVALID_HANDLE",
         "FREE of another initiator's handle with a wrong Generation"),
        # Generation (validation) before the operation's own steps
        (a.store(sealed, b"x", generation=other_generation(rs.generation)), "STALE_GENERATION",
         "STORE to a sealed block with a wrong Generation"),
        (a.alloc_store(sealed, b"x", generation=other_generation(rs.generation)), "STALE_GENERATION",
         "ALLOC_STORE to a bound handle with a wrong Generation"),
        (a.load(unsealed, generation=other_generation(ru.generation)), "STALE_GENERATION",
         "LOAD of an unsealed block without ALLOW_UNSEALED, with a wrong Generation"),
        (a.free(empty, generation=other_generation(gone.generation)), "STALE_GENERATION",
         "FREE of an unbound handle with a wrong Generation"),
        (a.store(empty, b"x", generation=other_generation(gone.generation)), "STALE_GENERATION",
         "STORE to an unbound handle with a wrong Generation"),
        (a.load(empty, generation=other_generation(gone.generation), length=1), "STALE_GENERATION",
         "LOAD of an unbound handle into a one-octet buffer with a wrong Generation"),
        # lengths (validation) before the operation's own steps
        (a.store(sealed, big, inline=False), "TOO_LARGE", "STORE larger than Block Size to a sealed block"),
        (a.store(empty, big, inline=False), "TOO_LARGE", "STORE larger than Block Size to an unbound handle"),
        (a.alloc_store(sealed, big, inline=False), "TOO_LARGE",
         "ALLOC_STORE larger than Block Size to a bound handle"),
        # the operation's steps in their order
        (a.load(unsealed, length=8), "NOT_SEALED",
         "LOAD of an unsealed block without ALLOW_UNSEALED into a buffer smaller than its data"),
        (a.load(empty, length=1), "NOT_VALID", "LOAD of an unbound handle into a one-octet buffer"),
    ]
    await ctx.expect_each(pairs)


@case("ops.status.precedence.quota", "Block Unmapped Store", RULE, """1. The handle MUST be in the
      initiator's range and its entry MUST NOT be VALID. 2. The target allocates a block from the
      ring and marks the slot consumed (). (Operations: It validates every request before touching
      memory)""")
async def precedence_quota(ctx: Ctx) -> None:
    """With the whole quota bound, ALLOC_STOREs that also fail a validation or step 1 answer
    that check's status, not NO_SPACE (the quota is step 2's allocation): outside every
    range INVALID_HANDLE, larger than Block Size TOO_LARGE, a wrong Generation
    STALE_GENERATION, a bound handle ALREADY_BOUND; one that fails nothing else is
    NO_SPACE."""
    a = await ctx.connect(features=0)
    q = quota_of(ctx, a, 2)
    spare, *hs = await ctx.handles(a, q + 1)
    await bind(ctx, a, spare, b"x")
    gone = await ctx.ok(a.free(spare), "FREE (leaving an unbound entry with a Generation)")
    await fill_quota(ctx, a, hs, "")
    size = a.target.block_size
    await ctx.expect_each([
        (a.alloc_store(FAR, b"x"), "INVALID_HANDLE", "ALLOC_STORE outside every range, the quota full"),
        (a.alloc_store(spare, bytes(size + 1), inline=False), "TOO_LARGE",
         "ALLOC_STORE larger than Block Size, the quota full"),
        (a.alloc_store(spare, b"x", generation=other_generation(gone.generation)), "STALE_GENERATION",
         "ALLOC_STORE with a wrong Generation, the quota full"),
        (a.alloc_store(hs[0], b"x"), "ALREADY_BOUND", "ALLOC_STORE to a bound handle, the quota full"),
        (a.alloc_store(spare, b"x"), "NO_SPACE", "ALLOC_STORE past the full quota"),
    ])


@case("direct.bind.precedence", "Direct Modes", RULE, """The target verifies that the ticket has not
      been abandoned, that the slot of the ticket holds that Block Offset, and that the initiator is
      within its quota; it then marks the slot consumed, writes the table entry, and completes.
      (Operations: It validates every request before touching memory)""", features=Feature.DIRECT_ALLOC)
async def bind_precedence(ctx: Ctx) -> None:
    """BINDs naming a ticket whose slot does not hold their Block Offset (no ticket was
    taken) that also fail a check every request passes first: outside every range
    INVALID_HANDLE, a Data Length past Block Size TOO_LARGE, a wrong Generation
    STALE_GENERATION; none binds anything."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    h = await ctx.handle(a)
    await bind(ctx, a, h, b"x")
    gone = await ctx.ok(a.free(h), "FREE (leaving an unbound entry with a Generation)")
    ticket, offset = 0x7FFF_0000, gone.block_offset
    await ctx.expect_each([
        (a.bind(FAR, ticket, 8, offset), "INVALID_HANDLE",
         "BIND outside every range, of a ticket never taken"),
        (a.bind(h, ticket, a.target.block_size + 1, offset), "TOO_LARGE",
         "BIND of Data Length Block Size + 1, of a ticket never taken"),
        (a.bind(h, ticket, 8, offset, generation=other_generation(gone.generation)), "STALE_GENERATION",
         "BIND with a wrong Generation, of a ticket never taken"),
    ])
    await unbound(ctx, a, h, "after the refused BINDs")
