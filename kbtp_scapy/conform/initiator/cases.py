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
from ...vocab import EntryFlag, Feature, GoodbyeFlag, Opcode, RequestFlag, Status
from ..registry import MUST, MUST_NOT, RULE, SHOULD
from . import behaviours as B
from .context import ICtx, icase

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
    ctx.check(bool(s.messages) and s.messages[0].payload[1:2] == bytes([Opcode.HELLO]),
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


def _weak(ident: bytes) -> str | None:
    if not any(ident):
        return "all zero"
    if len(set(ident)) <= 2:
        return f"{len(set(ident))} distinct octet values"
    return None


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
        why = _weak(ident)
        ctx.check(why is None, "an Initiator ID of random octets", f"{ident.hex()} ({why})")
    values = sorted(int.from_bytes(i, "big") for i in ids)
    for a, b in zip(values, values[1:]):
        ctx.check(b - a >= 1 << 64, "Initiator IDs far apart (not a counter or a clock)",
                  f"{a:032x} and {b:032x} differ by {b - a}")
    shared = [k for k in range(16) if len({i[k] for i in ids}) == 1]
    ctx.check(len(shared) < 8, "Initiator IDs sharing no long run of octets",
              f"octets {shared} equal in all four")


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
              f"{grant}, completions held {B.SETTLE:g} s)", f"{s.max_in_flight} in flight")
    ctx.expect_statuses(run, ["OK"] * 5, "5 ALLOC_STOREs, eventually")


CREDITS = """A target pre-posts, for each request credit, a receive buffer followed by a chain of
       work requests that its RDMA interface starts when the receive completes."""


@icase("credits.one", "Target Execution Model", RULE, CREDITS)
async def credits_one(ctx: ICtx) -> None:
    await _credits(ctx, 1)


@icase("credits.two", "Target Execution Model", RULE, CREDITS)
async def credits_two(ctx: ICtx) -> None:
    await _credits(ctx, 2)


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
    ctx.check(worst <= 3, "usage (handles bound plus tickets taken and not bound) never above "
              "the quota of 3", f"{worst} at the worst")
    statuses = run.statuses()
    ctx.check(len(statuses) == 10 and statuses[3] != "OK" and statuses[6] != "OK",
              "the allocations past the quota (the fourth, and the one after the FREE's "
              "replacement) reported as failed", " ".join(statuses))
    ctx.check(statuses[5] == "OK" and statuses[9] == "OK", "the DIRECT_ALLOCs after a FREE (usage "
              "2 of 3, then 1 of 3) not refused", " ".join(statuses))


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

