"""One case per requirement the specification puts on an initiator, each quoting it.

Every case runs the program under test with an operation script against a checking
target of its own and judges what the program reported (exit status, ``results``,
output files) and what it did on the wire and in target memory (``observe.py``).
"""
from __future__ import annotations

from typing import Any

from ... import codec
from ...ring import add_mask
from ...tables import RING_COUNTER, memory as M
from ...tables.enums import OPCODES
from ...vocab import REQUESTS, AnyMessage, EntryFlag, Feature, GoodbyeFlag, Opcode, RequestFlag, Status
from ..registry import MUST, MUST_NOT, RULE, SHOULD
from . import behaviours as B
from .context import ICtx, icase
from .model import weak_id

RECORD = RequestFlag.RECORD
BLOCK = 4096
SESSION, OPERATIONS, COMPLETION = "Session Establishment", "Operations", "Completion"
DIRECT, QUOTAS, SECURITY = "Direct Modes", "Allocation Quotas", "Security Considerations"


# -- Session Establishment -------------------------------------------------------------------

@icase("hello.header", SESSION, RULE, """After the RDMA connection is established, the
       initiator sends HELLO and the target answers with HELLO_ACK, both as Send messages and
       both starting with the common header () in which Request ID, Block Handle, Generation,
       and Status are zero (Status reports an error in HELLO_ACK).""")
async def hello_header(ctx: ICtx) -> None:
    await ctx.run_ok("")
    s = ctx.record.sessions[0]
    ctx.check(bool(s.messages) and codec.opcode_of(s.messages[0].payload) == Opcode.HELLO,
              "HELLO as the first message", s.message_opcodes()[:1])
    raw = s.hello_raw
    ctx.check(len(raw) == codec.message_length(Opcode.HELLO, 0), "a HELLO of 44 octets", f"{len(raw)} octets")
    head = codec.decode_header(raw)
    ctx.check(head["version"] == 1, "Version 1", head["version"])
    seen = {k: head[k] for k in ("request_id", "handle", "generation", "status", "flags")}
    ctx.check(not any(seen.values()), "Request ID, Block Handle, Generation, Status (and Flags) zero",
              seen)
    hello = s.hello or {}
    ctx.check(hello.get("hello.completion_credits", 0) > 0,
              "Completion Credits of at least one (receive buffers posted for COMPLETIONs)",
              hello.get("hello.completion_credits"))


@icase("binding.mpa.enhanced", "RDMAP Binding", SHOULD, "Peers SHOULD use the enhanced connection "
       "establishment of .", transport="iwarp")
async def mpa_enhanced(ctx: ICtx) -> None:
    """The initiator's MPA Request: revision 2 with the IRD and ORD of RFC 6581."""
    await ctx.run_ok("")
    request = ctx.record.sessions[0].mpa
    if request is None:
        ctx.skip("the MPA exchange was an RDMA device's own, not seen by the checking target")
        return
    ctx.check(request.rev == 2 and request.enhanced, "an MPA Request of revision 2 with RFC 6581's IRD "
              "and ORD", f"revision {request.rev}" + ("" if request.enhanced else ", without IRD and ORD"))


@icase("hello.id_entropy", SESSION, MUST, """Because it gives access to those bindings, the
       Initiator ID MUST be generated with at least 128 bits of entropy and kept secret""")
async def hello_id_entropy(ctx: ICtx) -> None:
    """Four fresh initiators (each run with a state directory of its own): their IDs
    must differ, none may be obviously weak, and none may be a neighbour of another
    (a counter or a clock read as an ID)."""
    for _ in range(4):
        await ctx.run_ok("")
    ids = [bytes(h["hello.initiator_id"]) for h in ctx.record.hellos]
    ctx.check(len(ids) == 4, "4 HELLOs", len(ids))
    ctx.check(len(set(ids)) == 4, "4 distinct Initiator IDs from 4 fresh initiators",
              " ".join(i.hex() for i in ids))
    for ident in ids:
        why = weak_id(ident)
        ctx.check(why is None, "an Initiator ID of random octets", f"{ident.hex()} ({why})")
    values = sorted(int.from_bytes(i, "big") for i in ids)
    for a, b in zip(values, values[1:]):
        ctx.check(b - a >= 1 << 64, "Initiator IDs far apart (not a counter or a clock)",
                  f"{a:032x} and {b:032x} differ by {b - a}")
    shared = [k for k in range(16) if len({i[k] for i in ids}) == 1]
    ctx.check(len(shared) < 8, "Initiator IDs sharing no long run of octets",
              f"octets {shared} equal in all four")


#: fresh initiators hello.id_bits compares, and the number of bit positions that may be
#: the same in all of them by chance (for random IDs, 128 * 2**-11 such bits are expected,
#: and 4 or more come once in about 1.6 million cases)
ID_RUNS, ID_CONSTANT_BITS = 12, 4


def _repeats(ident: bytes) -> int | None:
    """The period (in octets) of an ID made of one shorter value repeated, or None."""
    return next((p for p in (1, 2, 4, 8) if ident == ident[:p] * (16 // p)), None)


@icase("hello.id_bits", SESSION, MUST, """Because it gives access to those bindings, the
       Initiator ID MUST be generated with at least 128 bits of entropy and kept secret""",
       slow=f"{ID_RUNS} runs of the program, each a fresh initiator")
async def hello_id_bits(ctx: ICtx) -> None:
    """Twelve fresh initiators: no ID is one shorter value repeated, no two are closer
    than 24 bits apart, and fewer than 4 of the 128 bit positions are the same in all
    twelve (a fixed prefix, a UUID's version bits, octets of 7 random bits)."""
    for _ in range(ID_RUNS):
        await ctx.run_ok("")
    ids = [bytes(h["hello.initiator_id"]) for h in ctx.record.hellos]
    ctx.check(len(ids) == ID_RUNS, f"{ID_RUNS} HELLOs", len(ids))
    for ident in ids:
        period = _repeats(ident)
        ctx.check(period is None, "an Initiator ID that is not a shorter value repeated",
                  f"{ident.hex()} (a {period}-octet value repeated)")
    values = [int.from_bytes(i, "big") for i in ids]
    for i, a in enumerate(values):
        for b in values[i + 1:]:
            ctx.check(bin(a ^ b).count("1") >= 24, "Initiator IDs at least 24 of 128 bits apart "
                      "(two random IDs differ in about 64)", f"{a:032x} and {b:032x}")
    ones = [all(v >> k & 1 for v in values) for k in range(128)]
    zeros = [not any(v >> k & 1 for v in values) for k in range(128)]
    fixed = [127 - k for k in range(128) if ones[k] or zeros[k]]
    ctx.check(len(fixed) < ID_CONSTANT_BITS, f"fewer than {ID_CONSTANT_BITS} bit positions the "
              f"same in all {ID_RUNS} Initiator IDs (bits fixed by the generator carry no entropy)",
              f"{len(fixed)} fixed: bits {sorted(fixed)} (bit 0 the first of the ID)")


@icase("hello.id_retained", SESSION, RULE, """The Initiator ID is a stable random identifier
       of the initiator; a target uses it to restore the initiator's handle range and bindings
       after a reconnection.""")
async def hello_id_retained(ctx: ICtx) -> None:
    state = ctx.new_state()
    data = ctx.data(300, 1)
    await ctx.run_ok("alloc_store 3 @kv seal", {"kv": data}, state=state)
    second = await ctx.run_ok("load 3 @back", state=state)
    ids = [bytes(h["hello.initiator_id"]) for h in ctx.record.hellos]
    ctx.check(len(ids) == 2 and ids[0] == ids[1], "the same Initiator ID on reconnection",
              " then ".join(i.hex() for i in ids))
    first_goodbye = [m.decoded for m in ctx.record.sessions[0].messages if m.decoded
                     and m.decoded["opcode"] == Opcode.GOODBYE]
    if first_goodbye and first_goodbye[0]["flags"] & GoodbyeFlag.RELEASE:
        ctx.note("the first run ended with GOODBYE RELEASE although its binding was to be kept")
    ctx.expect_statuses(second, ["OK"], "LOAD of the binding kept across the reconnection")
    ctx.check(second.output("back") == data, "the stored data back", "other octets")


# -- credits, quota, handles ------------------------------------------------------------------

async def _credits(ctx: ICtx, grant: int) -> None:
    await ctx.serve(B.Grant(grant))
    inputs = {f"d{i}": ctx.data(200, i) for i in range(5)}
    ops = " & ".join(f"alloc_store {i} @d{i} seal" for i in range(5))
    run = await ctx.run_ok(ops, inputs)
    s = ctx.record.sessions[0]
    ctx.check(s.max_in_flight <= grant, f"at most {grant} request(s) in flight (Request Credits "
              f"{grant}, completions held {B.SETTLE:g} s or more)", f"{s.max_in_flight} in flight")
    ctx.expect_statuses(run, ["OK"] * 5, "5 ALLOC_STOREs, eventually")


CREDITS = """A target pre-posts, for each request credit, a receive buffer followed by a chain of
       work requests that its RDMA interface starts when the receive completes."""


@icase("credits.one", "Target Execution Model", RULE, CREDITS)
async def credits_one(ctx: ICtx) -> None:
    await _credits(ctx, 1)


@icase("credits.two", "Target Execution Model", RULE, CREDITS)
async def credits_two(ctx: ICtx) -> None:
    await _credits(ctx, 2)


@icase("credits.strays", "Target Execution Model", RULE, CREDITS)
async def credits_strays(ctx: ICtx) -> None:
    """Two Request Credits, every completion held; meanwhile a COMPLETION with a Request
    ID never used (status OK) and one repeating a completion already delivered. Neither
    answers a request: neither gives a credit back (at most 2 in flight) nor is
    reported (every FREE of an unbound handle is NOT_VALID)."""
    strays = B.Strays(2)
    await ctx.serve(strays)
    run = await ctx.run_ok(" & ".join(f"free {i}" for i in range(6)))
    s = ctx.record.sessions[0]
    if not strays.sent:
        ctx.skip("the Completion Credits announced leave no room for COMPLETIONs beside the 2 "
                 "requests granted")
    ctx.check(s.max_in_flight <= 2, "at most 2 requests in flight (Request Credits 2): a COMPLETION "
              "that answers no request returns no credit", f"{s.max_in_flight} in flight")
    ctx.expect_statuses(run, ["NOT_VALID"] * 6, "6 FREEs of unbound handles, none answered by a "
                        "stray COMPLETION")


@icase("credits.completion_buffers", SESSION, RULE, """Completion Credits is the number of
       receive buffers the initiator has posted for COMPLETION messages.""")
async def credits_completion_buffers(ctx: ICtx) -> None:
    """A first run learns the Completion Credits C of the HELLO. The second is granted
    C + 8 Request Credits, and its completions are held until C + 1 requests wait, or
    none more came for a while (``behaviours.Burst``), then sent at once. Rounds of up to 64 FREEs issued together, more
    in all than C: never more than C requests in flight (each one's COMPLETION needs a
    buffer; judged where C is below 57), and every buffer posted again, so that every
    COMPLETION finds one."""
    burst = B.Burst(8)
    await ctx.serve(burst)
    await ctx.run_ok("")
    credits = (ctx.record.sessions[0].hello or {}).get("hello.completion_credits", 0)
    ctx.check(credits > 0, "Completion Credits of at least one", credits)
    width = min(credits, 56) + 8
    rounds = min(max(3, -(-(credits + 1) // width) + 1), 40)
    ops = "; ".join(" & ".join(f"free {i % 16}" for i in range(width)) for _ in range(rounds))
    run = await ctx.run(ops)
    s = ctx.record.sessions[-1]
    ctx.check(s.max_in_flight <= credits, f"at most {credits} requests in flight (the Completion "
              f"Credits announced; {credits + 8} Request Credits granted)", f"{s.max_in_flight}")
    ctx.check(not burst.no_buffer, "a receive buffer for every COMPLETION", f"{burst.no_buffer} RNR "
              "NAK(s) from the initiator's RNIC: no receive buffer posted")
    ctx.check(run.exit_code == 0 and run.statuses() == ["NOT_VALID"] * (rounds * width),
              f"{rounds} x {width} FREEs answered NOT_VALID, their COMPLETIONs sent {credits} at a time "
              f"(bursts {burst.bursts})", f"exit {run.exit_code}, {len(run.statuses())} results, "
              f"{sum(st == 'NOT_VALID' for st in run.statuses())} NOT_VALID: {run.tail()}")


def _check_usage(ctx: ICtx, s: Any, quota: int) -> None:
    """The initiator's usage as the target saw it never above ``quota``: a FetchAdd on
    the Head takes a ticket, an ALLOC_STORE or BIND that completes OK binds a handle
    (a failed BIND's ticket is reclaimed), a FREE that completes OK releases one."""
    usage, worst = 0, 0
    events: list[tuple[float, str, Any]] = sorted([(m.at, "req", m.decoded) for m in s.messages if m.decoded]
                    + [(a.at, "fetch_add", None) for a in s.accesses if a.kind == "fetch_add"]
                    + [(t, "done", (rid, st)) for t, rid, st, _ in s.completions], key=lambda e: e[0])
    pending: dict[int, int] = {}
    for _, kind, what in events:
        if kind == "fetch_add":
            usage += 1                    # a ticket taken counts until its BIND completes
            worst = max(worst, usage)
        elif kind == "req":
            pending[what["request_id"]] = what["opcode"]
        else:
            rid, status = what
            opcode = pending.pop(rid, None)
            if opcode == Opcode.ALLOC_STORE and not status:
                usage += 1
            elif opcode == Opcode.BIND and status:
                usage -= 1      # OK: the ticket became a binding; failed: the target reclaims it
            elif opcode == Opcode.FREE and not status:
                usage -= 1
    ctx.check(worst <= quota, "usage (handles bound plus tickets taken and not bound) never above "
              f"the quota of {quota}", f"{worst} at the worst")


@icase("credits.every_opcode", "Target Execution Model", RULE, CREDITS)
async def credits_every_opcode(ctx: ICtx) -> None:
    """One Request Credit, every completion held 0.3 s, and operations of every kind
    issued together (ALLOC_STORE, STORE, LOAD, FREE, and the BIND of DIRECT_ALLOC): each
    request waits for the credit, whatever its opcode."""
    await ctx.serve(B.Grant(1))
    inputs = {k: ctx.data(300, i) for i, k in enumerate("abcde")}
    run = await ctx.run_ok("alloc_store 0 @a & direct_alloc 1 @b & alloc_store 2 @c seal; "
                           "store 0 @d seal & load 2 @r & free 1 & direct_alloc 3 @e", inputs)
    s = ctx.record.sessions[0]
    seen = sorted({OPCODES.describe(r["opcode"]) for r in s.requests()})
    ctx.check(s.max_in_flight <= 1, "at most 1 request in flight (Request Credits 1), whatever its "
              f"opcode ({', '.join(seen)} sent)", f"{s.max_in_flight} in flight")
    ctx.expect_statuses(run, ["OK"] * 7, "every operation, one request at a time")


@icase("quota.tickets", QUOTAS, MUST_NOT, """An initiator's usage is the number of handles it
       has bound plus the number of tickets it has taken and not yet bound. An initiator MUST
       NOT exceed its quota""")
async def quota_tickets(ctx: ICtx) -> None:
    """Quota 3: two ALLOC_STOREs and one DIRECT_ALLOC fill it; a fourth allocation by
    DIRECT_ALLOC must take no ticket (and report a failure). After a FREE the usage is
    2, so one more DIRECT_ALLOC is within the quota and is not refused by the initiator
    itself, and the one after it, again past the quota, takes no ticket. Two FREEs more
    leave a usage of 1, and a last DIRECT_ALLOC is within the quota again."""
    await ctx.serve(quota=3)
    inputs = {f"d{i}": ctx.data(100, i) for i in range(7)}
    run = await ctx.run_ok("alloc_store 0 @d0 seal; alloc_store 1 @d1 seal; direct_alloc 2 @d2; "
                           "direct_alloc 3 @d3; free 0; direct_alloc 4 @d4; direct_alloc 5 @d5; "
                           "free 1; free 2; direct_alloc 6 @d6", inputs)
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_ALLOC:
        ctx.skip("DIRECT_ALLOC was not granted")
    _check_usage(ctx, s, 3)
    statuses = run.statuses()
    ctx.check(len(statuses) == 10 and statuses[3] != "OK" and statuses[6] != "OK",
              "the allocations past the quota (the fourth, and the one after the FREE's "
              "replacement) reported as failed", " ".join(statuses))
    ctx.check(statuses[5] == "OK" and statuses[9] == "OK", "the DIRECT_ALLOCs after a FREE (usage "
              "2 of 3, then 1 of 3) not refused", " ".join(statuses))


@icase("quota.concurrent", QUOTAS, MUST_NOT, """An initiator's usage is the number of handles
       it has bound plus the number of tickets it has taken and not yet bound. An initiator
       MUST NOT exceed its quota""")
async def quota_concurrent(ctx: ICtx) -> None:
    """Quota 3 and four DIRECT_ALLOCs issued together: the tickets taken and not yet bound
    count, so one of the four takes no ticket and is reported failed. After a FREE, a
    fifth is within the quota."""
    await ctx.serve(quota=3)
    inputs = {f"d{i}": ctx.data(100, i) for i in range(5)}
    run = await ctx.run_ok(" & ".join(f"direct_alloc {i} @d{i}" for i in range(4))
                           + "; free 0; direct_alloc 4 @d4", inputs)
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_ALLOC:
        ctx.skip("DIRECT_ALLOC was not granted")
    _check_usage(ctx, s, 3)
    statuses = run.statuses()
    ctx.check(len(statuses) == 6 and statuses[:4].count("OK") == 3, "three of the four DIRECT_ALLOCs "
              "issued together OK, one refused (quota 3)", " ".join(statuses))
    if statuses[0] == "OK":
        ctx.check(statuses[4:] == ["OK", "OK"], "the FREE, then a DIRECT_ALLOC within the quota",
                  " ".join(statuses))


@icase("quota.failed_free", QUOTAS, MUST_NOT, """the target releases one unit of usage when a
       FREE completes or when an abandoned ticket is reclaimed. ... A failed check completes
       the request with the corresponding status and has no other effect.""")
async def quota_failed_free(ctx: ICtx) -> None:
    """Quota 3, filled by an ALLOC_STORE and two DIRECT_ALLOCs. Two FREEs of bound
    handles are answered STALE_GENERATION and INTERNAL, and one of an unbound handle is
    NOT_VALID: none released anything, so the DIRECT_ALLOCs after them take no ticket."""
    await ctx.serve(B.Statuses("FREE", [Status.STALE_GENERATION, Status.INTERNAL]), quota=3)
    inputs = {f"d{i}": ctx.data(100, i) for i in range(5)}
    run = await ctx.run_ok("alloc_store 0 @d0 seal; direct_alloc 1 @d1; direct_alloc 2 @d2; "
                           "free 0; free 1; free 7; direct_alloc 3 @d3; direct_alloc 4 @d4", inputs)
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_ALLOC:
        ctx.skip("DIRECT_ALLOC was not granted")
    statuses = run.statuses()
    ctx.check(statuses[:6] == ["OK", "OK", "OK", "STALE_GENERATION", "INTERNAL", "NOT_VALID"],
              "the quota filled, then three failed FREEs", " ".join(statuses))
    _check_usage(ctx, s, 3)
    ctx.check(len(statuses) == 8 and "OK" not in statuses[6:], "the DIRECT_ALLOCs after failed FREEs "
              "refused (usage still 3 of 3)", " ".join(statuses))


@icase("handles.own_range", "Conventions and Definitions", RULE, """Block Handle: A 64-bit name,
       chosen by an initiator within the handle range assigned to it, that is bound to a block
       by an Unmapped Store.""")
async def handles_own_range(ctx: ICtx) -> None:
    await ctx.serve()
    last = ctx.config.handles_per_initiator - 1
    inputs = {"a": ctx.data(64, 1), "b": ctx.data(64, 2)}
    run = await ctx.run_ok(f"alloc_store 0 @a seal; alloc_store {last} @b seal; free 0; free {last}",
                           inputs)
    s = ctx.record.sessions[0]
    base, count = s.granted["hello_ack.handle_base"], s.granted["hello_ack.handle_count"]
    seen = [(OPCODES.describe(r["opcode"]), r["handle"]) for r in s.requests()]
    want = [("ALLOC_STORE", base), ("ALLOC_STORE", base + last), ("FREE", base), ("FREE", base + last)]
    for name, handle in seen:
        ctx.check(base <= handle < base + count, f"{name} handles inside {base:#x}+{count}", f"{handle:#x}")
    ctx.check(seen == want, "the handles the script named (Handle Base + offset)",
              ", ".join(f"{n} {h:#x}" for n, h in seen))
    ctx.expect_statuses(run, ["OK"] * 4, "stores and frees at both ends of the range")


@icase("addr_le.encoding", "Target Execution Model", RULE, """The receive scatter list places
       the request's Data Descriptor and handle directly into the address fields of the
       following work requests (hence the ADDR_LE option)""")
async def addr_le_encoding(ctx: ICtx) -> None:
    """A target that sets ADDR_LE: the handle and the Data Descriptor of every request,
    and the Block Offset of BIND, little-endian (docs/NOTES.md decision 7); a store
    larger than Max Inline goes by RDMA Read from that descriptor."""
    await ctx.serve(addr_le=True)
    big = ctx.data(3000, 1)
    run = await ctx.run_ok("alloc_store 5 @big seal; load 5 @back; direct_alloc 6 @small; "
                           "load 6 @back6; free 5", {"big": big, "small": ctx.data(40, 2)})
    s = ctx.record.sessions[0]
    ctx.check(bool(s.granted_features() & Feature.ADDR_LE), "ADDR_LE granted", s.granted_features())
    base = s.granted["hello_ack.handle_base"]
    for m in s.messages:
        if m.decoded is None:
            ctx.check(False, "requests that decode with little-endian address fields",
                      m.payload[:24].hex())
    handles = [r["handle"] - base for r in s.requests() if r["opcode"] != Opcode.BIND]
    ctx.check(handles == [5, 5, 6, 5], "handles 5, 5, 6, 5 (the LOAD after DIRECT_ALLOC) read "
              "little-endian", handles)
    store = s.requests("ALLOC_STORE")[0]
    ctx.check(store["dd.length"] == len(big), f"a Data Descriptor Length of {len(big)} read "
              "little-endian", store["dd.length"])
    ctx.check(run.statuses()[:2] == ["OK", "OK"] and run.output("back") == big,
              "the store and the load of 3000 octets through little-endian descriptors",
              " ".join(run.statuses()))
    if s.granted_features() & Feature.DIRECT_ALLOC:
        ctx.check(run.statuses()[2:4] == ["OK", "OK"], "DIRECT_ALLOC with a little-endian BIND",
                  " ".join(run.statuses()))


@icase("addr_le.direct_load", "Session Establishment", RULE, """If ADDR_LE is set, the initiator
       MUST encode the Block Handle and the STag, Tagged Offset, and Length fields of the Data
       and Completion Descriptors in little-endian byte order, and the Block Offset fields of
       table entries and ring slots are in little-endian byte order.""")
async def addr_le_direct_load(ctx: ICtx) -> None:
    """A target that sets ADDR_LE: a Direct Load reads the entry, then the block at the
    Block Offset the entry holds little-endian, then the entry again, and reports the
    stored data."""
    await ctx.serve(addr_le=True)
    data = ctx.data(3000, 1)
    run = await ctx.run_ok("alloc_store 5 @kv seal; direct_load 5 @back", {"kv": data})
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_LOAD:
        ctx.skip("DIRECT_LOAD was not granted")
    entries = s.reads("table")
    if not entries:
        ctx.skip("the initiator did not use DIRECT_LOAD (no RDMA Read of the table)")
    entry = codec.decode_struct(M.TABLE_ENTRY, entries[0].served, True)
    pool = [a.offset for a in s.reads("pool")]
    ctx.check(entry["entry.block_offset"] in pool, f"the block read at the entry's Block Offset "
              f"{entry['entry.block_offset']:#x} (little-endian)", [hex(o) for o in pool] or "no Pool read")
    ctx.expect_statuses(run, ["OK", "OK"], "ALLOC_STORE and DIRECT_LOAD in an ADDR_LE session")
    ctx.check(run.output("back") == data, "the block's data", "other octets")


@icase("addr_le.record", COMPLETION, RULE, """If ADDR_LE is set, the initiator MUST encode the
       Block Handle and the STag, Tagged Offset, and Length fields of the Data and Completion
       Descriptors in little-endian byte order""", transport="roce")
async def addr_le_record(ctx: ICtx) -> None:
    """A target that sets ADDR_LE and grants RECORD_COMPLETION: the Completion Descriptor's
    STag and Tagged Offset, read little-endian, name the record slot, so the records land
    and each operation completes through its own."""
    await ctx.serve(addr_le=True)
    data = ctx.data(200, 1)
    run = await ctx.run("alloc_store 1 @kv seal record; load 1 @back record; free 1 record", {"kv": data})
    s = ctx.record.sessions[0]
    if not any(r["flags"] & RequestFlag.RECORD for r in s.requests()):
        ctx.skip("the initiator asked for no completion record (RECORD is optional)")
    ctx.check(run.exit_code == 0, "exit status 0: every record written where the Completion "
              "Descriptor, read little-endian, points", f"{run.exit_code}: {run.tail()}")
    ctx.expect_statuses(run, ["OK"] * 3, "the store, the load and the FREE through records")
    ctx.check(run.output("back") == data, "the data back", "other octets")


# -- descriptors and RECORD ---------------------------------------------------------------------

@icase("descriptor.load_length", OPERATIONS, MUST_NOT, """lengths MUST NOT exceed Block Size or
       the initiator's buffer""")
async def descriptor_load_length(ctx: ICtx) -> None:
    """The LOAD's Data Descriptor names a buffer that holds the block (at least its Data
    Length), and all of it is registered: an RDMA Write of its last octet is placed,
    one of the octet past it is refused by the initiator's RNIC."""
    probe = B.Probe("load", ctx.told / 2)
    await ctx.serve(probe)
    data = ctx.data(BLOCK, 1)
    await ctx.run("alloc_store 1 @kv seal; load 1 @back", {"kv": data})
    loads = ctx.record.sessions[0].requests("LOAD")
    ctx.check(bool(loads), "a LOAD", "none")
    ctx.check(loads[0]["dd.length"] >= len(data), f"a Data Descriptor Length of at least {len(data)}",
              loads[0]["dd.length"])
    ctx.check(probe.edge == "placed", "an RDMA Write of the descriptor's last octet placed",
              probe.edge)
    ctx.check(probe.past is not None and probe.past.startswith("refused"),
              "an RDMA Write of the octet past the descriptor refused by the initiator's RNIC",
              probe.past)


@icase("descriptor.store_length", OPERATIONS, RULE, """for STORE and ALLOC_STORE it is the source
       that the target reads with RDMA Read, unless INLINE is set, in which case STag and Tagged
       Offset are zero, Length is the inline data length, and the data follows the message.""")
async def descriptor_store_length(ctx: ICtx) -> None:
    await ctx.serve()
    big, small = ctx.data(3000, 1), ctx.data(100, 2)
    run = await ctx.run_ok("alloc_store 1 @big seal noinline; alloc_store 2 @small seal inline; "
                           "load 1 @b1; load 2 @b2", {"big": big, "small": small})
    stores = ctx.record.sessions[0].requests("ALLOC_STORE")
    ctx.check(len(stores) == 2, "2 ALLOC_STOREs", len(stores))
    ctx.check(stores[0]["dd.length"] == len(big), f"Length {len(big)} naming the data to read",
              stores[0]["dd.length"])
    inline = stores[1]
    if inline["flags"] & RequestFlag.INLINE:
        ctx.check(inline["dd.stag"] == 0 and inline["dd.offset"] == 0 and inline["dd.length"] == len(small),
                  f"INLINE: STag 0, Tagged Offset 0, Length {len(small)}",
                  f"STag {inline['dd.stag']:#x}, offset {inline['dd.offset']:#x}, Length {inline['dd.length']}")
    ctx.check(run.output("b1") == big and run.output("b2") == small, "both blocks back as stored",
              " ".join(run.statuses()))


@icase("descriptor.store_buffer", SECURITY, RULE, """The initiator exposes only the buffers named
       in its descriptors""")
async def descriptor_store_buffer(ctx: ICtx) -> None:
    """A store larger than Max Inline: an RDMA Read of the last octet its Data Descriptor
    names is answered, one of the octet past it is refused by the initiator's RNIC."""
    probe = B.Probe("store", ctx.told / 2)
    await ctx.serve(probe)
    await ctx.run("alloc_store 1 @kv seal noinline", {"kv": ctx.data(3000, 1)})
    if probe.edge is None:
        ctx.skip("the initiator sent no store by RDMA Read (all inline)")
    ctx.check(probe.edge == "placed", "an RDMA Read of the descriptor's last octet answered", probe.edge)
    ctx.check(probe.past is not None and probe.past.startswith("refused"),
              "an RDMA Read of the octet past the descriptor refused by the initiator's RNIC", probe.past)


@icase("descriptor.read_only", SECURITY, SHOULD, """The initiator exposes only the buffers named
       in its descriptors; it SHOULD use STags that are valid for a single request""")
async def descriptor_read_only(ctx: ICtx) -> None:
    """A store larger than Max Inline names its source for the target to RDMA-read: an
    RDMA Write into that buffer (of the octet it holds) is refused by the initiator's RNIC."""
    over = B.Overreach()
    await ctx.serve(over)
    await ctx.run("alloc_store 1 @kv seal noinline", {"kv": ctx.data(3000, 1)})
    write = over.write
    if write is None:
        ctx.skip("the initiator sent no store by RDMA Read (all inline)")
        return
    ctx.check(write.startswith("refused"), "an RDMA Write into a store's source buffer refused "
              "(it is exposed for reading only)", write)


@icase("record.buffer", COMPLETION, RULE, """A Completion Descriptor is 16 octets: STag (32 bits),
       Tagged Offset (64 bits), and 32 reserved bits, naming a 24-octet completion record slot of
       the initiator.""", transport="roce")
async def record_buffer(ctx: ICtx) -> None:
    """A LOAD with RECORD: an RDMA Write of the record slot's last octet is placed, one of
    the octet past its 24 is refused by the initiator's RNIC."""
    probe = B.Probe("record", ctx.told / 2)
    await ctx.serve(probe)
    await ctx.run("alloc_store 1 @kv seal; load 1 @back record", {"kv": ctx.data(100, 1)})
    if probe.edge is None:
        ctx.skip("the initiator asked for no completion record (RECORD is optional)")
    ctx.check(probe.edge == "placed", "an RDMA Write of the record slot's last octet placed", probe.edge)
    ctx.check(probe.past is not None and probe.past.startswith("refused"),
              "an RDMA Write of the octet past the 24-octet slot refused by the initiator's RNIC",
              probe.past)


@icase("record.only_when_advertised", COMPLETION, RULE, """If the target advertised
       RECORD_COMPLETION and the request has the RECORD flag, the target instead writes a
       24-octet completion record to the Completion Descriptor""")
async def record_only_when_advertised(ctx: ICtx) -> None:
    """A target that does not offer RECORD_COMPLETION: a script asking for records must
    get none requested (the initiator falls back to COMPLETIONs or refuses itself)."""
    await ctx.serve(features=Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC)
    data = ctx.data(200, 1)
    run = await ctx.run("alloc_store 1 @kv seal record; load 1 @back record; free 1 record", {"kv": data})
    flagged = [OPCODES.describe(r["opcode"]) for r in ctx.record.sessions[0].requests()
               if r["flags"] & RequestFlag.RECORD]
    ctx.check(not flagged, "no request with RECORD (RECORD_COMPLETION not granted)", flagged)
    if run.statuses() == ["OK"] * 3:
        ctx.check(run.output("back") == data, "the data back", "other octets")


@icase("record.descriptor", COMPLETION, RULE, """0x0004 RECORD: complete with a completion
       record (); a Completion Descriptor is present.""", transport="roce")
async def record_descriptor(ctx: ICtx) -> None:
    await ctx.serve()
    data = ctx.data(200, 1)
    run = await ctx.run_ok("alloc_store 1 @kv seal record; load 1 @back record", {"kv": data})
    s = ctx.record.sessions[0]
    recorded = [r for r in s.requests() if r["flags"] & RequestFlag.RECORD]
    if not recorded:
        ctx.skip("the initiator asked for no completion record (RECORD is optional)")
    for r in recorded:
        ctx.check(r.get("cd.stag", 0) != 0, "a Completion Descriptor with a non-zero STag",
                  r.get("cd.stag"))
    ctx.expect_statuses(run, ["OK", "OK"], "both operations completed through records")
    ctx.check(run.output("back") == data, "the data back", "other octets")


def _together(s: Any, messages: list) -> list[tuple[AnyMessage, AnyMessage]]:
    """Pairs of the requests in ``messages`` that were in flight at the same time (the
    later one taken before the earlier one's completion was sent)."""
    done: dict[int, float] = {}
    for t, rid, _, _ in s.completions:
        done.setdefault(rid, t)
    return [(m.decoded, m2.decoded) for i, m in enumerate(messages) for m2 in messages[i + 1:]
            if m2.at < done.get(m.decoded["request_id"], float("inf"))]


FLAGS_TEXT = """Flags are interpreted per opcode; for LOAD, STORE, ALLOC_STORE, and FREE they are:
       0x0001 INLINE: data follows the request. 0x0002 SEAL: seal the block after the store.
       0x0004 RECORD: complete with a completion record (); a Completion Descriptor is
       present. 0x0008 INVALIDATE: the target completes with Send with Invalidate ,
       invalidating the STag of the initiator's Data Descriptor. 0x0010 ALLOW_UNSEALED: a
       load may return an unsealed block."""
REQUEST_FLAGS = RequestFlag.INLINE | RequestFlag.SEAL | RequestFlag.RECORD | RequestFlag.INVALIDATE \
    | RequestFlag.ALLOW_UNSEALED


def _flags_asked(ctx: ICtx, reqs: list, ops: list[tuple[str, set[str]]], *, record: bool) -> None:
    """One request per operation, each with the flags its words ask for: SEAL exactly when
    ``seal``, ALLOW_UNSEALED exactly when ``unsealed``, RECORD (with ``record``: where the
    initiator uses records at all) exactly when ``record``, INVALIDATE only with a Data
    Descriptor the target can invalidate (a LOAD, a store that is not INLINE), and no
    undefined bit."""
    names = [OPCODES.describe(r["opcode"]) for r in reqs]
    ctx.check(names == [op.upper() for op, _ in ops], "one request per operation of the script "
              "(no retry, no request it did not ask for)", " ".join(names))
    for (op, words), r in zip(ops, reqs):
        flags = r["flags"]
        what = f"{op.upper()} {' '.join(sorted(words))}".strip()
        ctx.check(bool(flags & RequestFlag.SEAL) == ("seal" in words), f"{what}: SEAL "
                  f"{'set' if 'seal' in words else 'clear'}", f"flags {flags:#06x}")
        ctx.check(bool(flags & RequestFlag.ALLOW_UNSEALED) == ("unsealed" in words),
                  f"{what}: ALLOW_UNSEALED {'set' if 'unsealed' in words else 'clear'} (only the "
                  "program may allow an unsealed block)", f"flags {flags:#06x}")
        if record:
            ctx.check(bool(flags & RequestFlag.RECORD) == ("record" in words), f"{what}: RECORD "
                      f"{'set' if 'record' in words else 'clear'}", f"flags {flags:#06x}")
        described = r["opcode"] == Opcode.LOAD or (r["opcode"] in (Opcode.STORE, Opcode.ALLOC_STORE)
                                                     and not flags & RequestFlag.INLINE)
        ctx.check(described or not flags & RequestFlag.INVALIDATE, f"{what}: no INVALIDATE without "
                  "a Data Descriptor to invalidate", f"flags {flags:#06x}")
        ctx.check(not flags & ~REQUEST_FLAGS, f"{what}: no undefined flag bit", f"flags {flags:#06x}")


@icase("flags.as_asked", "Common Header", RULE, FLAGS_TEXT)
async def flags_as_asked(ctx: ICtx) -> None:
    """ALLOC_STOREs with and without ``seal``, loads with and without ``unsealed`` (of a
    sealed and an unsealed block), FREEs: each request carries the flags its words ask for and
    no other. A LOAD of the unsealed block not asked to allow it is NOT_SEALED, with no
    second LOAD that allows it."""
    await ctx.serve()
    a, b = ctx.data(300, 1), ctx.data(2000, 2)
    script = [("alloc_store 0 @a", "alloc_store", set()), ("alloc_store 1 @b seal", "alloc_store", {"seal"}),
              ("load 0 @r0", "load", set()), ("load 0 @u0 unsealed", "load", {"unsealed"}),
              ("load 1 @r1", "load", set()), ("free 0", "free", set()), ("free 1", "free", set())]
    run = await ctx.run_ok("; ".join(op for op, _, _ in script), {"a": a, "b": b})
    _flags_asked(ctx, ctx.record.sessions[0].requests(), [(op, w) for _, op, w in script], record=False)
    ctx.expect_statuses(run, ["OK", "OK", "NOT_SEALED", "OK", "OK", "OK", "OK"],
                        "the unsealed block's LOAD NOT_SEALED unless allowed")
    ctx.check(run.output("r0") is None and run.output("u0") == a and run.output("r1") == b,
              "data only for the loads that completed OK", "other octets")


@icase("flags.record_as_asked", COMPLETION, RULE, FLAGS_TEXT, transport="roce")
async def flags_record_as_asked(ctx: ICtx) -> None:
    """RECORD_COMPLETION granted: an initiator that uses records sets RECORD on every
    operation the script asks a record for (stores, loads, FREEs) and on no other."""
    await ctx.serve()
    data = ctx.data(200, 1)
    script = [("alloc_store 0 @kv seal record", "alloc_store", {"seal", "record"}),
              ("load 0 @r1 record", "load", {"record"}), ("load 0 @r2", "load", set()),
              ("alloc_store 1 @kv seal", "alloc_store", {"seal"}), ("free 1 record", "free", {"record"}),
              ("free 0", "free", set())]
    run = await ctx.run_ok("; ".join(op for op, _, _ in script), {"kv": data})
    reqs = ctx.record.sessions[0].requests()
    if not any(r["flags"] & RequestFlag.RECORD for r in reqs):
        ctx.skip("the initiator asked for no completion record (RECORD is optional)")
    _flags_asked(ctx, reqs, [(op, w) for _, op, w in script], record=True)
    ctx.expect_statuses(run, ["OK"] * 6, "each operation, through a record where asked")
    ctx.check(run.output("r1") == data and run.output("r2") == data, "the data back", "other octets")


@icase("record.slots", COMPLETION, RULE, """A Completion Descriptor is 16 octets: STag (32 bits),
       Tagged Offset (64 bits), and 32 reserved bits, naming a 24-octet completion record slot of
       the initiator.""", transport="roce")
async def record_slots(ctx: ICtx) -> None:
    """Three LOADs with RECORD in flight together, their records held and written last
    first: requests in flight at once name completion record slots that do not overlap,
    and each load gets its own status and data."""
    reverse = B.Reverse(3)
    await ctx.serve(reverse)
    a, c = ctx.data(1000, 1), ctx.data(3000, 3)
    run = await ctx.run_ok("alloc_store 0 @a seal; alloc_store 2 @c seal; "
                           "load 0 @ra record & load 1 @rb record & load 2 @rc record", {"a": a, "c": c})
    s = ctx.record.sessions[0]
    recorded = [m for m in s.messages if m.decoded and m.decoded["flags"] & RequestFlag.RECORD
                and m.decoded["opcode"] in (Opcode.LOAD, Opcode.STORE, Opcode.ALLOC_STORE, Opcode.FREE)]
    if not recorded:
        ctx.skip("the initiator asked for no completion record (RECORD is optional)")
    for r, r2 in _together(s, recorded):
        apart = (r["cd.stag"] != r2["cd.stag"] or r["cd.offset"] + M.COMPLETION_RECORD.size <= r2["cd.offset"]
                 or r2["cd.offset"] + M.COMPLETION_RECORD.size <= r["cd.offset"])
        ctx.check(apart, "requests in flight together with completion record slots of their own",
                  f"Request IDs {r['request_id']} and {r2['request_id']} both name STag "
                  f"{r2['cd.stag']:#x} at {r['cd.offset']:#x} and {r2['cd.offset']:#x}")
    ctx.expect_statuses(run, ["OK", "OK", "OK", "NOT_VALID", "OK"], "each load with its own status")
    ctx.check(run.output("ra") == a and run.output("rc") == c and run.output("rb") is None,
              "each load with its own data", f"{len(run.output('ra') or b'')} and "
              f"{len(run.output('rc') or b'')} octets")


# -- completions and statuses -------------------------------------------------------------------

async def _three_loads(ctx: ICtx, behaviour: B.Behaviour) -> None:
    """Loads of handles 0 (1000 octets), 1 (unbound) and 2 (3000 octets) issued together:
    each must get its own status and data."""
    a, c = ctx.data(1000, 1), ctx.data(3000, 3)
    await ctx.serve(behaviour)
    run = await ctx.run_ok("alloc_store 0 @a seal; alloc_store 2 @c seal; "
                           "load 0 @ra & load 1 @rb & load 2 @rc", {"a": a, "c": c})
    ctx.expect_statuses(run, ["OK", "OK", "OK", "NOT_VALID", "OK"], "each load with its own status")
    ctx.check(run.output("ra") == a and run.output("rc") == c and run.output("rb") is None,
              "each load with its own data (1000 and 3000 octets, none for the unbound one)",
              f"{len(run.output('ra') or b'')} and {len(run.output('rc') or b'')} octets")


MATCH = """Request ID is chosen by the initiator and echoed in the completion."""


@icase("request.ids", "Common Header", RULE, """Version is 1. Opcodes are listed in . Request ID
       is chosen by the initiator and echoed in the completion. ... Status is zero in
       requests.""")
async def request_ids(ctx: ICtx) -> None:
    """Eight requests in flight together, six of them LOADs of the same handle, each
    completion held 0.3 s: every request has Version 1 and Status 0, requests in flight
    at once have Request IDs of their own, and each load gets its data."""
    await ctx.serve(B.Grant(64))
    a = ctx.data(900, 1)
    loads = " & ".join(f"load 0 @r{i}" for i in range(6))
    run = await ctx.run("alloc_store 0 @a seal; " + loads + " & free 1 & free 2", {"a": a})
    s = ctx.record.sessions[0]
    for m in s.messages:
        if m.decoded and m.decoded["opcode"] in (Opcode.LOAD, Opcode.STORE, Opcode.ALLOC_STORE,
                                                  Opcode.FREE, Opcode.BIND):
            r = m.decoded
            ctx.check(r["version"] == 1 and r["status"] == 0, "requests with Version 1 and Status 0",
                      f"{OPCODES.describe(r['opcode'])} Version {r['version']} Status {r['status']}")
    requests = [m for m in s.messages if m.decoded and m.decoded["opcode"] in REQUESTS]
    for r, r2 in _together(s, requests):
        ctx.check(r["request_id"] != r2["request_id"], "a Request ID of its own for each request in "
                  "flight", f"{OPCODES.describe(r['opcode'])} and {OPCODES.describe(r2['opcode'])} "
                  f"in flight together with Request ID {r['request_id']:#x}")
    ctx.check(run.exit_code == 0, "exit status 0", f"{run.exit_code}: {run.tail()}")
    ctx.expect_statuses(run, ["OK"] * 7 + ["NOT_VALID"] * 2, "the store, six loads of it, two FREEs "
                        "of unbound handles")
    ctx.check(all(run.output(f"r{i}") == a for i in range(6)), "each load with the data", "other octets")


@icase("completion.out_of_order", "Common Header", RULE, MATCH)
async def completion_out_of_order(ctx: ICtx) -> None:
    behaviour = B.Reverse(3)
    await _three_loads(ctx, behaviour)
    if behaviour.reordered < 3:
        ctx.skip("the three loads were not in flight together, so no completion was reordered")


@icase("completion.duplicate", "Common Header", RULE, MATCH)
async def completion_duplicate(ctx: ICtx) -> None:
    await _three_loads(ctx, B.Duplicate())


@icase("completion.unknown_id", "Common Header", RULE, MATCH)
async def completion_unknown_id(ctx: ICtx) -> None:
    await _three_loads(ctx, B.Unknown())


@icase("completion.same_handle", "Common Header", RULE, MATCH)
async def completion_same_handle(ctx: ICtx) -> None:
    """Two LOADs, a FREE and a LOAD of one handle in flight together, their completions
    sent last first: each is matched by its Request ID, not by the handle it echoes."""
    await ctx.serve(B.Reverse(4))
    a = ctx.data(1500, 1)
    run = await ctx.run_ok("alloc_store 0 @a seal; load 0 @r0 & load 0 @r1 & free 0 & load 0 @r2",
                           {"a": a})
    ctx.expect_statuses(run, ["OK", "OK", "OK", "OK", "NOT_VALID"], "each request with its own "
                        "completion's status (the last LOAD after the FREE)")
    ctx.check(run.output("r0") == a and run.output("r1") == a and run.output("r2") is None,
              "the two loads before the FREE with the data, none for the one after it",
              f"{len(run.output('r0') or b'')} and {len(run.output('r1') or b'')} octets, "
              f"{'a file' if run.output('r2') is not None else 'none'} after the FREE")


@icase("completion.other_opcode", "Common Header", RULE, MATCH)
async def completion_other_opcode(ctx: ICtx) -> None:
    """Before each COMPLETION, a message of every other opcode with the same Request ID
    (and Status INTERNAL): only the COMPLETION answers the request."""
    behaviour = B.OtherOpcodes()
    await ctx.serve(behaviour)
    a = ctx.data(1000, 1)
    run = await ctx.run_ok("alloc_store 0 @a seal; load 0 @ra; load 1 @rb", {"a": a})
    ctx.check(behaviour.sent > 0, "messages of other opcodes sent", "none (no Completion Credits to spare)")
    ctx.expect_statuses(run, ["OK", "OK", "NOT_VALID"], "each request with its COMPLETION's status")
    ctx.check(run.output("ra") == a and run.output("rb") is None, "the stored data back, none for "
              "the unbound handle", f"{len(run.output('ra') or b'')} octets")


@icase("status.every_code", OPERATIONS, RULE, """A failed check completes the request with the
       corresponding status and has no other effect.""")
async def status_every_code(ctx: ICtx) -> None:
    """Each status code 1 to 11 answers one FREE: the program must report each as itself."""
    codes = [int(v) for v in Status if 0 < v < 0xC000]
    await ctx.serve(B.Statuses("FREE", codes))
    run = await ctx.run_ok("; ".join(f"free {i}" for i in range(len(codes))))
    ctx.expect_statuses(run, [Status(c).name for c in codes],
                        "each status as the completion gave it")


@icase("status.every_opcode", OPERATIONS, RULE, """A failed check completes the request with the
       corresponding status and has no other effect.""")
async def status_every_opcode(ctx: ICtx) -> None:
    """Each status code 1 to 11 answers one LOAD, one STORE and one ALLOC_STORE: each
    reported as itself, and no load reports data."""
    codes = [int(v) for v in Status if 0 < v < 0xC000]
    await ctx.serve(B.Statuses("LOAD|STORE|ALLOC_STORE", codes))
    ops = [f"{op} {i} @{'r' if op == 'load' else 'd'}{i}" for i in range(len(codes))
           for op in ("load", "store", "alloc_store")]
    run = await ctx.run_ok("; ".join(ops), {f"d{i}": ctx.data(100, i) for i in range(len(codes))})
    ctx.expect_statuses(run, [Status(c).name for c in codes for _ in range(3)],
                        "each status as the completion gave it, whatever the opcode")
    ctx.check(not any(run.output(f"r{i}") for i in range(len(codes))), "no data from a failed load",
              "a file written")


@icase("load.data_after_completion", COMPLETION, RULE, """In the RDMAP binding, the contents of a
       buffer written by RDMA Write are determinate once a subsequent Send has been delivered
       (rule 5 of ), so receipt of the completion implies that the loaded data is in the
       initiator's buffer.""")
async def load_after_completion(ctx: ICtx) -> None:
    """Decoy octets land in the LOAD's buffer first, then (after a pause) the block, then
    the COMPLETION: the program must report the block, never the decoy."""
    decoy = B.Decoy()
    await ctx.serve(decoy)
    data = ctx.data(BLOCK, 1)
    run = await ctx.run_ok("alloc_store 1 @kv seal; load 1 @back", {"kv": data})
    ctx.check(bool(decoy.decoys), "a LOAD the checker could write decoy octets for", "none")
    ctx.expect_statuses(run, ["OK", "OK"], "ALLOC_STORE and LOAD")
    back = run.output("back")
    ctx.check(back != decoy.decoys[0], "the block's data, not the decoy written before it", "the decoy")
    ctx.check(back == data, "the block's data", "other octets")


@icase("generation.rebound", "Common Header", RULE, """Generation in a request is the generation
       the initiator expects (zero means "any"); in a completion it is the entry's current
       generation.""")
async def generation_rebound(ctx: ICtx) -> None:
    """A handle stored, loaded, freed, stored again and loaded again: a request Generation,
    where one is given, is the entry's current one (the FREE and the new binding each
    moved it), so the loads of each binding return its data."""
    await ctx.serve()
    a, b = ctx.data(600, 1), ctx.data(700, 2)
    run = await ctx.run_ok("alloc_store 0 @a seal; load 0 @r1; free 0; alloc_store 0 @b seal; "
                           "load 0 @r2; free 0", {"a": a, "b": b})
    s = ctx.record.sessions[0]
    done = {rid: st for _, rid, st, _ in s.completions}
    for r in s.requests():
        ctx.check(not r["generation"] or done.get(r["request_id"]) != Status.STALE_GENERATION,
                  "a request Generation, where given, that is the entry's current one",
                  f"{OPCODES.describe(r['opcode'])} with Generation {r['generation']} answered "
                  "STALE_GENERATION")
    ctx.expect_statuses(run, ["OK"] * 6, "each operation on the handle's current binding")
    ctx.check(run.output("r1") == a and run.output("r2") == b, "each binding's own data", "other octets")


# -- Direct Load ------------------------------------------------------------------------------

DIRECT_LOAD_TEXT = """Direct Load (DIRECT_LOAD): through the read-only Table and Pool STags, the
       initiator RDMA-reads the table entry, then the block, then the entry again, issuing each
       read only after the previous one has completed."""
DIRECT_VALID_TEXT = """The data is valid if both entry reads show the same Generation with VALID
       and SEALED set, because a sealed block does not change until it is freed and a free
       changes the Generation."""


async def _direct_load(ctx: ICtx, behaviour: B.Behaviour, seal: bool = True):
    await ctx.serve(behaviour)
    data = ctx.data(2000, 1)
    run = await ctx.run_ok(f"alloc_store 1 @kv{' seal' if seal else ''}; direct_load 1 @back",
                           {"kv": data})
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_LOAD:
        ctx.skip("DIRECT_LOAD was not granted")
    if not s.reads("table"):
        ctx.skip("the initiator did not use DIRECT_LOAD (no RDMA Read of the table)")
    return run, data, s


@icase("direct_load.order", DIRECT, RULE, DIRECT_LOAD_TEXT)
async def direct_load_order(ctx: ICtx) -> None:
    behaviour = B.DirectLoadWindow()
    run, data, s = await _direct_load(ctx, behaviour)
    kinds = [a.region for a in s.reads() if a.region in ("table", "pool")]
    ctx.check(kinds[:3] == ["table", "pool", "table"], "entry, block, entry",
              ", ".join(kinds))
    entry_at = s.reads("table")[0].offset
    ctx.check(all(a.offset == entry_at for a in s.reads("table")), "both entry reads at the entry "
              "of the handle", [hex(a.offset) for a in s.reads("table")])
    ctx.check(not behaviour.overlapped, "each read issued after the previous one completed (each "
              f"answer held {B.SETTLE:g} s)", "; ".join(behaviour.overlapped))
    ctx.expect_statuses(run, ["OK", "OK"], "ALLOC_STORE and DIRECT_LOAD")
    ctx.check(run.output("back") == data, "the block's data", "other octets")


async def _window(ctx: ICtx, mode: str) -> None:
    behaviour = B.DirectLoadWindow(mode)
    run, data, s = await _direct_load(ctx, behaviour)
    ctx.check(behaviour.changed, "an entry, block, entry window whose second entry read the "
              "checker changed", "none")
    back = run.output("back")
    ctx.check(back != behaviour.decoy, f"the block read in a window whose entry {mode} changed not "
              "reported as data", "the decoy octets of that window reported as the block")
    if run.statuses()[-1:] == ["OK"]:
        ctx.check(back == data, "data reported valid only from a window whose entry reads agree",
                  "other octets")


@icase("direct_load.generation", DIRECT, RULE, DIRECT_VALID_TEXT)
async def direct_load_generation(ctx: ICtx) -> None:
    await _window(ctx, "generation")


@icase("direct_load.valid", DIRECT, RULE, DIRECT_VALID_TEXT)
async def direct_load_valid(ctx: ICtx) -> None:
    await _window(ctx, "valid")


@icase("direct_load.sealed", DIRECT, RULE, DIRECT_VALID_TEXT)
async def direct_load_sealed(ctx: ICtx) -> None:
    await _window(ctx, "sealed")


@icase("direct_load.unsealed", DIRECT, RULE, DIRECT_VALID_TEXT)
async def direct_load_unsealed(ctx: ICtx) -> None:
    """A block stored without SEAL: both entry reads agree but SEALED is not set."""
    run, data, s = await _direct_load(ctx, B.DirectLoadWindow(), seal=False)
    last = (run.statuses() or ["no result"])[-1]
    ctx.check(last != "OK" and run.output("back") is None,
              "DIRECT_LOAD of an unsealed block not reported as valid data",
              f"{last} with {len(run.output('back') or b'')} octets")


@icase("direct_load.invalid", DIRECT, RULE, DIRECT_VALID_TEXT)
async def direct_load_invalid(ctx: ICtx) -> None:
    """Both entry reads agree, with SEALED set but VALID clear, and the block they name
    holds other octets: no valid data (a LOAD instead may return the stored block)."""
    behaviour = B.EntryShown(EntryFlag.VALID)
    run, data, s = await _direct_load(ctx, behaviour)
    back = run.output("back")
    ctx.check(not behaviour.decoy or back != behaviour.decoy, "the block an entry without VALID names "
              "not reported as data", "its octets reported as the block")
    if run.statuses()[-1:] == ["OK"]:
        ctx.check(back == data, "data reported valid only as the target served it (by LOAD)",
                  "other octets")


@icase("direct_load.every_window", DIRECT, RULE, DIRECT_LOAD_TEXT)
async def direct_load_every_window(ctx: ICtx) -> None:
    """Four Direct Loads, two of each of two handles: every one reads entry, block,
    entry (the second time a handle is read as much as the first), and in the fourth
    window the block read returns decoy octets and the second entry read a moved
    Generation. The decoy must never be reported as data."""
    behaviour = B.DirectLoadWindow("generation", window=3, hold=False)
    await ctx.serve(behaviour)
    a, b = ctx.data(700, 1), ctx.data(2500, 2)
    run = await ctx.run_ok("alloc_store 0 @a seal; alloc_store 1 @b seal; direct_load 0 @r0; "
                           "direct_load 1 @r1; direct_load 0 @r2; direct_load 1 @r3", {"a": a, "b": b})
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_LOAD:
        ctx.skip("DIRECT_LOAD was not granted")
    kinds = [a.region[0] for a in s.reads() if a.region in ("table", "pool")]
    if not kinds:
        ctx.skip("the initiator did not use DIRECT_LOAD (no RDMA Read of the table)")
    text = "".join(kinds)
    ctx.check(text == "tpt" * (len(text) // 3) and len(text) >= 12, "entry, block, entry for every "
              "Direct Load (t: entry, p: block)", text)
    ctx.check(behaviour.changed, "a fourth window whose second entry read the checker changed", "none")
    ctx.check(run.output("r3") != behaviour.decoy, "the block read in the fourth window, whose "
              "Generation moved, not reported as data", "the decoy octets reported")
    # the fourth may be retried to OK or given up (the text requires no retry): never the decoy
    statuses = run.statuses()
    ctx.check(statuses[:5] == ["OK"] * 5 and len(statuses) == 6, "the stores and the first three "
              "Direct Loads OK, the fourth OK or refused", " ".join(statuses) or "no results file")
    want = [a, b, a, b] if statuses[5:] == ["OK"] else [a, b, a]
    ctx.check([run.output(f"r{i}") for i in range(len(want))] == want, "each block's data", "other octets")


@icase("direct_load.table_range", "Block Table", RULE, """The entry for handle h is at Table Offset
       + 16 * (h - Table Base Handle) within the Table STag.""")
async def direct_load_table_range(ctx: ICtx) -> None:
    """A Table descriptor that starts one handle after the initiator's range and ends one
    before its end: the handles at both ends have no entry it names. Direct Loads of
    them read nothing outside it (the initiator may use LOAD instead), and a handle
    inside is read at its own entry."""
    behaviour = B.TableWindow()
    await ctx.serve(behaviour)
    last = ctx.config.handles_per_initiator - 1
    data = [ctx.data(500, i) for i in range(3)]
    run = await ctx.run_ok(f"alloc_store 0 @a seal; alloc_store 1 @b seal; alloc_store {last} @c seal; "
                           f"direct_load 0 @ra; direct_load 1 @rb; direct_load {last} @rc",
                           dict(zip("abc", data)))
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_LOAD:
        ctx.skip("DIRECT_LOAD was not granted")
    g = s.granted
    start, count = g["hello_ack.table.offset"], g["hello_ack.table.count"]
    end = start + M.ENTRY_SIZE * count
    for a in s.reads("table"):
        ctx.check(start <= a.offset and a.offset + a.length <= end, f"Table reads inside the "
                  f"{count} entries the descriptor names ({start:#x} to {end:#x})",
                  f"{a.length} octets at {a.offset:#x}")
    inside = start + M.ENTRY_SIZE * (g["hello_ack.handle_base"] + 1 - g["hello_ack.table_base_handle"])
    ctx.check(any(a.offset == inside for a in s.reads("table")),
              f"the entry of handle 1 read at {inside:#x}", [hex(a.offset) for a in s.reads("table")])
    statuses = run.statuses()
    ctx.check(statuses[4:5] == ["OK"] and run.output("rb") == data[1], "the Direct Load of handle 1 "
              "with its data", " ".join(statuses))
    for k, name, stored in ((3, "ra", data[0]), (5, "rc", data[2])):
        if statuses[k:k + 1] == ["OK"]:
            ctx.check(run.output(name) == stored, "a handle outside the Table reported only with "
                      "its own data (by LOAD)", "other octets")


# -- Direct Allocation --------------------------------------------------------------------------

DIRECT_ALLOC_TEXT = """Direct Allocation (DIRECT_ALLOC): the initiator performs FetchAdd on its
       Head with the Add Data and Add Mask of , RDMA-reads the slot at the returned offset
       (re-reading until the Sequence equals its ticket and the Block Offset is not all ones,
       and then once more to confirm both values, since a 16-octet read is not guaranteed to be
       atomic), RDMA-writes the data into the block, and then sends BIND with the ticket, Data
       Length, and Block Offset."""


async def _direct_alloc(ctx: ICtx, behaviour: B.Behaviour | None = None, size: int = 1500, **config):
    await ctx.serve(behaviour, **config)
    data = ctx.data(size, 1)
    run = await ctx.run("direct_alloc 2 @kv; load 2 @back", {"kv": data})
    if not ctx.record.sessions or not ctx.record.sessions[0].granted_features() & Feature.DIRECT_ALLOC:
        ctx.skip("DIRECT_ALLOC was not granted")
    s = ctx.record.sessions[0]
    if not [a for a in s.accesses if a.kind == "fetch_add"]:
        ctx.skip("the initiator did not use DIRECT_ALLOC (no FetchAdd on the Head)")
    return run, data, s


@icase("direct_alloc.fetch_add", DIRECT, RULE, DIRECT_ALLOC_TEXT)
async def direct_alloc_fetch_add(ctx: ICtx) -> None:
    run, data, s = await _direct_alloc(ctx)
    n = (s.granted["hello_ack.ring.count"] - 1).bit_length()
    want: tuple[int, int | None]
    if ctx.transport == "iwarp":
        want = (RING_COUNTER.masked_add_data, add_mask(n))
    else:
        want = (RING_COUNTER.unmasked_add_data, None)
    for a in (a for a in s.accesses if a.kind == "fetch_add"):
        ctx.check(a.region == "head" and a.offset == s.granted["hello_ack.head.offset"],
                  "FetchAdd on the Head", f"{a.region} offset {a.offset:#x}")
        seen = (a.add, a.mask)
        ctx.check(seen == want, f"Add Data {want[0]:#018x}, Add Mask "
                  f"{'none (unmasked)' if want[1] is None else f'{want[1]:#018x}'}",
                  f"Add Data {a.add:#018x}, Add Mask {'none' if a.mask is None else f'{a.mask:#018x}'}")
    ctx.check(run.exit_code == 0 and run.statuses() == ["OK", "OK"] and run.output("back") == data,
              "DIRECT_ALLOC, then the data back by LOAD", " ".join(run.statuses()))


@icase("direct_alloc.slot", DIRECT, RULE, DIRECT_ALLOC_TEXT)
async def direct_alloc_slot(ctx: ICtx) -> None:
    """The slot reads show twice an old Sequence, twice Block Offset all ones, then a torn
    read (the ticket's Sequence with another block's offset), then the slot as it is."""
    reads = B.SlotReads()
    run, data, s = await _direct_alloc(ctx, reads)
    binds = s.requests("BIND")
    fetches = [a for a in s.accesses if a.kind == "fetch_add"]
    ctx.check(len(fetches) == 1, "one FetchAdd for the allocation: a slot not ready yet is read "
              "again, its ticket kept (a ticket taken is the initiator's until bound or abandoned)",
              f"{len(fetches)} FetchAdds")
    slots = {a.offset for a in s.reads("ring")}
    ctx.check(len(slots) == 1, "every read at the ticket's slot", [hex(o) for o in sorted(slots)])
    ctx.check(len(reads.shown) >= reads.untrusted + 2, "the slot read until it shows the ticket "
              f"with a block, then once more to confirm ({reads.untrusted} reads not to be trusted "
              "here, then 2 agreeing)", f"{len(reads.shown)} read(s)")
    real = reads.shown[-1][1]
    ctx.check(bool(binds) and binds[0]["bind.block_offset"] == real,
              f"BIND with the Block Offset the slot holds ({real:#x}), not the torn read's "
              f"({reads.stale:#x})", f"{binds[0]['bind.block_offset']:#x}" if binds else "no BIND")
    ctx.check(run.statuses() == ["OK", "OK"] and run.output("back") == data,
              "the data back by LOAD", " ".join(run.statuses()))


#: Head's first ticket in direct_alloc.ring_wrap: five tickets cross the end of the ring
#: and the 32-bit Ticket's wrap to 0
FIRST_TICKET = (1 << 32) - 3


@icase("direct_alloc.ring_wrap", "Free-Block Ring", RULE, """Allocation: FetchAdd on Head returns
       ticket t and offset o. The slot at o holds the block for this allocation once its Sequence
       equals t and its Block Offset is not all ones""")
async def direct_alloc_ring_wrap(ctx: ICtx) -> None:
    """Quota 6 (a ring of 8 slots, two of them empty) whose Head starts at Ticket
    2^32 - 3: five DIRECT_ALLOCs take tickets whose slots run past the end of the ring
    (on RoCEv2 "the slot is computed as 16 * (ticket mod N) by the initiator"). Each
    BIND names its ticket and the block that ticket's slot holds."""
    await ctx.serve(B.RingStart(FIRST_TICKET), quota=6)
    inputs = {f"d{i}": ctx.data(300, i) for i in range(5)}
    run = await ctx.run("; ".join([f"direct_alloc {i} @d{i}" for i in range(5)]
                                  + [f"load {i} @b{i}" for i in range(5)]), inputs)
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_ALLOC:
        ctx.skip("DIRECT_ALLOC was not granted")
    g = s.granted
    slots, first_block = g["hello_ack.ring.count"], g["hello_ack.partition.offset"]
    for i, bind in enumerate(s.requests("BIND")):
        ticket = (FIRST_TICKET + i) & 0xFFFFFFFF
        want = (ticket, first_block + i * ctx.config.block_size)
        seen = (bind["bind.ticket"], bind["bind.block_offset"])
        ctx.check(seen == want, f"BIND {i + 1} with ticket {ticket:#x} and the Block Offset "
                  f"{want[1]:#x} of its slot {ticket % slots}", f"ticket {seen[0]:#x}, Block Offset "
                  f"{seen[1]:#x}")
    ctx.check(run.exit_code == 0 and run.statuses() == ["OK"] * 10, "5 DIRECT_ALLOCs across the end of "
              "the ring, each loaded back", f"exit {run.exit_code}: {' '.join(run.statuses())}")
    ctx.check(all(run.output(f"b{i}") == inputs[f"d{i}"] for i in range(5)), "each block's data back",
              "other octets")


@icase("direct_alloc.partition_only", DIRECT, RULE, """The initiator never writes ring slots.""")
async def direct_alloc_partition_only(ctx: ICtx) -> None:
    """Every RDMA Write of the initiator goes through the Partition STag into the block
    its slot gave; no other octet of the partition changes."""
    await ctx.serve()
    target = ctx.served
    before = bytes(target.memory.pool_view)
    data = ctx.data(1500, 1)
    run = await ctx.run("direct_alloc 2 @kv", {"kv": data})
    s = ctx.record.sessions[0]
    if not s.granted_features() & Feature.DIRECT_ALLOC:
        ctx.skip("DIRECT_ALLOC was not granted")
    writes = [a for a in s.accesses if a.kind == "write"]
    for w in writes:
        ctx.check(w.region == "partition" and not w.refused, "RDMA Writes only through the Partition STag",
                  f"a Write to the {w.region} STag {w.stag:#x} at {w.offset:#x}"
                  + (f" ({w.refused})" if w.refused else ""))
    binds = s.requests("BIND")
    ctx.check(bool(binds), "a BIND", f"none ({' '.join(run.statuses())})")
    block = binds[0]["bind.block_offset"] - target.memory.pool_base
    after = bytes(target.memory.pool_view)
    changed = [i for i in range(len(after)) if after[i] != before[i]]
    outside = [i for i in changed if not block <= i < block + len(data)]
    ctx.check(not outside, f"only the octets of block {block:#x} written",
              f"{len(outside)} octets outside it, the first at {outside[0]:#x}" if outside else "")


@icase("direct_alloc.bind", DIRECT, RULE, DIRECT_ALLOC_TEXT)
async def direct_alloc_bind(ctx: ICtx) -> None:
    run, data, s = await _direct_alloc(ctx)
    binds = s.requests("BIND")
    ctx.check(bool(binds), "a BIND", "none")
    bind = binds[0]
    ctx.check(bool(s.reads("ring")), "a read of the ticket's slot", "none")
    slot = s.reads("ring")[-1]
    served = codec.decode_struct(M.RING_SLOT, slot.served, s.addr_le)
    ticket = served["slot.sequence"]
    seen = (bind["bind.ticket"], bind["bind.data_length"], bind["bind.block_offset"])
    want = (ticket, len(data), served["slot.block_offset"])
    ctx.check(seen == want, f"BIND with ticket {want[0]}, Data Length {want[1]}, Block Offset {want[2]:#x}",
              f"ticket {seen[0]}, Data Length {seen[1]}, Block Offset {seen[2]:#x}")
    base = ctx.record.sessions[0].granted["hello_ack.handle_base"]
    ctx.check(bind["handle"] == base + 2, f"BIND of handle {base + 2:#x}", f"{bind['handle']:#x}")


@icase("direct_alloc.write_order", DIRECT, RULE, DIRECT_ALLOC_TEXT)
async def direct_alloc_write_order(ctx: ICtx) -> None:
    """As each BIND lands at the target (in wire order with the RDMA Writes before it),
    the block it names already holds the data: the Writes come first, then BIND."""
    snap = B.BindSnapshot()
    run, data, s = await _direct_alloc(ctx, snap, size=3000)
    if not snap.snapshots:
        ctx.skip("no BIND seen as it landed (the checking target's RNIC is a device)")
    block, held = snap.snapshots[0]
    ctx.check(held == data, f"block {block:#x} holding the {len(data)} octets when the BIND naming "
              "it arrived", f"{sum(x != y for x, y in zip(held, data))} octets not written yet")
    ctx.expect_statuses(run, ["OK", "OK"], "DIRECT_ALLOC and the LOAD after it")


@icase("direct_alloc.ticket_timeout", QUOTAS, RULE, """A ticket that is not bound by BIND within
       the Ticket Timeout advertised in HELLO_ACK is abandoned.""")
async def direct_alloc_ticket_timeout(ctx: ICtx) -> None:
    run, data, s = await _direct_alloc(ctx, ticket_timeout_ms=1000)
    fetch = [a for a in s.accesses if a.kind == "fetch_add"][0]
    bind = [m for m in s.messages if m.decoded and m.decoded["opcode"] == Opcode.BIND]
    ctx.check(bool(bind), "a BIND", "none")
    elapsed = bind[0].at - fetch.at
    ctx.check(elapsed < 1.0, "BIND within the Ticket Timeout of 1000 ms after the FetchAdd",
              f"{elapsed * 1000:.0f} ms")


@icase("direct_alloc.abandoned", QUOTAS, RULE, """It then consumes the slot, returns the block to
       the ring with a new ticket, and rejects a later BIND for that ticket with status
       TICKET_ABANDONED.""")
async def direct_alloc_abandoned(ctx: ICtx) -> None:
    run, data, s = await _direct_alloc(ctx, B.Abandon())
    ctx.check(run.exit_code == 0, "exit status 0", f"{run.exit_code}: {run.tail()}")
    ctx.check(run.statuses()[:1] == ["TICKET_ABANDONED"], "DIRECT_ALLOC reported as TICKET_ABANDONED",
              " ".join(run.statuses()))
    ctx.check(len(s.requests("BIND")) == 1, "one BIND for the ticket (no BIND again for an "
              "abandoned ticket)", len(s.requests("BIND")))


# -- GOODBYE ------------------------------------------------------------------------------------

@icase("goodbye.release", "KBTP Opcodes", RULE, """for GOODBYE, 0x0001 RELEASE""")
async def goodbye_release(ctx: ICtx) -> None:
    """A script ending with 'goodbye release': GOODBYE with RELEASE is the last message,
    and the target releases the session (its binding is freed)."""
    await ctx.serve()
    await ctx.run_ok("alloc_store 1 @kv seal; goodbye release", {"kv": ctx.data(100, 1)})
    s = ctx.record.sessions[0]
    goodbyes = [m.decoded for m in s.messages if m.decoded and m.decoded["opcode"] == Opcode.GOODBYE]
    ctx.check(bool(goodbyes), "a GOODBYE", "the connection closed without one")
    ctx.check(bool(goodbyes[0]["flags"] & GoodbyeFlag.RELEASE), "GOODBYE with RELEASE", goodbyes[0]["flags"])
    ctx.check(s.messages[-1].decoded is goodbyes[0], "nothing sent after GOODBYE",
              OPCODES.describe(s.messages[-1].payload[1]))
    ident = bytes((s.hello or {}).get("hello.initiator_id", b""))
    ctx.check(ident not in ctx.served.sessions.by_id, "the session released (the target keeps "
              "nothing of it)", "the target still keeps it")


@icase("goodbye.retain", "KBTP Opcodes", RULE, """for GOODBYE, 0x0001 RELEASE""")
async def goodbye_retain(ctx: ICtx) -> None:
    """A script without 'goodbye release': the session ends with GOODBYE without RELEASE
    (or the connection ends), so the target keeps the bindings for a reconnection."""
    await ctx.serve()
    await ctx.run_ok("alloc_store 1 @kv seal", {"kv": ctx.data(100, 1)})
    s = ctx.record.sessions[0]
    goodbyes = [m.decoded for m in s.messages if m.decoded and m.decoded["opcode"] == Opcode.GOODBYE]
    ctx.check(not any(g["flags"] & GoodbyeFlag.RELEASE for g in goodbyes),
              "no RELEASE when the bindings are to be kept", "GOODBYE with RELEASE")
    ident = bytes((s.hello or {}).get("hello.initiator_id", b""))
    ctx.check(ident in ctx.served.sessions.by_id, "the session retained", "released")


@icase("goodbye.after_completions", "Session Establishment", RULE, """GOODBYE ends the session.
       With flag 0x0001 RELEASE, the target frees all handles bound by the initiator.""")
async def goodbye_after_completions(ctx: ICtx) -> None:
    """Every completion held 0.3 s: the GOODBYE, asked for after the operations, comes
    only once each of them has completed (the session ends with nothing outstanding),
    and each is reported with its own status."""
    await ctx.serve(B.Grant(8))
    inputs = {"a": ctx.data(300, 1), "b": ctx.data(3000, 2)}
    run = await ctx.run_ok("alloc_store 0 @a seal & alloc_store 1 @b seal; load 0 @r & free 1; "
                           "goodbye release", inputs)
    s = ctx.record.sessions[0]
    goodbyes = [m for m in s.messages if m.decoded and m.decoded["opcode"] == Opcode.GOODBYE]
    ctx.check(bool(goodbyes), "a GOODBYE", "the connection closed without one")
    ctx.check(goodbyes[0].in_flight == 0, "GOODBYE once every request has completed",
              f"{goodbyes[0].in_flight} request(s) still waiting for their completion")
    ctx.expect_statuses(run, ["OK"] * 5, "the operations, then GOODBYE")


@icase("security.single_use_stags", SECURITY, SHOULD, """The initiator exposes only the buffers
       named in its descriptors; it SHOULD use STags that are valid for a single request and
       SHOULD request INVALIDATE so that they are revoked by the completion.""")
async def security_single_use(ctx: ICtx) -> None:
    await ctx.serve()
    run = await ctx.run_ok("alloc_store 1 @kv seal noinline; load 1 @a; load 1 @b",
                           {"kv": ctx.data(2000, 1)})
    reqs = [r for r in ctx.record.sessions[0].requests() if r["opcode"] in (Opcode.LOAD, Opcode.ALLOC_STORE)]
    stags = [r["dd.stag"] for r in reqs]
    ctx.check(len(set(stags)) == len(stags), "a fresh STag per request", [hex(x) for x in stags])
    inv = RequestFlag.INVALIDATE
    ctx.check(all(r["flags"] & inv for r in reqs), "INVALIDATE requested",
              [OPCODES.describe(r["opcode"]) for r in reqs if not r["flags"] & inv])
    ctx.expect_statuses(run, ["OK"] * 3, "the store and two loads")

