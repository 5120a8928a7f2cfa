"""The model of what a correct initiator may do next: the oracle of ``kbtp fuzz --role initiator``.

It is sans-IO: it reads what the program was asked (its operation script and input
files: the intent the driver interface carries), what the checking target did (the
HELLO_ACK it granted, the answers it sent, withheld or altered, what its Reads
returned) and what the program did (its HELLO, every request as the target took it,
every one-sided access on target memory, its results and output files), and judges
every field of every request and every access against what the text and the script
leave the initiator. What it cannot predict is counted with its reason.

- HELLO: Version 1, Request ID, Handle, Generation, Status and Flags zero; an Initiator
  ID that is random-looking, new for a fresh state and the same for a kept one.
- Every request answers one operation of the script: its opcode and Block Handle
  (Handle Base + the script's offset), one request per operation (a second one is a
  retry nobody asked for), flags exactly those asked (SEAL, ALLOW_UNSEALED, RECORD when
  asked and granted, INLINE as asked and only for data within Max Inline, INVALIDATE
  only with a Data Descriptor to invalidate), descriptors of the length the operation
  needs (a store's its data, a LOAD's at least the block it loads and at most Block
  Size), a completion record slot of its own, a Generation of zero or one it was shown.
- Flow: Request IDs unique among outstanding requests; in flight never above the
  smaller of the Request Credits granted and the Completion Credits promised, a credit
  coming back only with an answer to an outstanding request; GOODBYE with RELEASE as
  the script says, after every answer that was coming, and nothing after it.
- Direct modes: FetchAdd only on an aligned Head of a possible ring, with the binding's
  Add Data and Mask, within the quota (usage: bound handles plus tickets); ring slots
  read at 16 * (ticket mod N) of a ticket it holds; the data written into the confirmed
  slot's block (two reads agreeing, Sequence its ticket, not consumed) before BIND,
  which names that ticket, block and the data's length; entry reads at the text's
  offset, a block read only where an entry read named it, and a DIRECT_LOAD reported
  OK only on entry, block, entry reads that agree, with the block's octets.
- Results: each operation reported with the status its answer carried (a status outside
  the table, or none, never as OK), a load OK only with what the script stored, and a
  session whose target kept to the protocol run to its end.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ... import codec
from ...initiator.script import UNSUPPORTED, Op, Script
from ...ring import add_mask
from ...tables import RING_COUNTER, memory as M
from ...tables.enums import OPCODES
from ...tally import Tally
from ...vocab import REQUESTS, AnyMessage, AnyStruct, EntryFlag, Feature, GoodbyeFlag, Opcode, RequestFlag, Status
from .observe import Access, Altered, Session
from .program import Run

#: the operation each opcode may answer (DIRECT_LOAD may go by LOAD where it cannot read)
ANSWERS = {Opcode.LOAD: ("load", "direct_load"), Opcode.STORE: ("store",),
           Opcode.ALLOC_STORE: ("alloc_store",), Opcode.FREE: ("free",), Opcode.BIND: ("direct_alloc",)}
DEFINED_FLAGS = sum(RequestFlag)
READY = EntryFlag.VALID | EntryFlag.SEALED
NAMES = {int(s): s.name for s in Status}

# the reasons the model cannot predict a field, named once for the report
BAD_ACK = "the HELLO_ACK was malformed on purpose: what follows is the initiator's choice"
CONTENT = "the handle's content is unknown (an answer the checker withheld or misreported)"
CHOICE = "left to the initiator (Generation it learned, INVALIDATE where allowed)"
HIDDEN = "the one-sided accesses are served out of the checker's sight"
USAGE = "the usage is unknown (an allocation answered by a status the checker misreported)"
GAVE_UP = "the run lasted as long as the program was told to give up after (a slow host)"
PARTIAL = "the program reported an operation UNSUPPORTED: the rest of the script is its choice"


@dataclass
class Finding:
    oracle: str          # the rule that fired: crash, hang, invalid_data, write_outside, flags, ...
    detail: str


@dataclass
class Planned:
    """One operation of the script and what the wire showed of it."""

    op: Op
    statement: int
    data: bytes | None                  # a store's input
    requests: list[AnyMessage] = field(default_factory=list)
    answer: int | None = None           # the status of the first request's answer
    altered: Altered | None = None
    content: bytes | None = None        # LOAD: what the handle held when it was executed
    known: bool = True                  # whether ``content`` is known
    #: DIRECT_LOAD without LOAD: the blocks read between two agreeing entry reads (None: unseen)
    windows: list[bytes] | None = None
    #: DIRECT_LOAD without LOAD: every entry read showed VALID and SEALED, and no block was read
    ready_unread: bool = False


@dataclass
class Ticket:
    taken: float
    value: int                          # the ticket (32 bits)
    slot: int                           # Tagged Offset of its slot in the Ring STag
    shown: list[tuple[int, int]] = field(default_factory=list)   # (Sequence, Block Offset) read
    written: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) into the Partition

    def confirmed(self) -> int | None:
        """The Block Offset of the last two slot reads, when both show it ready for this ticket."""
        if len(self.shown) < 2 or self.shown[-1] != self.shown[-2]:
            return None
        sequence, block = self.shown[-1]
        return block if sequence == self.value & 0xFFFFFFFF and block != M.SLOT_CONSUMED else None


def weak_id(ident: bytes) -> str | None:
    """Why an Initiator ID cannot have 128 bits of entropy, or None."""
    if not any(ident):
        return "all zero"
    if len(set(ident)) <= 2:
        return f"{len(set(ident))} distinct octet values"
    for period in (1, 2, 4, 8):
        if ident == ident[:period] * (len(ident) // period):
            return f"{period} octets repeated"
    return None


class Model:
    """Judges the runs of one case; ``content`` (handle offset -> data) and the Initiator
    IDs carry from one run of the case to the next (a kept state reconnects)."""

    def __init__(self, transport: str, inputs: dict[str, bytes], *, protocol_kept: bool,
                 earlier_ids: Iterable[bytes] = (), reads_honest: bool = False,
                 give_up: float = 0.0) -> None:
        self.transport, self.inputs = transport, inputs
        self.protocol_kept = protocol_kept      # the target kept to the protocol (bar answers it altered)
        self.reads_honest = reads_honest        # its Reads returned what memory holds
        self.give_up = give_up                  # seconds the program was told to give up after
        self.late = False                       # the run lasted about that long (a slow host)
        self.earlier_ids = set(earlier_ids)
        self.ids: list[bytes] = []
        self.content: dict[int, bytes | None] = {}      # handle offset -> data; None: unknown
        self.tally = Tally()
        self.found: list[Finding] = []
        self.tickets_taken = 0
        self.usage_known = True

    def fail(self, oracle: str, detail: str) -> None:
        if not any(f.oracle == oracle and f.detail == detail for f in self.found):
            self.found.append(Finding(oracle, detail))

    def check(self, ok: bool, field_: str, oracle: str, detail: str) -> None:
        self.tally.judge(field_)
        if not ok:
            self.fail(oracle, detail)

    # -- a run -----------------------------------------------------------------------------

    def judge_run(self, script: Script, sessions: list[Session], run: Run, *, kept_state: bool,
                  malformed_ack: bool) -> None:
        """One run of the program with ``script``: its sessions (usually one) and results."""
        plan: list[Planned] = []
        self.tickets_taken = 0
        for i, statement in enumerate(script):
            for op in statement:
                data = self.inputs.get(op.file or "") if op.name in ("store", "alloc_store",
                                                                       "direct_alloc") else None
                plan.append(Planned(op, i, data))
        for s in sessions:
            self._hello(s, kept_state)
            if malformed_ack:
                self.tally.cannot(BAD_ACK, *(f"{OPCODES.describe(r['opcode'])}" for r in s.requests()))
                continue
            SessionModel(self, s, plan).walk()
        if not malformed_ack:
            self._results(plan, run, sessions[-1].granted if sessions else {})

    def _hello(self, s: Session, kept_state: bool) -> None:
        raw = s.hello_raw
        if not raw:
            return
        head = codec.decode_header(raw.ljust(codec.HEADER_SIZE, b"\0"))
        self.check(head["version"] == 1, "HELLO.version", "hello", f"HELLO Version {head['version']}, not 1")
        for k in ("request_id", "handle", "generation", "status", "flags"):
            self.check(not head[k], f"HELLO.{k}", "hello", f"HELLO {k} {head[k]:#x}, not zero")
        hello = s.hello or {}
        self.check(hello.get("hello.completion_credits", 0) > 0, "HELLO.completion_credits", "hello",
                   "HELLO with Completion Credits 0")
        ident = bytes(hello.get("hello.initiator_id", b""))
        if not ident:
            return
        why = weak_id(ident)
        self.check(why is None, "HELLO.initiator_id", "initiator_id",
                   f"Initiator ID {ident.hex()}: {why}, not 128 bits of entropy")
        if self.ids and kept_state:
            self.check(ident == self.ids[0], "HELLO.initiator_id", "initiator_id",
                       f"Initiator ID {ident.hex()} on reconnection with the state that held "
                       f"{self.ids[0].hex()}")
        elif ident not in self.ids:
            value = int.from_bytes(ident, "big")
            near = [e for e in self.earlier_ids | set(self.ids)
                    if abs(int.from_bytes(e, "big") - value) < 1 << 64]
            self.check(not near, "HELLO.initiator_id", "initiator_id",
                       f"Initiator ID {ident.hex()} of a fresh state equal or near to an earlier "
                       f"initiator's {near[0].hex() if near else ''} (a counter, a clock or a fixed ID)")
        self.ids.append(ident)

    def _quota(self, plan: list[Planned], reported: list[tuple[str, str, str]], grant: Any) -> None:
        """The script replayed with the statuses reported: a DIRECT_ALLOC within the quota
        must take a ticket (an initiator must not refuse it by itself)."""
        if not grant.get("hello_ack.features", 0) & Feature.DIRECT_ALLOC or not self.usage_known:
            return
        quota, usage, due = grant.get("hello_ack.allocation_quota", 0), 0, 0
        for p, (_, _, status) in zip(plan, reported):
            if p.op.name == "direct_alloc" and usage < quota:
                due += 1
            if status == "OK" and p.op.name in ("alloc_store", "direct_alloc"):
                usage += 1
            elif status == "OK" and p.op.name == "free":
                usage = max(0, usage - 1)
        self.check(self.tickets_taken >= due, "fetch_add.quota", "quota",
                   f"{self.tickets_taken} ticket(s) taken where {due} DIRECT_ALLOC(s) came within "
                   "the quota (usage replayed from the results): one was refused by the initiator itself")

    def _results(self, plan: list[Planned], run: Run, grant: Any) -> None:
        """Each operation's reported status and data against what its answers carried."""
        reported = run.results
        self.late = bool(self.give_up) and run.seconds >= 0.8 * self.give_up
        if any(status == UNSUPPORTED for _, _, status in reported):
            self.tally.cannot(PARTIAL, "result")
            return
        for i, (p, line) in enumerate(zip(plan, reported)):
            name, _, status = line
            self.check(name == p.op.name, "result", "results", f"result line {i + 1} is {name!r}, "
                       f"the script's operation is {p.op.name!r}")
            if p.op.name == "goodbye":
                break
            self._result(p, status, run)
        ops = len(plan)
        goodbye = next((i for i, p in enumerate(plan) if p.op.name == "goodbye"), None)
        if goodbye is not None:
            ops = goodbye + 1
        if self.protocol_kept and self.late and (run.exit_code != 0 or len(reported) < ops):
            self.tally.cannot(GAVE_UP, "result")
        elif self.protocol_kept:
            self._quota(plan, reported, grant)
            self.check(run.exit_code == 0 and len(reported) >= ops, "result", "completeness",
                       f"exit status {run.exit_code} with {len(reported)} of {ops} results, from a "
                       f"target that kept to the protocol: {run.tail()}")

    def _result(self, p: Planned, status: str, run: Run) -> None:
        op = p.op
        if p.altered is Altered.LENGTH_LIE:
            self.check(status != "OK", "result", "result_status", f"{op} reported OK, its answer "
                       "carried a Data Length past the buffer its request named")
            return
        if op.name == "direct_load" and not p.requests:
            self._direct_load(p, status, run)
            return
        if p.answer is None:
            sent = "sent, never answered" if p.requests else "never sent"
            self.check(status != "OK", "result", "result_status",
                       f"{op} reported OK, its request {sent}")
            return
        if self.late and status not in ("OK", NAMES.get(p.answer, "")):
            self.tally.cannot(GAVE_UP, "result")
            return
        if p.answer in NAMES:
            self.check(status == NAMES[p.answer], "result", "result_status",
                       f"{op} reported {status}, its answer carried {NAMES[p.answer]}")
        else:
            self.check(status != "OK", "result", "result_status",
                       f"{op} reported OK, its answer carried status {p.answer:#x}, no status of the table")
        if status != "OK" or op.name not in ("load", "direct_load") or not op.file:
            return
        if not p.known:
            self.tally.cannot(CONTENT, "result.data")
            return
        got = run.output(op.file)
        want = p.content
        self.check(want is not None and got == want, "result.data", "invalid_data",
                   f"{op} reported OK with {len(got or b'')} octets that are not the "
                   f"{len(want) if want is not None else 0} stored")


    def _direct_load(self, p: Planned, status: str, run: Run) -> None:
        """OK only with the octets of a block read between two entry reads that agree; and,
        where the target served its entries as they are, not a failure on entries that all
        showed the block ready without reading it."""
        if status != "OK":
            if self.reads_honest:
                self.check(not p.ready_unread, "result", "direct_load",
                           f"{p.op} reported {status} without reading the block, though every entry "
                           "read showed it VALID and SEALED (entries are in the session's byte order)")
            return
        if p.windows is None:
            self.tally.cannot(HIDDEN, "result.data")
            return
        got = run.output(p.op.file or "")
        self.check(bool(p.windows), "result", "direct_load", f"{p.op} reported OK without an entry "
                   "read, a block read and a second entry read that agree (VALID, SEALED, Generation)")
        if p.windows:
            self.check(got in p.windows, "result.data", "invalid_data",
                       f"{p.op} reported OK with {len(got or b'')} octets no agreeing block read returned")


class SessionModel:
    """Walks one session's events in time order: requests, accesses, answers."""

    def __init__(self, model: Model, s: Session, plan: list[Planned]) -> None:
        self.m, self.s, self.plan = model, s, plan
        g: Any = s.granted
        self.g = g
        self.base = g.get("hello_ack.handle_base", 0)
        self.features = g.get("hello_ack.features", 0)
        hello = s.hello or {}
        self.credits = min(g.get("hello_ack.request_credits", 0),
                           hello.get("hello.completion_credits", 0xFFFF))
        self.outstanding: dict[int, tuple[AnyMessage, Planned | None]] = {}
        self.answers = {rid: status for _, rid, status, _ in s.completions}
        self.tickets: dict[int, Ticket] = {}
        self.bound_blocks: set[int] = set()
        self.usage: int | None = 0
        self.entries: dict[int, tuple[AnyStruct, Access | None]] = {}   # table offset -> last read
        self.windows: dict[int, list[bytes]] = {}       # handle -> blocks read inside agreeing reads
        self.shown: dict[int, list[bool]] = {}          # handle -> whether each entry read was ready
        self.read_blocks: set[int] = set()              # handles whose block was read
        self.goodbye = False

    def walk(self) -> None:
        s = self.s
        if s.hidden:
            self.m.tally.cannot(HIDDEN, "access")
            self.m.usage_known = False
            accesses: list[Access] = []
        else:
            accesses = s.observed
        events: list[tuple[float, int, Any]] = [(m.at, 0, m) for m in s.messages]
        events += [(a.at, 1, a) for a in accesses]
        events += [(t, 2, (rid, status)) for t, rid, status, _ in s.completions]
        for _, kind, what in sorted(events, key=lambda e: (e[0], e[1])):
            if kind == 0:
                self.message(what)
            elif kind == 1:
                self.access(what)
            else:
                self.answered(*what)
        for rule, detail in s.noted:
            self.m.fail(rule, detail)
        for p in self.plan:
            if p.op.name == "direct_load" and not p.requests:
                self.direct_load_result(p)

    # -- messages ----------------------------------------------------------------------------

    def message(self, msg: Any) -> None:
        m, d = self.m, msg.decoded
        if d is not None and d["opcode"] == Opcode.HELLO:
            return
        m.check(not self.goodbye, "message", "goodbye", "a message after GOODBYE")
        if d is None:
            m.fail("malformed", f"a message the target cannot parse: {msg.payload[:24].hex()}")
            return
        if d["opcode"] == Opcode.GOODBYE:
            self.goodbye_(d)
            return
        if d["opcode"] not in REQUESTS:
            m.fail("malformed", f"an initiator message of opcode {OPCODES.describe(d['opcode'])}")
            return
        self.request(d)

    def goodbye_(self, d: AnyMessage) -> None:
        m = self.m
        self.goodbye = True
        said = next((p for p in self.plan if p.op.name == "goodbye"), None)
        release = said is not None and "release" in said.op.words
        m.check(bool(d["flags"] & GoodbyeFlag.RELEASE) == release, "GOODBYE.flags", "goodbye",
                f"GOODBYE flags {d['flags']:#x} where the script said "
                f"{'goodbye release' if release else 'goodbye' if said else 'nothing (no RELEASE)'}")
        m.check(not d["flags"] & ~GoodbyeFlag.RELEASE, "GOODBYE.flags", "goodbye",
                f"GOODBYE flags {d['flags']:#x}: undefined bits")
        coming = [rid for rid in self.outstanding if self.s.altered.get(rid) is not Altered.WITHHELD]
        m.check(not coming, "GOODBYE.order", "goodbye",
                f"GOODBYE while {len(coming)} request(s) were in flight whose answers were coming "
                f"(Request IDs {', '.join(map(str, coming[:4]))})")

    def request(self, d: AnyMessage) -> None:
        m, name = self.m, OPCODES.describe(d["opcode"])
        rid = d["request_id"]
        m.check(d["version"] == 1, f"{name}.version", "header", f"{name} Version {d['version']}")
        m.check(not d["status"], f"{name}.status", "header", f"{name} with Status {d['status']}")
        m.check(rid not in self.outstanding, f"{name}.request_id", "request_id",
                f"{name} Request ID {rid} of a request still outstanding")
        m.check(len(self.outstanding) < self.credits, f"{name}.credits", "credits",
                f"{name} sent with {len(self.outstanding)} request(s) in flight, "
                f"{self.credits} credit(s) granted (the smaller of Request and Completion Credits)")
        p = self.match(d, name)
        self.outstanding[rid] = (d, p)
        if p is None:
            return
        if len(p.requests) == 1:
            p.answer, p.altered = self.answers.get(rid), self.s.altered.get(rid)
        self.fields(d, name, p)
        self.executed(d, p)

    def match(self, d: AnyMessage, name: str) -> Planned | None:
        """The operation ``d`` answers: the first of its kind in script order not sent yet,
        with its Block Handle where one has it."""
        ops = ANSWERS[Opcode(d["opcode"])]
        free = [p for p in self.plan if p.op.name in ops and not p.requests]
        same = [p for p in free if self.base + (p.op.handle or 0) == d["handle"]]
        same.sort(key=lambda p: p.op.name != ops[0])      # a DIRECT_LOAD's LOAD only where no load waits
        p = same[0] if same else None
        if p is None:
            self.m.tally.judge(f"{name}.handle")
            again = [q for q in self.plan if q.op.name in ops and self.base + (q.op.handle or 0) == d["handle"]]
            if again:
                self.m.fail("retry", f"{name} of handle {d['handle']:#x} again: a request for "
                            f"'{again[0].op}' the script did not ask for (a retry)")
            elif free:
                self.m.fail("handle", f"{name} of Block Handle {d['handle']:#x} where the script "
                            f"asked {free[0].op} (handle {self.base + (free[0].op.handle or 0):#x})")
            else:
                self.m.fail("retry", f"{name} of handle {d['handle']:#x}: no operation of the "
                            "script asked for it")
            return None
        p.requests.append(d)
        self.m.tally.judge(f"{name}.handle")
        return p

    def fields(self, d: AnyMessage, name: str, p: Planned) -> None:
        m, op, flags = self.m, p.op, d["flags"]
        f = f"{name}.flags"
        m.check(not flags & ~DEFINED_FLAGS or d["opcode"] == Opcode.BIND, f, "flags",
                f"{name} flags {flags:#x}: undefined bits")
        self.generation(d, name)
        if d["opcode"] == Opcode.BIND:
            m.check(not flags, f, "flags", f"BIND flags {flags:#x}")
            self.bind(d, p)
            return
        record = "record" in op.words and bool(self.features & Feature.RECORD_COMPLETION)
        m.check(bool(flags & RequestFlag.RECORD) == record, f, "flags",
                f"{name} for '{op}' {'without' if record else 'with'} RECORD "
                f"(asked: {'record' in op.words}, granted: {bool(self.features & Feature.RECORD_COMPLETION)})")
        if flags & RequestFlag.RECORD:
            self.record(d, name)
        if d["opcode"] == Opcode.FREE:
            m.check(not flags & ~RequestFlag.RECORD, f, "flags", f"FREE for '{op}' with flags "
                    f"{flags:#x} (INVALIDATE, SEAL, INLINE or ALLOW_UNSEALED on a FREE)")
            return
        if d["opcode"] == Opcode.LOAD:
            unsealed = "unsealed" in op.words
            m.check(bool(flags & RequestFlag.ALLOW_UNSEALED) == unsealed, f, "flags",
                    f"LOAD for '{op}' {'without' if unsealed else 'with'} ALLOW_UNSEALED")
            m.check(not flags & (RequestFlag.SEAL | RequestFlag.INLINE), f, "flags",
                    f"LOAD for '{op}' with flags {flags:#x} (SEAL or INLINE)")
            self.invalidate(d, name, has_stag=True)
            self.load_descriptor(d, p)
            return
        seal = "seal" in op.words
        m.check(bool(flags & RequestFlag.SEAL) == seal, f, "flags",
                f"{name} for '{op}' {'without' if seal else 'with'} SEAL")
        m.check(not flags & RequestFlag.ALLOW_UNSEALED, f, "flags", f"{name} with ALLOW_UNSEALED")
        inline = bool(flags & RequestFlag.INLINE)
        self.invalidate(d, name, has_stag=not inline)
        self.store_descriptor(d, name, p, inline)

    def generation(self, d: AnyMessage, name: str) -> None:
        shown = set(self.s.generations.values()) | {e["entry.generation"] for e, _ in self.entries.values()}
        if d["generation"] and d["generation"] in shown:
            self.m.tally.cannot(CHOICE, f"{name}.generation")
            return
        self.m.check(not d["generation"], f"{name}.generation", "generation",
                     f"{name} with Generation {d['generation']}, never shown to the initiator "
                     "(zero means any)")

    def invalidate(self, d: AnyMessage, name: str, *, has_stag: bool) -> None:
        if d["flags"] & RequestFlag.INVALIDATE:
            self.m.check(has_stag, f"{name}.flags", "flags",
                         f"{name} with INVALIDATE and no Data Descriptor STag to invalidate")
        else:
            self.m.tally.cannot(CHOICE, f"{name}.flags.invalidate")

    def record(self, d: AnyMessage, name: str) -> None:
        m = self.m
        m.check(d.get("cd.stag", 0) != 0, f"{name}.cd", "record", f"{name} with RECORD and Completion "
                "Descriptor STag 0")
        m.check(not d.get("cd.reserved", 0), f"{name}.cd", "record", f"{name} Completion Descriptor "
                "reserved octets not zero")
        slot = (d.get("cd.stag"), d.get("cd.offset"))
        same = [rid for rid, (o, _) in self.outstanding.items() if rid != d["request_id"]
                and o["flags"] & RequestFlag.RECORD and (o.get("cd.stag"), o.get("cd.offset")) == slot]
        m.check(not same, f"{name}.cd", "record", f"{name} names the completion record slot "
                f"{slot[0]:#x}+{slot[1]:#x} of the outstanding request {same[:1]}")

    def load_descriptor(self, d: AnyMessage, p: Planned) -> None:
        m, size = self.m, self.g.get("hello_ack.block_size", 0)
        length = d["dd.length"]
        m.check(d["dd.stag"] != 0, "LOAD.dd", "descriptor", "LOAD Data Descriptor STag 0")
        m.check(0 < length <= size, "LOAD.dd.length", "descriptor",
                f"LOAD Data Descriptor Length {length}, Block Size {size}")
        held = self.m.content.get(p.op.handle or 0)
        if held is not None:
            m.check(length >= len(held), "LOAD.dd.length", "descriptor",
                    f"LOAD for '{p.op}' with a {length}-octet buffer: the block holds {len(held)}")
        else:
            m.tally.cannot(CONTENT, "LOAD.dd.length")

    def store_descriptor(self, d: AnyMessage, name: str, p: Planned, inline: bool) -> None:
        m, op, data = self.m, p.op, p.data or b""
        w, max_inline = op.words, self.g.get("hello_ack.max_inline", 0)
        m.check(not (inline and "noinline" in w), f"{name}.flags", "flags", f"{name} INLINE for '{op}'")
        m.check(inline or not ("inline" in w and len(data) <= max_inline), f"{name}.flags", "flags",
                f"{name} for '{op}' not INLINE ({len(data)} octets, Max Inline {max_inline})")
        m.check(not inline or len(data) <= max_inline, f"{name}.flags", "flags",
                f"{name} INLINE with {len(data)} octets, Max Inline {max_inline}")
        m.check(d["dd.length"] == len(data), f"{name}.dd.length", "descriptor",
                f"{name} Data Descriptor Length {d['dd.length']} for {len(data)} octets of data")
        if inline:
            m.check(d["dd.stag"] == 0 and d["dd.offset"] == 0, f"{name}.dd", "descriptor",
                    f"{name} INLINE with STag {d['dd.stag']:#x}, Tagged Offset {d['dd.offset']:#x}")
            m.check(bytes(d.get("inline_data", b"")) == data, f"{name}.inline_data", "descriptor",
                    f"{name} inline data that is not the script's {len(data)} octets")
        else:
            m.check(d["dd.stag"] != 0, f"{name}.dd", "descriptor", f"{name} Data Descriptor STag 0")

    # -- what the target executed ------------------------------------------------------------

    def executed(self, d: AnyMessage, p: Planned) -> None:
        """The model's content of the handle, as the target (in order) executed ``d``."""
        h = p.op.handle or 0
        status, altered = self.answers.get(d["request_id"]), self.s.altered.get(d["request_id"])
        if d["opcode"] == Opcode.LOAD:
            held = self.m.content.get(h)
            p.content, p.known = held, h not in self.m.content or held is not None
            return
        if altered in (Altered.MISREPORTED, Altered.WITHHELD) or status is None:
            if altered is not Altered.NOT_EXECUTED:
                self.m.content[h] = None        # executed or not: the model cannot tell
            return
        if status:
            return
        if d["opcode"] == Opcode.FREE:
            self.m.content.pop(h, None)
        else:
            self.m.content[h] = p.data

    def answered(self, rid: int, status: int) -> None:
        """An answer to an outstanding request: its credit back, the usage it changes."""
        sent = self.outstanding.pop(rid, None)
        if sent is None:
            return
        d, _ = sent
        ticket = self.tickets.pop(d["bind.ticket"] & 0xFFFFFFFF, None) if d["opcode"] == Opcode.BIND else None
        if self.s.altered.get(rid) is Altered.MISREPORTED:
            self.usage, self.m.usage_known = None, False
        if self.usage is None:
            return
        if d["opcode"] == Opcode.ALLOC_STORE and not status:
            self.usage += 1
        elif ticket is not None and status:
            self.usage -= 1              # the target reclaims the ticket of a failed BIND
        elif d["opcode"] == Opcode.FREE and not status:
            self.usage = max(0, self.usage - 1)

    # -- one-sided accesses --------------------------------------------------------------------

    def desc(self, key: str) -> tuple[int, int, int] | None:
        g = self.g
        if f"hello_ack.{key}.stag" not in g:
            return None
        return g[f"hello_ack.{key}.stag"], g[f"hello_ack.{key}.offset"], g[f"hello_ack.{key}.count"]

    def access(self, a: Access) -> None:
        m = self.m
        where = f"an RDMA {a.kind} of {a.length} octets at {a.offset:#x} of the {a.region} STag {a.stag:#x}"
        if a.duplicate:
            return
        m.check(not a.refused, f"{a.kind}.{a.region}", "access_outside", f"{where} ({a.refused})")
        if a.refused:
            return
        if a.kind == "fetch_add":
            self.fetch_add(a, where)
        elif a.kind == "write":
            self.write(a, where)
        elif a.region == "ring":
            self.ring_read(a, where)
        elif a.region == "table":
            self.entry_read(a, where)
        elif a.region == "pool":
            self.block_read(a, where)
        else:
            m.check(False, f"read.{a.region}", "access", f"{where}: no operation reads there")

    def fetch_add(self, a: Access, where: str) -> None:
        m = self.m
        head, ring, part = self.desc("head"), self.desc("ring"), self.desc("partition")
        m.check(a.region == "head" and head is not None and a.offset == head[1], "fetch_add.head",
                "fetch_add", f"{where}: not the Head the HELLO_ACK named")
        if head is None or ring is None or part is None:
            return
        slots, blocks = ring[2], part[2]
        m.check(head[1] % 8 == 0 and slots > 0 and not slots & (slots - 1) and slots >= blocks > 0,
                "fetch_add.head", "fetch_add", f"{where} on descriptors that are no ring: Head at "
                f"{head[1]:#x}, {slots} slots, {blocks} blocks")
        if not slots or slots & (slots - 1):
            return
        n = (slots - 1).bit_length()
        if self.m.transport == "iwarp":
            ok = a.add == RING_COUNTER.masked_add_data and a.mask == add_mask(n)
            want = f"Add Data {RING_COUNTER.masked_add_data:#x}, Add Mask {add_mask(n):#x}"
        else:
            ok = a.add == RING_COUNTER.unmasked_add_data and a.mask is None
            want = f"Add Data {RING_COUNTER.unmasked_add_data:#x}, no mask"
        m.check(ok, "fetch_add.add", "fetch_add", f"FetchAdd with Add Data {a.add:#x}, Add Mask "
                f"{a.mask if a.mask is None else hex(a.mask)}; the binding's is {want}")
        if self.usage is None:
            m.tally.cannot(USAGE, "fetch_add.quota")
        else:
            quota = self.g.get("hello_ack.allocation_quota", 0)
            m.check(self.usage + 1 <= quota, "fetch_add.quota", "quota",
                    f"a ticket taken with {self.usage} of the quota of {quota} in use (handles bound "
                    "plus tickets taken and not bound)")
            self.usage += 1
        self.m.tickets_taken += 1
        value = int.from_bytes(a.served, "big") >> RING_COUNTER.ticket_shift if a.served else 0
        self.tickets[value] = Ticket(a.at, value, ring[1] + M.SLOT_SIZE * (value % slots))

    def ring_read(self, a: Access, where: str) -> None:
        ticket = next((t for t in self.tickets.values() if t.slot == a.offset), None)
        self.m.check(ticket is not None and a.length == M.SLOT_SIZE, "read.ring", "ring",
                     f"{where}: not the slot 16 * (ticket mod N) of a ticket the initiator holds "
                     f"(tickets {sorted(self.tickets)[:4]})")
        if ticket is not None and a.length == M.SLOT_SIZE:
            slot = codec.decode_struct(M.RING_SLOT, a.served, self.s.addr_le)
            ticket.shown.append((slot["slot.sequence"], slot["slot.block_offset"]))

    def write(self, a: Access, where: str) -> None:
        m = self.m
        m.check(a.region == "partition", f"write.{a.region}", "write_outside",
                f"{where}: an initiator writes only through the Partition STag")
        if a.region != "partition":
            return
        size = self.g.get("hello_ack.block_size", 0)
        owner = next((t for t in self.tickets.values() if (b := t.confirmed()) is not None
                      and b <= a.offset and a.offset + a.length <= b + size), None)
        m.check(owner is not None, "write.partition", "direct_alloc",
                f"{where}: not inside the block of a slot confirmed for a ticket it holds")
        if owner is not None:
            owner.written.append((a.offset, a.length))

    def bind(self, d: AnyMessage, p: Planned) -> None:
        m, data = self.m, p.data or b""
        ticket = self.tickets.get(d["bind.ticket"] & 0xFFFFFFFF)
        if self.s.hidden:
            m.tally.cannot(HIDDEN, "BIND.ticket", "BIND.block_offset")
        else:
            m.check(ticket is not None and d["bind.ticket"] >> 32 == 0, "BIND.ticket", "bind",
                    f"BIND of ticket {d['bind.ticket']:#x}, not one the initiator took and holds")
        m.check(d["bind.data_length"] == len(data), "BIND.data_length", "bind",
                f"BIND Data Length {d['bind.data_length']} for '{p.op}' of {len(data)} octets")
        if ticket is None:
            return
        block = ticket.confirmed()
        m.check(block is not None and d["bind.block_offset"] == block, "BIND.block_offset", "bind",
                f"BIND Block Offset {d['bind.block_offset']:#x}; the slot reads confirmed "
                f"{'none' if block is None else hex(block)} (reads {ticket.shown[-3:]})")
        written = sorted(ticket.written)
        covered = sum(n for _, n in written)
        m.check(covered == len(data) and (not written or written[0][0] == d["bind.block_offset"]),
                "BIND.order", "direct_alloc", f"BIND for '{p.op}' after {covered} octets written "
                f"into its block (data {len(data)}): the data is written before BIND, and only it")
        self.bound_blocks.add(d["bind.block_offset"])

    def entry_read(self, a: Access, where: str) -> None:
        m, table = self.m, self.desc("table")
        tbh = self.g.get("hello_ack.table_base_handle", 0)
        index = (a.offset - table[1]) // M.ENTRY_SIZE if table else -1
        handle = tbh + index
        asked = {self.base + (p.op.handle or 0) for p in self.plan if p.op.name == "direct_load"}
        ok = (table is not None and a.length == M.ENTRY_SIZE and (a.offset - table[1]) % M.ENTRY_SIZE == 0
              and 0 <= index < table[2] and handle in asked)
        m.check(ok, "read.table", "direct_load", f"{where}: not the entry (Table Offset + 16 * "
                f"(h - Table Base Handle)) of a handle the script loads directly")
        if not ok:
            return
        entry = codec.decode_struct(M.TABLE_ENTRY, a.served, self.s.addr_le)
        self.shown.setdefault(handle, []).append(entry["entry.flags"] & READY == READY)
        before = self.entries.get(a.offset)
        if before is not None:
            first, block = before
            if block is not None and first == entry and entry["entry.flags"] & READY == READY:
                self.windows.setdefault(handle, []).append(block.served)
        self.entries[a.offset] = (entry, None)

    def block_read(self, a: Access, where: str) -> None:
        named = [off for off, (e, block) in self.entries.items() if block is None
                 and e["entry.flags"] & READY == READY and e["entry.block_offset"] == a.offset
                 and e["entry.data_length"] == a.length]
        self.m.check(bool(named), "read.pool", "direct_load",
                     f"{where}: no entry read just before it named that block and length with VALID "
                     "and SEALED (entries are read in the session's byte order)")
        tbh, table = self.g.get("hello_ack.table_base_handle", 0), self.desc("table")
        for off in named[:1]:
            self.entries[off] = (self.entries[off][0], a)
            self.read_blocks.add(tbh + (off - (table[1] if table else 0)) // M.ENTRY_SIZE)

    def direct_load_result(self, p: Planned) -> None:
        """A DIRECT_LOAD that sent no LOAD: the blocks read inside agreeing entry reads."""
        if not self.s.hidden:
            handle = self.base + (p.op.handle or 0)
            p.windows = (p.windows or []) + self.windows.get(handle, [])
            shown = self.shown.get(handle, [])
            p.ready_unread = bool(shown) and all(shown) and handle not in self.read_blocks
