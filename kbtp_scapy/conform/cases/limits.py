"""Limits, exactly at them and one past: Block Size, the buffer, the handle range, the Ticket Timeout.

Each limit comes from the HELLO_ACK (Block Size, Max Inline, Handle Base and Count,
Ticket Timeout) or from the target's own entry (Data Length against a LOAD's buffer). A
request exactly at a limit must succeed and one octet, one handle or one step past it
must not, so an off-by-one comparison shows on one side or the other.
"""
from __future__ import annotations

import asyncio

from ...initiator import Initiator, KbtpError
from ...vocab import Feature
from ..context import Ctx
from ..pace import TicketWindow
from ..registry import MUST, RULE, case
from .common import data, holds, unbound
from .direct import granted, slot_block
from .ops import fill_quota, quota_of

BOUNDS = """the handle MUST be within a range the initiator is authorized for (its own range for
    stores and frees), lengths MUST NOT exceed Block Size or the initiator's buffer (Block Load:
    Data Length MUST NOT exceed the descriptor Length)"""


@case("ops.limits.lengths", "Operations", MUST, BOUNDS)
async def lengths(ctx: Ctx) -> None:
    """A store of exactly Block Size (and of exactly Max Inline, inline) succeeds, one of
    Block Size + 1 does not; a LOAD into a buffer exactly as long as the data succeeds,
    one into a buffer one octet shorter is TOO_LARGE."""
    a = await ctx.connect(features=0)
    (h, h2), size, inline = await ctx.handles(a, 2), a.target.block_size, a.target.max_inline
    full = data(size)
    await ctx.ok(a.alloc_store(h, full, inline=False), f"ALLOC_STORE of exactly Block Size ({size})")
    got = await ctx.ok(a.load(h, allow_unsealed=True, length=size),
                       f"LOAD of {size} octets into a buffer of exactly {size}")
    ctx.check(got.data == full, f"the {size} octets stored", "other octets")
    await ctx.expect(a.load(h, allow_unsealed=True, length=size - 1), "TOO_LARGE",
                     f"LOAD of {size} octets into a buffer of {size - 1}")
    await ctx.expect(a.store(h, bytes(size + 1), inline=False), "TOO_LARGE",
                     f"STORE of Block Size + 1 ({size + 1}) octets")
    await ctx.expect(a.alloc_store(h2, bytes(size + 1), inline=False), "TOO_LARGE",
                     f"ALLOC_STORE of Block Size + 1 ({size + 1}) octets")
    await unbound(ctx, a, h2, "after the refused ALLOC_STORE")
    if inline:
        exact = data(inline)
        await ctx.ok(a.store(h, exact, inline=True), f"STORE of exactly Max Inline ({inline}) octets inline")
        await holds(ctx, a, h, exact, "after the inline STORE of exactly Max Inline")
    await holds(ctx, a, h, exact if inline else full, "after the refused requests")


@case("ops.limits.range_edges", "Operations", MUST, BOUNDS)
async def range_edges(ctx: Ctx) -> None:
    """The last handle of the range serves every operation; the handles just past either
    end of it are another initiator's or nobody's: stores and frees on them are
    INVALID_HANDLE and change nothing. With DIRECT_LOAD, the table's last handle is
    one to load and the one after it is outside every range."""
    a = await ctx.connect(features=Feature.DIRECT_LOAD)
    base, count = a.target.handle_base, a.target.handle_count
    if "table.stag" in a.target.fields:      # the table's own end, which DIRECT_LOAD tells
        end = a.target.fields["table_base_handle"] + a.target.fields["table.count"]
        await ctx.expect(a.load(end, allow_unsealed=True), "INVALID_HANDLE",
                         f"LOAD of 0x{end:x}, just past the table's last entry")
        status, _ = await ctx.outcome(a.load(end - 1, allow_unsealed=True))
        ctx.check(status in ("OK", "NOT_VALID"), f"LOAD of the table's last handle 0x{end - 1:x}: "
                  "OK or NOT_VALID (a handle any initiator may load)", status)
    last = await ctx.claim(a, base + count - 1)
    payload = data(50)
    r = await ctx.ok(a.alloc_store(last, payload), f"ALLOC_STORE to the last handle 0x{last:x} of the range")
    await ctx.ok(a.store(last, payload, seal=True), "STORE to the last handle")
    await holds(ctx, a, last, payload, "(the last handle of the range)", r.generation)
    for edge in (base + count, base - 1):
        what = f"0x{edge:x}, just {'past' if edge > last else 'before'} the range"
        await ctx.expect(a.alloc_store(edge, b"edge"), "INVALID_HANDLE", f"ALLOC_STORE to {what}")
        await ctx.expect(a.store(edge, b"edge"), "INVALID_HANDLE", f"STORE to {what}")
        await ctx.expect(a.free(edge), "INVALID_HANDLE", f"FREE of {what}")
    await ctx.ok(a.free(last), "FREE of the last handle")
    await unbound(ctx, a, last, "after its FREE")


@case("direct.ticket.within_timeout", "Allocation Quotas", RULE, """A ticket that is not bound by
      BIND within the Ticket Timeout advertised in HELLO_ACK is abandoned.""", features=Feature.DIRECT_ALLOC)
async def within_timeout(ctx: Ctx) -> None:
    """A ticket bound after four tenths of the Ticket Timeout is not abandoned: BIND
    succeeds, and DIRECT_ALLOC goes on working in the session."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    wait = 0.4 * a.target.ticket_timeout_ms / 1000
    if wait + 2 > ctx.timeout:
        ctx.skip(f"the Ticket Timeout ({a.target.ticket_timeout_ms} ms) is too long for --timeout {ctx.timeout:g} s")
    payload = data(64)
    taken = []
    handles = await ctx.handles(a, 2)
    with TicketWindow(a, f"two tickets, their data, {wait * 1000:.0f} ms and their BINDs"):
        for handle in handles:
            ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
            block = await slot_block(ctx, a, ticket, offset)
            await ctx.wait(a.qp.write(granted(a, "partition")[0], block, payload), "the data written")
            taken.append((handle, ticket, block))
        await asyncio.sleep(wait)
        for handle, ticket, block in taken:
            await ctx.ok(a.bind(handle, ticket, len(payload), block),
                         f"BIND of ticket {ticket} {wait * 1000:.0f} ms or more after it was taken "
                         f"(Ticket Timeout {a.target.ticket_timeout_ms} ms)")
    for handle, _, _ in taken:
        await holds(ctx, a, handle, payload, "after BIND within the Ticket Timeout")


FULL_AT_MOST = 64     # sessions opened at most to find the target's limit


async def _still_served(ctx: Ctx, opened: list[Initiator], when: str) -> None:
    """Every session of ``opened`` still answers a request (any status): none was ended,
    its range given to a newcomer, while it was in use."""
    for i, ini in enumerate(opened):
        try:
            await ctx.wait(ini.load(ini.target.handle_base, allow_unsealed=True),
                           f"an answer in session {i + 1} of the {len(opened)} admitted, {when} (no "
                           "session in use is ended to make room: its range is set at session setup)")
        except KbtpError:
            pass                         # refused: still served


@case("session.hello_ack.when_full", "Session Establishment", RULE, """After the RDMA connection is
      established, the initiator sends HELLO and the target answers with HELLO_ACK ... (Status
      reports an error in HELLO_ACK) (Operational Considerations: Quotas and handle ranges are set
      at session setup and changed by reconnecting)""")
async def when_full(ctx: Ctx) -> None:
    """Sessions opened until the target refuses one: the refusal is a HELLO_ACK with a
    non-zero Status (not silence, not a closed connection), the sessions admitted before
    are all still served (none was ended to make room), and once one session ends with
    RELEASE, a HELLO is granted again."""
    opened = []
    for _ in range(FULL_AT_MOST):
        status, ini = await ctx.hello_status(ctx.new_id())
        if ini is None:
            break
        opened.append(ini)
    else:
        await _still_served(ctx, opened, f"after {FULL_AT_MOST} HELLOs")
        ctx.skip(f"the target admitted {FULL_AT_MOST} sessions at once")
    ctx.check(bool(opened), "at least one session granted", f"the first HELLO refused with {status}")
    await _still_served(ctx, opened, f"after a HELLO was refused {status}")
    await ctx.goodbye(opened[-1], release=True)
    status, again = await ctx.hello_status(ctx.new_id())
    ctx.check(again is not None, f"a HELLO granted once one of the {len(opened)} sessions ended with RELEASE",
              f"HELLO_ACK Status {status}")


@case("session.quota.sum", "Allocation Quotas", RULE, """The target assigns each initiator an
      Allocation Quota at session setup and keeps the sum of quotas not larger than F. (Operational
      Considerations: targets reserve free blocks for the sum of quotas)""")
async def quota_sum(ctx: Ctx) -> None:
    """Sessions without direct modes (their allocations all come from one ring) opened until
    the target refuses one, then every quota of them allocated at once: each ALLOC_STORE
    completes OK. A target that admits one session more than its free blocks cover answers
    some of them NO_SPACE, or never."""
    opened: list[Initiator] = []
    for _ in range(FULL_AT_MOST):
        _, ini = await ctx.hello_status(ctx.new_id())
        if ini is None:
            break
        opened.append(ini)
    if not opened:
        ctx.skip("the target admitted no new session")
    if sum(ini.target.quota for ini in opened) > 4096:
        ctx.skip(f"the quotas of the {len(opened)} sessions admitted would take too long to fill")
    wanted = [(ini, await ctx.handles(ini, quota_of(ctx, ini, 0))) for ini in opened]
    await asyncio.gather(*(fill_quota(ctx, ini, hs, f"in session {i + 1} of the {len(opened)} admitted, all "
                                                    "filling their quotas at once")
                           for i, (ini, hs) in enumerate(wanted)))


@case("direct.quota.bind_edge", "Allocation Quotas", RULE, """An initiator's usage is the number of
      handles it has bound plus the number of tickets it has taken and not yet bound. ... If a
      target observes an allocation by an initiator that exceeds its quota, it completes the
      request with NO_SPACE (Direct Modes: The target verifies that the ticket has not been
      abandoned, that the slot of the ticket holds that Block Offset, and that the initiator is
      within its quota)""", features=Feature.DIRECT_ALLOC)
async def bind_edge(ctx: Ctx) -> None:
    """The BIND that brings usage to exactly the quota succeeds: the quota less one filled by
    ALLOC_STORE, then DIRECT_ALLOC and BIND of the last unit (its ticket counted once, not
    again by its own BIND); one ALLOC_STORE more is NO_SPACE; a FREE gives a unit back and
    DIRECT_ALLOC takes it, exactly at the quota again."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    q = quota_of(ctx, a, 1)
    hs = await ctx.handles(a, q + 1)
    await fill_quota(ctx, a, hs[:q - 1], "before the last unit")
    payload = data(64)
    for h, when in ((hs[q - 1], f"after {q - 1} ALLOC_STOREs"), (hs[q], "after a FREE gave one unit back")):
        await ctx.ok(a.direct_alloc(h, payload), f"DIRECT_ALLOC and BIND of the last unit of the quota of "
                     f"{q} {when} (usage exactly the quota)")
        await holds(ctx, a, h, payload, "after the BIND at the quota")
        if h == hs[q - 1]:
            status, _ = await ctx.outcome(a.alloc_store(hs[q], b"over"))
            ctx.check(status == "NO_SPACE", f"the ALLOC_STORE one past the quota of {q}: NO_SPACE", status)
            await ctx.ok(a.free(hs[0]), "FREE within the full quota")
