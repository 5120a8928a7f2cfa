"""Promises and accounting over time: after many operations, reconnections, retention, abandonment.

A HELLO_ACK's values are promises for the whole session, and a retained session's usage
is carried into the next one. A target that keeps them only at the start (credits that
leak a buffer per reconnect, usage counted afresh after a retention, a unit not given
back when a ticket is reclaimed) passes every case that checks them once on a fresh
session; these cases check them again later.
"""
from __future__ import annotations

import asyncio

from ...initiator import Initiator
from ...vocab import Feature
from ..context import Ctx
from ..pace import TicketWindow, fitting, round_trip
from ..registry import RULE, Skip, case
from .common import data, unbound
from .direct import abandon_ticket
from .ops import QUOTA, fill_quota, quota_of
from .session import all_credits_outstanding

PROMISES = """Request Credits of HELLO_ACK: requests an initiator may have outstanding; Block Size;
    Max Inline; Allocation Quota; Handle Base and Handle Count (Quotas and handle ranges are set
    at session setup and changed by reconnecting; an initiator that reconnects with the same
    Initiator ID within that time receives the same handle range and finds its bindings
    intact)"""
CYCLES = 3           # bind/free rounds over the whole quota before the promises are checked


def promised(ini: Initiator) -> tuple:
    t = ini.target
    return (t.request_credits, t.block_size, t.max_inline, t.quota, t.handle_base, t.handle_count)


async def _keeps_promises(ctx: Ctx, a: Initiator, hs: list[int], when: str) -> None:
    """The quota (its last block of exactly Block Size), Max Inline and the Request
    Credits, each used to the full."""
    q, size, inline = a.target.quota, a.target.block_size, a.target.max_inline
    await fill_quota(ctx, a, hs[:q - 1], when)
    await ctx.ok(a.alloc_store(hs[q - 1], data(size), inline=False),
                 f"ALLOC_STORE of exactly Block Size, the last of the quota, {when}")
    status, _ = await ctx.outcome(a.alloc_store(hs[q], b"one too many"))
    ctx.check(status == "NO_SPACE", f"the allocation beyond the quota {when}: NO_SPACE", status)
    if inline:
        await ctx.ok(a.store(hs[q - 1], data(inline), inline=True),
                     f"inline STORE of exactly Max Inline {when}")
    freed = await asyncio.gather(*(ctx.outcome(a.free(h)) for h in hs[:q]))
    ctx.check(all(s == "OK" for s, _ in freed), f"FREE of the {q} blocks {when}", [s for s, _ in freed])
    await all_credits_outstanding(ctx, a, f" {when}")


@case("session.promises.late", "HELLO_ACK", RULE, PROMISES)
async def promises_late(ctx: Ctx) -> None:
    """The quota filled and emptied several times; then every promise used to the full;
    then after GOODBYE without RELEASE, and after a lost connection, the same HELLO_ACK
    values and the same promises again."""
    a = await ctx.connect(features=0, credits=32)
    q = quota_of(ctx, a, 7)      # q + 1 handles, and 2 for each look at the credits
    hs = await ctx.handles(a, q + 1)
    first = promised(a)
    for cycle in range(CYCLES):
        await fill_quota(ctx, a, hs[:q], f"(round {cycle + 1})")
        freed = await asyncio.gather(*(ctx.outcome(a.free(h)) for h in hs[:q]))
        ctx.check(all(s == "OK" for s, _ in freed), f"FREE of the {q} blocks (round {cycle + 1})",
                  [s for s, _ in freed])
    await _keeps_promises(ctx, a, hs, f"after {CYCLES * q * 2} operations")
    for how in ("GOODBYE without RELEASE", "a lost connection"):
        if how.startswith("GOODBYE"):
            await ctx.goodbye(a, release=False)
        else:
            await a.close()
        a = await ctx.reconnect(a)
        ctx.check(promised(a) == first, f"the same Request Credits, Block Size, Max Inline, quota and "
                  f"handle range after {how}", f"{promised(a)} (first {first})")
        await _keeps_promises(ctx, a, hs, f"after {how}")


@case("ops.quota.carried", "Allocation Quotas", RULE, f"""{QUOTA} (An initiator's usage is the
      number of handles it has bound plus the number of tickets it has taken and not yet bound.
      GOODBYE ... Otherwise, and when a connection fails, the target keeps the initiator's
      bindings)""")
async def quota_carried(ctx: Ctx) -> None:
    """Half the quota bound, then GOODBYE without RELEASE: the reconnected session may
    bind only the other half. After a lost connection the quota is still full, and a
    FREE of a block bound two sessions ago gives one unit back. (RELEASE, which empties
    it, is session.goodbye.release's.)"""
    a = await ctx.connect(features=0)
    q = quota_of(ctx, a, 1)
    if q < 2:
        ctx.skip("a quota of one block cannot be split across sessions")
    hs = await ctx.handles(a, q + 1)
    half = q // 2
    await fill_quota(ctx, a, hs[:half], "")
    await ctx.goodbye(a, release=False)
    b = await ctx.reconnect(a)
    await fill_quota(ctx, b, hs[half:q], f"(the {q - half} left after {half} were bound before a "
                      "GOODBYE without RELEASE)")
    status, _ = await ctx.outcome(b.alloc_store(hs[q], b"over"))
    ctx.check(status == "NO_SPACE", f"the allocation beyond the quota, {half} of whose blocks were bound "
              "before the reconnection: NO_SPACE", status)
    await b.close()
    c = await ctx.reconnect(b)
    status, _ = await ctx.outcome(c.alloc_store(hs[q], b"over"))
    ctx.check(status == "NO_SPACE", "the allocation beyond the full quota after a lost connection: "
              "NO_SPACE", status)
    await ctx.ok(c.free(hs[0]), "FREE of a block bound in an earlier session")
    await ctx.ok(c.alloc_store(hs[q], b"fits"), "ALLOC_STORE after a FREE of a block of an earlier session")


@case("direct.ticket.reclaimed_unit", "Allocation Quotas", RULE, """the target releases one unit of
      usage when a FREE completes or when an abandoned ticket is reclaimed. ... It then consumes the
      slot, returns the block to the ring with a new ticket""", features=Feature.DIRECT_ALLOC)
async def reclaimed_unit(ctx: Ctx) -> None:
    """After a ticket is abandoned and reclaimed, the session's whole quota can be
    allocated again (its block back in the ring, its unit of usage released), and no
    more."""
    a, _, _ = await abandon_ticket(ctx)
    if a.qp.closed:
        ctx.note("the target terminated the connection to reclaim the ticket")
        a = await ctx.reconnect(a)
    q = quota_of(ctx, a, 1)
    hs = await ctx.handles(a, q + 1)
    await fill_quota(ctx, a, hs[:q], "after an abandoned ticket was reclaimed")
    status, _ = await ctx.outcome(a.alloc_store(hs[q], b"over"))
    ctx.check(status == "NO_SPACE", "the allocation beyond the quota after the reclaim: NO_SPACE", status)


@case("direct.quota.tickets", "Allocation Quotas", RULE, """An initiator's usage is the number of
      handles it has bound plus the number of tickets it has taken and not yet bound. ... If a
      target observes an allocation by an initiator that exceeds its quota, it completes the
      request with NO_SPACE and MAY terminate the session.""", features=Feature.DIRECT_ALLOC)
async def quota_tickets(ctx: Ctx) -> None:
    """Tickets taken by FetchAdd and not bound count as usage: with the quota's last k
    units taken so (the others bound by ALLOC_STORE), an ALLOC_STORE completes NO_SPACE;
    with one ticket more taken past the quota (the RNIC executes any FetchAdd on Head, so
    a misbehaving initiator can), usage is above the quota and an ALLOC_STORE must still
    complete NO_SPACE. Both before the Ticket Timeout can abandon any of the tickets: k
    is as many as the checker's pace lets it take in a quarter of the Timeout (the whole
    quota on an idle host). A verdict that came too late to be sure no ticket expired is
    tried again on a fresh session, k no more than the pace the tickets went at allows and
    at most half the last try's (at least one); a SKIP when the last try is too late as
    well (``pace``)."""
    most = 0                 # tickets the last try may take: at most half as many next time
    for attempt in range(1, ATTEMPTS + 1):
        a = await ctx.connect(need=Feature.DIRECT_ALLOC)
        q = quota_of(ctx, a, 1)
        pace = await ctx.wait(round_trip(a), "RDMA Reads of the ring (the checker's pace)")
        k = min(q, fitting(a, pace) - 1, max(1, most // 2) if most else q)
        if k < 1:
            ctx.skip(f"the checker's pace ({pace * 1000:.0f} ms a round trip) leaves no room for two "
                     f"tickets in a quarter of the Ticket Timeout ({a.target.ticket_timeout_ms} ms)")
        try:
            return await _tickets_counted(ctx, a, q, k)
        except TooSlow as slow:
            if attempt == ATTEMPTS:
                raise Skip(f"{slow} (try {attempt} of {ATTEMPTS})") from None
            most = max(1, min(k, fitting(a, slow.pace) - 1))


ATTEMPTS = 3          # sessions direct.quota.tickets tries before it is too slow to judge


class TooSlow(Skip):
    """The tickets went too slowly to judge, at ``pace`` seconds each."""

    def __init__(self, reason: str, pace: float) -> None:
        super().__init__(reason)
        self.pace = pace


async def _tickets_counted(ctx: Ctx, a: Initiator, q: int, k: int) -> None:
    hs = await ctx.handles(a, q - k + 1)
    await fill_quota(ctx, a, hs[:q - k], f"(the {q - k} units of the quota not taken as tickets)")
    h, taken = hs[-1], 0
    window = TicketWindow(a, f"taking {k + 1} tickets and the ALLOC_STOREs that judge them")
    try:
        with window:
            for extra, where in ((0, "at the quota"), (1, "one past the quota")):
                while taken < k + extra:
                    await ctx.wait(a.take_ticket(), "FetchAdd on Head")
                    taken += 1
                try:
                    status, _ = await ctx.outcome(a.alloc_store(h, b"past the quota"))
                except Exception as exc:   # the text allows terminating the session
                    if not a.qp.closed:
                        raise
                    ctx.note(f"the target terminated the session on the allocation {where} ({exc})")
                    return
                ctx.check(status == "NO_SPACE", f"ALLOC_STORE with {taken} tickets taken by FetchAdd "
                          f"and not bound and {q - k} handles bound (usage {where}, the quota {q}): "
                          "NO_SPACE", status)
    except Skip as skipped:
        raise TooSlow(str(skipped), window.elapsed() / max(taken, 1)) from None   # a pace on the safe side
    await unbound(ctx, a, h, "after the ALLOC_STOREs refused for the quota")


@case("direct.quota.bound_ticket", "Allocation Quotas", RULE, """An initiator's usage is the number of
      handles it has bound plus the number of tickets it has taken and not yet bound.""",
      features=Feature.DIRECT_ALLOC)
async def quota_bound_ticket(ctx: Ctx) -> None:
    """A ticket counts once: BIND turns it into a bound handle, no longer a ticket. After
    one DIRECT_ALLOC and BIND, ALLOC_STOREs fill the rest of the quota, each OK, and one
    more is NO_SPACE."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    q = quota_of(ctx, a, 1)
    hs = await ctx.handles(a, q + 1)
    with TicketWindow(a, "DIRECT_ALLOC"):
        await ctx.ok(a.direct_alloc(hs[0], b"ticket"), "DIRECT_ALLOC and BIND")
    await fill_quota(ctx, a, hs[1:q], "after one handle bound by BIND")
    status, _ = await ctx.outcome(a.alloc_store(hs[q], b"over"))
    ctx.check(status == "NO_SPACE", f"the ALLOC_STORE past the quota of {q} (one handle bound by BIND, "
              f"{q - 1} by ALLOC_STORE): NO_SPACE", status)
