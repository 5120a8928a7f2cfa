"""Direct Modes: DIRECT_LOAD through read-only STags, DIRECT_ALLOC, BIND, abandoned tickets."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from ... import codec
from ...initiator import Initiator, KbtpError
from ...initiator.direct import ABANDONED_AFTER
from ...rnic.qp import ConnectionLost, RemoteError
from ...tables.memory import RING_SLOT, SLOT_CONSUMED, SLOT_SIZE
from ...vocab import EntryFlag, Feature
from ..context import Ctx
from ..hold import SETTLE
from ..pace import TicketWindow
from ..registry import MUST, MUST_NOT, RULE, case, untestable
from .common import (
    bind,
    data,
    entry_of,
    holds,
    unbound,
)

SECTION = "Direct Modes"
PARTITION = """a Partition descriptor follows, naming the part of the pool reserved for this
    initiator (Count = its quota) through an STag that grants write access, is specific to this
    connection (for example a memory window bound to it), and covers nothing else"""
REFUSED, ALLOWED = "refused", "allowed"


async def remote_access(ctx: Ctx, ini: Initiator, access: Awaitable) -> str:
    """Whether a one-sided access is refused: it fails, or the next request on the
    connection fails (a refused Write is reported after the fact, by Terminate or NAK).
    The LOAD that follows binds nothing, so any handle of the range serves."""
    try:
        await asyncio.wait_for(access, ctx.timeout)
        await asyncio.wait_for(ini.load(ini.target.handle_base, allow_unsealed=True), ctx.timeout)
    except (RemoteError, ConnectionLost):
        return REFUSED
    except KbtpError:
        return ALLOWED
    except TimeoutError:
        return f"no answer within {ctx.timeout:g} s"
    return ALLOWED


def granted(ini: Initiator, key: str) -> tuple[int, int, int]:
    f = ini.target.fields
    return f[f"{key}.stag"], f[f"{key}.offset"], f[f"{key}.count"]


@case("direct.load.entry_and_block", SECTION, RULE, """The entry for handle h is at Table Offset +
      16 * (h - Table Base Handle) within the Table STag. (Direct Load: the initiator RDMA-reads the
      table entry, then the block, then the entry again ... The data is valid if both entry reads
      show the same Generation with VALID and SEALED set)""", features=Feature.DIRECT_LOAD)
async def direct_load(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_LOAD)
    h, payload = await ctx.handle(a), data(500)
    r = await bind(ctx, a, h, payload)
    status, got = await ctx.outcome(a.direct_load(h))
    ctx.check(status == "OK", "DIRECT_LOAD of a sealed handle: a VALID and SEALED entry", status)
    assert got is not None                   # OK carries its Result
    seen = (got.data == payload, got.generation, hex(got.block_offset), got.data_length)
    ctx.check(seen == (True, r.generation, hex(r.block_offset), len(payload)),
              f"the stored data, Generation {r.generation}, Block Offset {r.block_offset:#x}, "
              f"Data Length {len(payload)}", seen)


@case("direct.load.read_only", "HELLO_ACK", RULE, """then a Pool descriptor (Count = F) that grants
      read access only""", features=Feature.DIRECT_LOAD)
async def read_only(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_LOAD)
    h, payload = await ctx.handle(a), data(64)
    r = await bind(ctx, a, h, payload)
    pool = granted(a, "pool")[0]
    seen = await remote_access(ctx, a, a.qp.write(pool, r.block_offset, b"overwritten"))
    ctx.check(seen == REFUSED, "an RDMA Write through the Pool STag refused", seen)
    b = await ctx.connect(need=Feature.DIRECT_LOAD)
    stag, offset, _ = granted(b, "table")
    seen = await remote_access(ctx, b, b.qp.write(stag, offset, bytes(16)))
    ctx.check(seen == REFUSED, "an RDMA Write through the Table STag refused", seen)
    await holds(ctx, await ctx.reconnect(a), h, payload, "after the refused Writes", r.generation)


@case("direct.alloc.atomics", "RDMAP Binding", MUST, """Targets that advertise DIRECT_ALLOC, and
      targets that execute allocations in their RDMA interface, MUST support the atomic operations
      of .""", features=Feature.DIRECT_ALLOC)
async def atomics(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    n = granted(a, "ring")[2]
    hs = await ctx.handles(a, 2)
    with TicketWindow(a, "taking two tickets and binding them"):
        tickets = [await ctx.wait(a.take_ticket(), "FetchAdd on Head") for _ in range(2)]
        for h, (ticket, offset) in zip(hs, tickets):
            block = await slot_block(ctx, a, ticket, offset)
            await ctx.ok(a.bind(h, ticket, 0, block), f"BIND of ticket {ticket}")
    (t1, o1), (t2, o2) = tickets             # judged whatever the pace
    ctx.check(t2 == (t1 + 1) & 0xFFFFFFFF, f"consecutive tickets {t1}, {t1 + 1}", (t1, t2))
    ctx.check((o1, o2) == (16 * (t1 % n), 16 * (t2 % n)), "Slot Offsets 16 * (ticket mod N)", (o1, o2))


async def slot_block(ctx: Ctx, a: Initiator, ticket: int, offset: int) -> int:
    try:
        return await ctx.wait(a.wait_slot(ticket, offset, min(ctx.timeout, a.target.ticket_timeout_ms / 2000)))
    except KbtpError:
        ctx.check(False, f"the slot of ticket {ticket} filled with a block", "no block")
        raise


@case("direct.alloc.bind", SECTION, RULE, """the initiator performs FetchAdd on its Head ..., RDMA-reads
      the slot at the returned offset ..., RDMA-writes the data into the block, and then sends BIND
      with the ticket, Data Length, and Block Offset. ... it then marks the slot consumed, writes the
      table entry, and completes.""", features=Feature.DIRECT_ALLOC)
async def direct_alloc(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    h, payload = await ctx.handle(a), data(700)
    with TicketWindow(a, "DIRECT_ALLOC"):
        r = await ctx.ok(a.direct_alloc(h, payload), "DIRECT_ALLOC and BIND")
    ctx.check(r.data_length == len(payload), f"BIND completion with Data Length {len(payload)}", r.data_length)
    got = await holds(ctx, a, h, payload, "after BIND", r.generation)
    ctx.check(got.block_offset == r.block_offset, f"Block Offset {r.block_offset:#x}", hex(got.block_offset))


@case("direct.bind.verify", SECTION, RULE, """The target verifies that the ticket has not been
      abandoned, that the slot of the ticket holds that Block Offset, and that the initiator is
      within its quota""", features=Feature.DIRECT_ALLOC)
async def bind_verify(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    h, size = await ctx.handle(a), a.target.block_size
    with TicketWindow(a, "a ticket, two refused BINDs and the BIND of its own block"):
        ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
        block = await slot_block(ctx, a, ticket, offset)
        for what, t, b in (("another Block Offset", ticket, block + size),
                           ("a ticket not yet taken", ticket + 5, block)):
            status, _ = await ctx.outcome(a.bind(h, t, 0, b))
            ctx.check(status != "OK", f"BIND naming {what} refused", "completed OK")
            if status != "MALFORMED":
                ctx.note(f"BIND naming {what}: {status}; the reference answers MALFORMED")
            await unbound(ctx, a, h, f"after the refused BIND naming {what}")
        await ctx.ok(a.bind(h, ticket, 0, block), "BIND of the ticket's own block")


async def abandon_ticket(ctx: Ctx) -> tuple[Initiator, int, int]:
    """Take a ticket, see its block, and leave it unbound until it is surely abandoned."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    wait = ABANDONED_AFTER * a.target.ticket_timeout_ms / 1000 + 0.3
    if wait + 2 > ctx.timeout:
        ctx.skip(f"the Ticket Timeout ({a.target.ticket_timeout_ms} ms) is too long for --timeout {ctx.timeout:g} s")
    ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
    block = await slot_block(ctx, a, ticket, offset)
    await asyncio.sleep(wait)
    return a, ticket, block


@case("direct.ticket.abandoned", "Allocation Quotas", RULE, """A ticket that is not bound by BIND
      within the Ticket Timeout advertised in HELLO_ACK is abandoned. ... [the target] rejects a later
      BIND for that ticket with status TICKET_ABANDONED.""", features=Feature.DIRECT_ALLOC)
async def abandoned(ctx: Ctx) -> None:
    a, ticket, block = await abandon_ticket(ctx)
    if a.qp.closed:
        ctx.note("the target terminated the connection to reclaim the ticket")
        a = await ctx.reconnect(a)
    h = await ctx.handle(a)
    await ctx.expect(a.bind(h, ticket, 0, block), "TICKET_ABANDONED",
                     "BIND of a ticket left unbound beyond the Ticket Timeout")
    await unbound(ctx, a, h, "after the refused BIND")


@case("direct.ticket.partition_revoked", "Allocation Quotas", MUST, """Before reclaiming its block,
      the target MUST ensure that no RDMA Write of the initiator can still reach the block, by
      invalidating the initiator's Partition STag (), which disables DIRECT_ALLOC for the rest of the
      session, or by terminating the connection.""", features=Feature.DIRECT_ALLOC)
async def partition_revoked(ctx: Ctx) -> None:
    a, ticket, block = await abandon_ticket(ctx)
    if a.qp.closed:
        ctx.note("the target terminated the connection to reclaim the ticket")
        return
    seen = await remote_access(ctx, a, a.qp.write(granted(a, "partition")[0], block, b"late"))
    ctx.check(seen == REFUSED, "an RDMA Write through the Partition STag after the abandonment refused", seen)


@case("direct.head.aligned", "HELLO_ACK", MUST, """a Head descriptor (Count = 1; the Tagged Offset
      MUST be a multiple of 8, as required for FetchAdd)""", features=Feature.DIRECT_ALLOC)
async def head_aligned(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    _, offset, count = granted(a, "head")
    ctx.check(offset % 8 == 0 and count == 1, "Head Tagged Offset a multiple of 8, Count 1",
              f"offset {offset:#x}, count {count}")


@case("direct.partition.bounds", "HELLO_ACK", RULE, PARTITION, features=Feature.DIRECT_ALLOC)
async def partition_bounds(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    stag, offset, count = granted(a, "partition")
    ctx.check(count == a.target.quota, f"Partition Count = the quota {a.target.quota}", count)
    end = offset + count * a.target.block_size
    seen = await remote_access(ctx, a, a.qp.write(stag, end, bytes(8)))
    ctx.check(seen == REFUSED, f"an RDMA Write just past the partition ({end:#x}) refused", seen)
    if offset >= 8:
        b = await ctx.connect(need=Feature.DIRECT_ALLOC)
        stag, offset, _ = granted(b, "partition")
        seen = await remote_access(ctx, b, b.qp.write(stag, offset - 8, bytes(8)))
        ctx.check(seen == REFUSED, f"an RDMA Write just before the partition ({offset - 8:#x}) refused", seen)


@case("direct.partition.connection", "HELLO_ACK", RULE, PARTITION, features=Feature.DIRECT_ALLOC)
async def partition_connection(ctx: Ctx) -> None:
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    b = await ctx.connect(features=0)
    stag, offset, _ = granted(a, "partition")
    seen = await remote_access(ctx, b, b.qp.write(stag, offset, b"from elsewhere"))
    ctx.check(seen == REFUSED, "a Write through another connection's Partition STag refused", seen)


untestable(SECTION, MUST, "A target MUST offer them only to initiators it trusts for all blocks "
           "reachable through the exposed STags.", "trust is the target's configuration")


@case("direct.load.data_before_valid", "Block Unmapped Store", RULE, """The entry is written after
      the data, so any initiator that observes VALID in the entry also observes the data.""",
      features=Feature.DIRECT_LOAD)
async def data_before_valid(ctx: Ctx) -> None:
    """Unmapped stores whose data the target must RDMA-read, watched through the Table
    STag. While the checker holds its Read Response back, the target cannot have the data,
    so the entry must not show VALID, however long the checker looks; after the release,
    the first read that shows VALID must be followed by a block read with the data."""
    a = await ctx.connect(need=Feature.DIRECT_LOAD)
    watcher = await ctx.connect(need=Feature.DIRECT_LOAD)
    pool = granted(watcher, "pool")[0]
    hold = ctx.hold_reads(a)
    seen: list[str] = []
    for h in await ctx.handles(a, 2):
        payload = data(a.target.block_size)
        hold.hold()
        store = asyncio.ensure_future(a.alloc_store(h, payload, seal=True, inline=False))
        # a case that ends early (a FAIL, the target gone) leaves it: its error is the case's
        store.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            if not await hold.wait_requested(ctx.timeout):
                ctx.check(False, "an RDMA Read of the data of a non-inline ALLOC_STORE",
                          f"none within {ctx.timeout:g} s")
            for _ in range(2):
                entry = await ctx.wait(entry_of(watcher, h), "an RDMA Read of the entry")
                if entry["entry.flags"] & EntryFlag.VALID:
                    block = await ctx.wait(watcher.qp.read(pool, entry["entry.block_offset"],
                                                           entry["entry.data_length"]), "a block read")
                    seen.append(f"0x{h:x}: VALID while its data was still being read (the checker "
                                f"held the RDMA Read Response), the block showing "
                                f"{sum(x != y for x, y in zip(block, payload))} of {len(payload)} "
                                "octets other than the data")
                    break
                await asyncio.sleep(SETTLE / 2)
        finally:
            hold.release()
        seen += await _watch_entry(ctx, watcher, h, payload, store)
        await ctx.setup(asyncio.wait_for(store, ctx.timeout), f"ALLOC_STORE to 0x{h:x}")
    ctx.check(not seen, "every entry seen VALID already holds its data", "; ".join(seen))


async def _watch_entry(ctx: Ctx, watcher: Initiator, h: int, payload: bytes,
                       store: asyncio.Future) -> list[str]:
    """Read the entry until it shows VALID, then the block: it must hold ``payload``."""
    pool = granted(watcher, "pool")[0]
    deadline = asyncio.get_running_loop().time() + ctx.timeout
    while asyncio.get_running_loop().time() < deadline:
        entry = await ctx.wait(entry_of(watcher, h), "an RDMA Read of the entry")
        if entry["entry.flags"] & EntryFlag.VALID:           # the data must be there already
            block = await ctx.wait(watcher.qp.read(pool, entry["entry.block_offset"],
                                                   entry["entry.data_length"]), "a block read")
            if block != payload:
                return [f"0x{h:x}: VALID with {sum(x != y for x, y in zip(block, payload))} octets "
                        f"of {len(payload)} not yet stored"]
            return []
        if store.done():                           # completed before we saw VALID: once more
            if not (await ctx.wait(entry_of(watcher, h), "an RDMA Read of the entry"))["entry.flags"] & EntryFlag.VALID:
                return [f"0x{h:x}: completed OK but the entry is not VALID"]
            return []
    return []


# -- the free-block ring ----------------------------------------------------------------------

RING_LIMIT = 4096     # slots: a ring larger than this is not read whole


async def read_ring(ctx: Ctx, a: Initiator) -> list[tuple[int, int]]:
    """Every slot of the session's ring, through the Ring STag: (Sequence, Block Offset)."""
    stag, offset, n = granted(a, "ring")
    raw = await ctx.wait(a.qp.read(stag, offset, n * SLOT_SIZE), "an RDMA Read of the ring")
    return [_slot_fields(a, raw[i * SLOT_SIZE:(i + 1) * SLOT_SIZE]) for i in range(n)]


async def read_slot(ctx: Ctx, a: Initiator, ticket: int) -> tuple[int, int]:
    stag, offset, n = granted(a, "ring")
    raw = await ctx.wait(a.qp.read(stag, offset + SLOT_SIZE * (ticket % n), SLOT_SIZE),
                         f"an RDMA Read of the slot of ticket {ticket}")
    return _slot_fields(a, raw)


def _slot_fields(a: Initiator, raw: bytes) -> tuple[int, int]:
    d = codec.decode_struct(RING_SLOT, raw, a.addr_le)
    return d["slot.sequence"], d["slot.block_offset"]


def _ring_session_checks(ctx: Ctx, a: Initiator) -> tuple[int, int]:
    """(N, quota) of the session's ring, skipping rings too large to read whole."""
    n, q = granted(a, "ring")[2], a.target.quota
    if n > RING_LIMIT:
        ctx.skip(f"a ring of {n} slots is too large to go round in a case")
    ctx.check(n >= q and n & (n - 1) == 0, f"a Ring Count N that is a power of two not smaller "
              f"than the quota {q}", n)
    return n, q


def _in_partition(a: Initiator, block: int) -> bool:
    _, start, count = granted(a, "partition")
    size = a.target.block_size
    return start <= block < start + count * size and (block - start) % size == 0


RING = """Each counter holds ... the Slot Offset, the byte offset of the current slot (16 times the
    slot number) ... wrapping at the end of the ring. Initialization: for s < F the target writes
    slot s = {Sequence s, Block Offset of the s-th free block}; for F <= s < N it writes {Sequence
    s - N (modulo 2^32), all ones}. ... the slot is marked consumed by setting its Block Offset to
    all ones ... by the target when it processes BIND for direct allocations."""


@case("direct.ring.laps", "Free-Block Ring", RULE, RING, features=Feature.DIRECT_ALLOC)
async def ring_laps(ctx: Ctx) -> None:
    """N+2 direct allocations and frees, once round the session's ring and on: every slot
    holds the Sequence of its own slot number at the start; every ticket finds its block,
    one of the partition, in slot ticket mod N (the offset FetchAdd returned, on iWARP);
    BIND leaves the slot consumed; the FREE puts the block back where a later lap finds it."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    n, _ = _ring_session_checks(ctx, a)
    slots = await read_ring(ctx, a)
    wrong = [f"slot {i}: Sequence {seq}" for i, (seq, _) in enumerate(slots) if seq % n != i]
    ctx.check(not wrong, "every slot's Sequence equal to its slot number modulo N", "; ".join(wrong[:4]))
    listed = [block for _, block in slots if block != SLOT_CONSUMED]
    ctx.check(len(set(listed)) == len(listed) and all(_in_partition(a, b) for b in listed),
              "the filled slots list distinct blocks of the partition", [hex(b) for b in listed])
    h = await ctx.handle(a)
    payload = data(64)
    for cycle in range(1, n + 3):
        with TicketWindow(a, f"cycle {cycle}'s ticket, its data and its BIND"):
            ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
            ctx.check(offset == SLOT_SIZE * (ticket % n), f"Slot Offset {SLOT_SIZE} * (ticket mod {n}) "
                      f"for ticket {ticket} (cycle {cycle})", offset)
            block = await slot_block(ctx, a, ticket, offset)
            await ctx.wait(a.qp.write(granted(a, "partition")[0], block, payload), "the data written")
            await ctx.ok(a.bind(h, ticket, len(payload), block), f"BIND of ticket {ticket} (cycle {cycle})")
        ctx.check(_in_partition(a, block), f"the block of ticket {ticket} one of the partition",
                  hex(block))
        sequence, left = await read_slot(ctx, a, ticket)
        ctx.check(left == SLOT_CONSUMED, f"the slot of ticket {ticket} consumed after its BIND",
                  f"Sequence {sequence}, Block Offset {left:#x}")
        await ctx.ok(a.free(h), f"FREE (cycle {cycle})")


@case("direct.ring.deferred_free", "Free-Block Ring", MUST_NOT, """If it [the slot at o] is not yet
      consumed, because the allocation that owns it has taken its ticket but not yet read it,
      the target MUST defer the write until the slot is consumed; it MUST NOT overwrite the
      slot.""", features=Feature.DIRECT_ALLOC)
async def deferred_free(ctx: Ctx) -> None:
    """Take ticket t and leave it unbound; allocate and free until a FREE's ticket is t + N,
    whose slot is t's, still unconsumed, and (quota permitting) one more FREE while that one
    waits: the slot must keep t's block, BIND of t with that block must succeed, and only
    then may the freed block appear there, as ticket t + N's."""
    a = await ctx.connect(need=Feature.DIRECT_ALLOC)
    n, q = _ring_session_checks(ctx, a)
    if q < 2:
        ctx.skip("a quota of one block leaves none to free while a ticket waits")
    hold_ticket, cycle = await ctx.handles(a, 2)
    with TicketWindow(a, "ticket t, the allocations and FREEs round the ring, and t's BIND"):
        ticket, offset = await ctx.wait(a.take_ticket(), "FetchAdd on Head")
        block = await slot_block(ctx, a, ticket, offset)
        ahead = [rel for seq, b in await read_ring(ctx, a)
                 if b != SLOT_CONSUMED and (rel := (seq - ticket) & 0xFFFFFFFF) < n]
        tail = ticket + max(ahead) + 1           # the ticket the next FREE takes
        if tail - ticket < 2:
            ctx.skip("the ring holds no block besides the waiting ticket's")
        for _ in range(ticket + n - tail):       # until the next FREE is the one that reaches t's slot
            await ctx.ok(a.direct_alloc(cycle, b"cycle"), "DIRECT_ALLOC (moving Tail on)")
            await ctx.ok(a.free(cycle), "FREE (moving Tail on)")
        freed = await ctx.ok(a.direct_alloc(cycle, b"freed"), "DIRECT_ALLOC")
        await ctx.ok(a.free(cycle), f"FREE whose ticket {ticket + n} reaches the slot of ticket {ticket}")
        if q > 2:         # a block left besides t's and the deferred one: another free meanwhile
            await ctx.ok(a.direct_alloc(cycle, b"again"), "DIRECT_ALLOC while a FREE waits deferred")
            await ctx.ok(a.free(cycle), "another FREE while the first waits deferred")
        seen = await read_slot(ctx, a, ticket)
        ctx.check(seen == (ticket & 0xFFFFFFFF, block), f"the slot of ticket {ticket}, not yet consumed, "
                  f"still {{Sequence {ticket}, Block Offset {block:#x}}}: the FREE deferred",
                  f"Sequence {seen[0]}, Block Offset {seen[1]:#x}")
        await ctx.ok(a.bind(hold_ticket, ticket, 0, block), f"BIND of ticket {ticket} with the block its slot showed")
    seen = await read_slot(ctx, a, ticket)
    want = ((ticket + n) & 0xFFFFFFFF, freed.block_offset)
    ctx.check(seen == want, f"once BIND consumed it, the deferred FREE written: Sequence {want[0]}, "
              f"Block Offset {want[1]:#x}", f"Sequence {seen[0]}, Block Offset {seen[1]:#x}")
