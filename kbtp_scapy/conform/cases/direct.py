"""Direct Modes: DIRECT_LOAD through read-only STags, DIRECT_ALLOC, BIND, abandoned tickets."""
from __future__ import annotations

import asyncio
from typing import Awaitable

from ...initiator import Initiator, KbtpError
from ...rnic.qp import ConnectionLost, RemoteError
from ...tables.enums import ENTRY_FLAGS, flag
from ...tables.memory import ENTRY_SIZE
from ..context import Ctx
from ..registry import MUST, RULE, case, untestable
from .common import DIRECT_ALLOC, DIRECT_LOAD, bind, data, holds, unbound

SECTION = "Direct Modes"
PARTITION = """a Partition descriptor follows, naming the part of the pool reserved for this
    initiator (Count = its quota) through an STag that grants write access, is specific to this
    connection (for example a memory window bound to it), and covers nothing else"""
REFUSED, ALLOWED = "refused", "allowed"
VALID = flag(ENTRY_FLAGS, "VALID")


async def remote_access(ctx: Ctx, ini: Initiator, access: Awaitable) -> str:
    """Whether a one-sided access is refused: it fails, or the next request on the
    connection fails (a refused Write is reported after the fact, by Terminate or NAK)."""
    try:
        await asyncio.wait_for(access, ctx.timeout)
        await asyncio.wait_for(ini.load(ini.target.handle_base, allow_unsealed=True), ctx.timeout)
    except (RemoteError, ConnectionLost):
        return REFUSED
    except KbtpError:
        return ALLOWED
    except asyncio.TimeoutError:
        return f"no answer within {ctx.timeout:g} s"
    return ALLOWED


def granted(ini: Initiator, key: str) -> tuple[int, int, int]:
    f = ini.target.fields
    return f[f"{key}.stag"], f[f"{key}.offset"], f[f"{key}.count"]


@case("direct.load.entry_and_block", SECTION, RULE, """The entry for handle h is at Table Offset +
      16 * (h - Table Base Handle) within the Table STag. (Direct Load: the initiator RDMA-reads the
      table entry, then the block, then the entry again ... The data is valid if both entry reads
      show the same Generation with VALID and SEALED set)""", features=DIRECT_LOAD)
async def direct_load(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_LOAD)
    h, payload = a.target.handle_base, data(500)
    r = await bind(ctx, a, h, payload)
    status, got = await ctx.outcome(a.direct_load(h))
    ctx.check(status == "OK", "DIRECT_LOAD of a sealed handle: a VALID and SEALED entry", status)
    seen = (got.data == payload, got.generation, hex(got.block_offset), got.data_length)
    ctx.check(seen == (True, r.generation, hex(r.block_offset), len(payload)),
              f"the stored data, Generation {r.generation}, Block Offset {r.block_offset:#x}, "
              f"Data Length {len(payload)}", seen)


@case("direct.load.read_only", "HELLO_ACK", RULE, """then a Pool descriptor (Count = F) that grants
      read access only""", features=DIRECT_LOAD)
async def read_only(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_LOAD)
    h, payload = a.target.handle_base, data(64)
    r = await bind(ctx, a, h, payload)
    pool = granted(a, "pool")[0]
    seen = await remote_access(ctx, a, a.qp.write(pool, r.block_offset, b"overwritten"))
    ctx.check(seen == REFUSED, "an RDMA Write through the Pool STag refused", seen)
    b = await ctx.connect(need=DIRECT_LOAD)
    stag, offset, _ = granted(b, "table")
    seen = await remote_access(ctx, b, b.qp.write(stag, offset, bytes(16)))
    ctx.check(seen == REFUSED, "an RDMA Write through the Table STag refused", seen)
    await holds(ctx, await ctx.reconnect(a), h, payload, "after the refused Writes", r.generation)


@case("direct.alloc.atomics", "RDMAP Binding", MUST, """Targets that advertise DIRECT_ALLOC, and
      targets that execute allocations in their RDMA interface, MUST support the atomic operations
      of .""", features=DIRECT_ALLOC)
async def atomics(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_ALLOC)
    n = granted(a, "ring")[2]
    tickets = [await ctx.wait(a.take_ticket(), "FetchAdd on Head") for _ in range(2)]
    (t1, o1), (t2, o2) = tickets
    ctx.check(t2 == (t1 + 1) & 0xFFFFFFFF, f"consecutive tickets {t1}, {t1 + 1}", (t1, t2))
    ctx.check((o1, o2) == (16 * (t1 % n), 16 * (t2 % n)), "Slot Offsets 16 * (ticket mod N)", (o1, o2))
    h = a.target.handle_base
    for k, (ticket, offset) in enumerate(tickets):
        block = await _slot(ctx, a, ticket, offset)
        await ctx.ok(a.bind(h + k, ticket, 0, block), f"BIND of ticket {ticket}")


async def _slot(ctx: Ctx, a: Initiator, ticket: int, offset: int) -> int:
    try:
        return await ctx.wait(a.wait_slot(ticket, offset, min(ctx.timeout, a.target.ticket_timeout_ms / 2000)))
    except KbtpError:
        ctx.check(False, f"the slot of ticket {ticket} filled with a block", "no block")
        raise


@case("direct.alloc.bind", SECTION, RULE, """the initiator performs FetchAdd on its Head ..., RDMA-reads
      the slot at the returned offset ..., RDMA-writes the data into the block, and then sends BIND
      with the ticket, Data Length, and Block Offset. ... it then marks the slot consumed, writes the
      table entry, and completes.""", features=DIRECT_ALLOC)
async def direct_alloc(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_ALLOC)
    h, payload = a.target.handle_base, data(700)
    r = await ctx.ok(a.direct_alloc(h, payload), "DIRECT_ALLOC and BIND")
    ctx.check(r.data_length == len(payload), f"BIND completion with Data Length {len(payload)}", r.data_length)
    got = await holds(ctx, a, h, payload, "after BIND", r.generation)
    ctx.check(got.block_offset == r.block_offset, f"Block Offset {r.block_offset:#x}", hex(got.block_offset))


@case("direct.bind.verify", SECTION, RULE, """The target verifies that the ticket has not been
      abandoned, that the slot of the ticket holds that Block Offset, and that the initiator is
      within its quota""", features=DIRECT_ALLOC)
async def bind_verify(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_ALLOC)
    h, size = a.target.handle_base, a.target.block_size
    ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
    block = await _slot(ctx, a, ticket, offset)
    for what, t, b in (("another Block Offset", ticket, block + size),
                       ("a ticket not yet taken", ticket + 5, block)):
        status, _ = await ctx.outcome(a.bind(h, t, 0, b))
        ctx.check(status != "OK", f"BIND naming {what} refused", "completed OK")
        if status != "MALFORMED":
            ctx.note(f"BIND naming {what}: {status}; the reference answers MALFORMED")
        await unbound(ctx, a, h, f"after the refused BIND naming {what}")
    await ctx.ok(a.bind(h, ticket, 0, block), "BIND of the ticket's own block")


async def _abandon(ctx: Ctx) -> tuple[Initiator, int, int]:
    """Take a ticket, see its block, and leave it unbound for two Ticket Timeouts."""
    a = await ctx.connect(need=DIRECT_ALLOC)
    wait = 2 * a.target.ticket_timeout_ms / 1000 + 0.3
    if wait + 2 > ctx.timeout:
        ctx.skip(f"the Ticket Timeout ({a.target.ticket_timeout_ms} ms) is too long for --timeout {ctx.timeout:g} s")
    ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
    block = await _slot(ctx, a, ticket, offset)
    await asyncio.sleep(wait)
    return a, ticket, block


@case("direct.ticket.abandoned", "Allocation Quotas", RULE, """A ticket that is not bound by BIND
      within the Ticket Timeout advertised in HELLO_ACK is abandoned. ... [the target] rejects a later
      BIND for that ticket with status TICKET_ABANDONED.""", features=DIRECT_ALLOC)
async def abandoned(ctx: Ctx) -> None:
    a, ticket, block = await _abandon(ctx)
    if a.qp.closed:
        ctx.note("the target terminated the connection to reclaim the ticket")
        a = await ctx.reconnect(a)
    await ctx.expect(a.bind(a.target.handle_base, ticket, 0, block), "TICKET_ABANDONED",
                     "BIND of a ticket left unbound beyond the Ticket Timeout")
    await unbound(ctx, a, a.target.handle_base, "after the refused BIND")


@case("direct.ticket.partition_revoked", "Allocation Quotas", MUST, """Before reclaiming its block,
      the target MUST ensure that no RDMA Write of the initiator can still reach the block, by
      invalidating the initiator's Partition STag (), which disables DIRECT_ALLOC for the rest of the
      session, or by terminating the connection.""", features=DIRECT_ALLOC)
async def partition_revoked(ctx: Ctx) -> None:
    a, ticket, block = await _abandon(ctx)
    if a.qp.closed:
        ctx.note("the target terminated the connection to reclaim the ticket")
        return
    seen = await remote_access(ctx, a, a.qp.write(granted(a, "partition")[0], block, b"late"))
    ctx.check(seen == REFUSED, "an RDMA Write through the Partition STag after the abandonment refused", seen)


@case("direct.head.aligned", "HELLO_ACK", MUST, """a Head descriptor (Count = 1; the Tagged Offset
      MUST be a multiple of 8, as required for FetchAdd)""", features=DIRECT_ALLOC)
async def head_aligned(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_ALLOC)
    _, offset, count = granted(a, "head")
    ctx.check(offset % 8 == 0 and count == 1, "Head Tagged Offset a multiple of 8, Count 1",
              f"offset {offset:#x}, count {count}")


@case("direct.partition.bounds", "HELLO_ACK", RULE, PARTITION, features=DIRECT_ALLOC)
async def partition_bounds(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_ALLOC)
    stag, offset, count = granted(a, "partition")
    ctx.check(count == a.target.quota, f"Partition Count = the quota {a.target.quota}", count)
    end = offset + count * a.target.block_size
    seen = await remote_access(ctx, a, a.qp.write(stag, end, bytes(8)))
    ctx.check(seen == REFUSED, f"an RDMA Write just past the partition ({end:#x}) refused", seen)
    if offset >= 8:
        b = await ctx.connect(need=DIRECT_ALLOC)
        stag, offset, _ = granted(b, "partition")
        seen = await remote_access(ctx, b, b.qp.write(stag, offset - 8, bytes(8)))
        ctx.check(seen == REFUSED, f"an RDMA Write just before the partition ({offset - 8:#x}) refused", seen)


@case("direct.partition.connection", "HELLO_ACK", RULE, PARTITION, features=DIRECT_ALLOC)
async def partition_connection(ctx: Ctx) -> None:
    a = await ctx.connect(need=DIRECT_ALLOC)
    b = await ctx.connect(features=0)
    stag, offset, _ = granted(a, "partition")
    seen = await remote_access(ctx, b, b.qp.write(stag, offset, b"from elsewhere"))
    ctx.check(seen == REFUSED, "a Write through another connection's Partition STag refused", seen)


untestable(SECTION, MUST, "A target MUST offer them only to initiators it trusts for all blocks "
           "reachable through the exposed STags.", "trust is the target's configuration")
untestable("Free-Block Ring", MUST, """If it is not yet consumed, because the allocation that owns it
           has taken its ticket but not yet read it, the target MUST defer the write until the slot
           is consumed; it MUST NOT overwrite the slot.""",
           "needs a race inside the target; the shared ring is not visible to initiators")


@case("direct.load.data_before_valid", "Block Unmapped Store", RULE, """The entry is written after
      the data, so any initiator that observes VALID in the entry also observes the data.""",
      features=DIRECT_LOAD)
async def data_before_valid(ctx: Ctx) -> None:
    """Watch the entries through the Table STag while unmapped stores run: the first read
    that shows VALID must be followed by a block read that shows the stored data."""
    a = await ctx.connect(need=DIRECT_LOAD)
    watcher = await ctx.connect(need=DIRECT_LOAD)
    table, base, _ = granted(watcher, "table")
    pool = granted(watcher, "pool")[0]
    first = watcher.target.fields["table_base_handle"]
    seen: list[str] = []
    for i in range(4):
        h = a.target.handle_base + i
        payload = data(a.target.block_size)
        store = asyncio.ensure_future(a.alloc_store(h, payload, seal=True, inline=False))
        at = base + (h - first) * ENTRY_SIZE
        deadline = asyncio.get_running_loop().time() + ctx.timeout
        while asyncio.get_running_loop().time() < deadline:
            entry = await watcher._entry(table, at)
            if entry["entry.flags"] & VALID:      # the data must be there already
                block = await watcher.qp.read(pool, entry["entry.block_offset"],
                                              entry["entry.data_length"])
                if block != payload:
                    seen.append(f"0x{h:x}: VALID with {sum(x != y for x, y in zip(block, payload))} "
                                f"octets of {len(payload)} not yet stored")
                break
            if store.done():                      # completed before we saw VALID: read once more
                if not (await watcher._entry(table, at))["entry.flags"] & VALID:
                    seen.append(f"0x{h:x}: completed OK but the entry is not VALID")
                    break
        await ctx.ok(asyncio.wait_for(store, ctx.timeout), f"ALLOC_STORE to 0x{h:x} (set-up)")
    ctx.check(not seen, "every entry seen VALID already holds its data", "; ".join(seen))
