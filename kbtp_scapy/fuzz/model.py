"""The model of what a target must answer: the expected outcome of every request.

The fuzzer keeps what the wire showed of each handle it used (bound or not, Generation,
sealed, Data Length, content, Block Offset), its quota use and its tickets. From that
and a request, ``expect`` lists the checks of the text ("Operations": range, lengths,
Generation, then the operation's own, and "Direct Modes" for BIND), each known to pass,
known to fail or unknown, and what an OK must carry. ``judge`` then holds a completion
to it where the text leaves the target no choice:

- when a check is known to fail, only the statuses of failing or unknown checks ("a
  failed check completes the request with the corresponding status"); otherwise OK, or
  the status of an unknown check;
- an OK carries the entry's Generation (after a bind or free the next one, "incremented
  by one, skipping zero", never zero), a LOAD the entry's Data Length and Block Offset
  and the block as stored, an allocation a block of the pool bound to no other handle;
- a refusal carries the entry's current Generation;
- the form: a completion record for RECORD when RECORD_COMPLETION was granted, else a
  COMPLETION Send, with Invalidate of the Data Descriptor's STag for INVALIDATE;
- the header: the Request ID and (in a Send) the Block Handle echoed in full width, the
  reserved octets zero.

Every field of the answer is counted in a ``Tally``: judged, or not predicted and why.

Where the text leaves a choice (the order of the checks, the status of a BIND the ring
does not back, refusing odd but parseable requests as MALFORMED) every choice passes.
``learn`` then updates the model from the answer. The fuzzer's own arithmetic is used
throughout, never the reference target's: an oracle must not share the code it judges.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..initiator.direct import ABANDONED_AFTER
from ..initiator.results import TargetInfo
from ..tables.enums import OPCODES, STATUS
from ..vocab import REQUESTS, AnyMessage, Feature, Opcode, RequestFlag, Status
from .findings import Finding
from .tally import (
    FOREIGN,
    NEVER_SHOWN,
    NO_ENTRY_LOOKED,
    NO_FLAGS,
    NOT_FIXED_OK,
    NOT_FIXED_REFUSAL,
    UNKNOWN_DATA,
    UNKNOWN_ENTRY,
    UNPARSED,
    Tally,
)

FLAGGED = (Opcode.LOAD, Opcode.STORE, Opcode.ALLOC_STORE, Opcode.FREE)  # the request flags apply to these
MEANINGLESS: dict[int, int] = {
    Opcode.LOAD: RequestFlag.INLINE | RequestFlag.SEAL, Opcode.STORE: RequestFlag.ALLOW_UNSEALED,
    Opcode.ALLOC_STORE: RequestFlag.ALLOW_UNSEALED,
    Opcode.FREE: RequestFlag.INLINE | RequestFlag.SEAL | RequestFlag.INVALIDATE | RequestFlag.ALLOW_UNSEALED}
DEFINED_FLAGS = sum(RequestFlag)
GRACE = 0.5     # seconds a target may take, beyond the Ticket Timeout, to notice a ticket


def is_block(offset: int, base: int, count: int, size: int) -> bool:
    """Whether ``offset`` is the first octet of one of ``count`` blocks of ``size`` octets
    from ``base``: Block Offsets are Tagged Offsets of the Pool STag, and the Partition and
    the ring offer blocks of the pool."""
    return (offset - base) % size == 0 and 0 <= offset - base < count * size


def next_generation(generation: int) -> int:
    """One more, skipping zero."""
    return generation % 0xFFFF + 1


@dataclass(frozen=True)
class Entry:
    """A table entry as the wire showed it; None where it did not."""

    bound: bool | None = None
    generation: int | None = None
    sealed: bool | None = None
    length: int | None = None
    data: bytes | None = None
    block: int | None = None
    seen: str = ""            # the answer that showed it, for findings


UNKNOWN = Entry()


@dataclass
class Ticket:
    block: int
    taken: float      # just before its FetchAdd went out
    seen: float       # when the FetchAdd came back


class Knowledge:
    """One session's range, quota use and tickets as the wire showed them.

    A handle of the range that no request of ours touched is unbound: a fresh range
    holds no binding, and a resumed one only those its own session made."""

    def __init__(self, base: int, count: int) -> None:
        self.base, self.count = base, count
        self.entries: dict[int, Entry] = {}
        self.tickets: dict[int, Ticket] = {}       # taken, slot read, not bound
        self.lost: dict[int, Ticket] = {}          # abandoned, or their fate unknown
        self.next_ticket = 0
        self.touched: set[int] = set()             # handles set since the oracles last looked
        self.spoiled = False                       # Head moved by a FetchAdd of ours gone wrong

    def owns(self, handle: int) -> bool:
        return self.base <= handle < self.base + self.count

    def entry(self, handle: int) -> Entry:
        known = self.entries.get(handle)
        if known is not None:
            return known
        return Entry(bound=False) if self.owns(handle) else UNKNOWN

    def set(self, handle: int, entry: Entry) -> None:
        if self.owns(handle):
            self.entries[handle] = entry
            self.touched.add(handle)

    def forget(self, handle: int) -> None:
        self.set(handle, UNKNOWN)

    def usage(self, now: float, timeout: float) -> tuple[int, float]:
        """Bounds of the quota use the target must count: handles bound plus tickets
        taken and not bound ("Allocation Quotas"); a ticket may have been reclaimed
        once its Ticket Timeout has passed."""
        bound = sum(1 for e in self.entries.values() if e.bound)
        unsure = sum(1 for e in self.entries.values() if e.bound is None)
        young = sum(1 for t in self.tickets.values() if now < t.taken + timeout)
        high = float("inf") if self.spoiled else bound + unsure + len(self.tickets) + len(self.lost)
        return bound + young, high

    def blocks(self) -> dict[int, int]:
        """Block Offset -> handle, for every binding whose block the wire showed."""
        return {e.block: h for h, e in self.entries.items() if e.bound and e.block is not None}


@dataclass
class Check:
    """One check of the text: ``fails`` True, False or None (unknown)."""

    status: int | None      # the status a failure gets; None: the text names none, any refusal
    fails: bool | None
    why: str                # what fails, said for the finding
    kind: str               # the finding's kind when the target answers OK regardless


@dataclass
class Expect:
    op: int
    handle: int
    what: str
    checks: list[Check] = field(default_factory=list)
    generation: int | None = None        # of an OK
    next_generation: bool = False        # that Generation is a bind's or free's step
    length: int | None = None            # of an OK LOAD
    block: int | None = None             # of an OK LOAD
    data: bytes | None = None            # of an OK LOAD
    buffer: int | None = None            # a LOAD's Data Descriptor Length
    block_size: int | None = None        # the session's, for an OK LOAD's Data Length
    request_id: int | None = None        # what the answer must echo (None: unparsed)
    parsed: bool = True                  # the request decoded, so its Block Handle is known
    foreign: bool = False                # the handle is in neither of the fuzzer's ranges
    lost: bool = False                   # whether the entry is bound is not known either
    new_block: bool = False              # an OK allocation: a pool block bound nowhere else
    bound_blocks: dict[int, int] = field(default_factory=dict)
    pool: tuple[int, int, int] | None = None  # (Block Size, F, Pool Tagged Offset) with DIRECT_LOAD
    entry_generation: int | None = None  # what a refusal carries
    seen: str = ""                       # the answer the entry is known from
    asked_record: bool = False
    record: bool | None = False          # a completion record expected (None: either)
    invalidate: int | None = 0           # STag a Send must invalidate (0: none, None: either)
    young_until: float | None = None     # TICKET_ABANDONED before this is too early

    @property
    def unknown(self) -> str:
        """Why the entry is not known to the model, for the tally."""
        return FOREIGN if self.foreign else UNKNOWN_ENTRY if self.lost else NEVER_SHOWN

    @property
    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.fails is True]

    @property
    def unsure(self) -> list[Check]:
        return [c for c in self.checks if c.fails is None]

    @property
    def ok(self) -> bool:
        return not self.failing

    def allows(self, status: int) -> bool:
        if status == Status.OK:
            return self.ok
        return any(c.status in (None, status) for c in self.failing + self.unsure)

    def expected(self) -> str:
        names = (["OK"] if self.ok else []) + sorted(
            {STATUS.describe(c.status) for c in self.failing + self.unsure if c.status is not None})
        if any(c.status is None for c in self.failing + self.unsure):
            names.append("a refusal")
        return " or ".join(names)


# -- expectations ------------------------------------------------------------------------

def _odd(req: AnyMessage) -> str:
    """What makes a parseable request odd enough that a target may call it MALFORMED."""
    op, flags = req["opcode"], req.get("flags", 0)
    odd = []
    if op == Opcode.BIND and flags or op in FLAGGED and flags & ~DEFINED_FLAGS:
        odd.append(f"undefined flag bits 0x{flags & (~DEFINED_FLAGS if op in FLAGGED else 0xFFFF):04x}")
    if flags & MEANINGLESS.get(op, 0):
        odd.append(f"flags 0x{flags & MEANINGLESS[op]:04x} that mean nothing for this opcode")
    if req.get("status"):
        odd.append(f"Status {req['status']} in a request")
    if req.get("cd.reserved"):
        odd.append("a non-zero reserved field")
    if (op in (Opcode.STORE, Opcode.ALLOC_STORE) and flags & RequestFlag.INLINE
            and (req.get("dd.stag") or req.get("dd.offset"))):
        odd.append("INLINE with a non-zero STag or Tagged Offset")
    return ", ".join(odd)


def _outside_table(info: TargetInfo, handle: int) -> bool | None:
    f = info.fields
    if "table_base_handle" not in f:
        return None
    return True if not f["table_base_handle"] <= handle < f["table_base_handle"] + f["table.count"] else None


def expect(req: AnyMessage, info: TargetInfo, own: Knowledge, lookup: Callable[[int], Entry],
           bound_blocks: dict[int, int], ours: Callable[[int], bool], now: float) -> Expect:
    """The outcome the text allows for ``req`` (parsed), sent on the session ``own``
    describes; ``lookup`` gives any handle's entry as known, ``bound_blocks`` the Block
    Offsets known bound (to which handle), ``ours`` tells a valid STag of the initiator's."""
    op, h, gen, flags = req["opcode"], req["handle"], req["generation"], req.get("flags", 0)
    e = lookup(h)
    x = Expect(op, h, f"{OPCODES.describe(op)} of 0x{h:x}")
    add = x.checks.append
    timeout = info.ticket_timeout_ms / 1000
    if op not in REQUESTS:
        goodbye = op == Opcode.GOODBYE          # it ends the session; the text gives it no completion
        add(Check(None, None if goodbye else True, f"{OPCODES.describe(op)} is not a request", "ok-unparseable"))
        x.record, x.invalidate = None, None
        return x
    outside = False if own.owns(h) else (_outside_table(info, h) if op == Opcode.LOAD else True)
    add(Check(Status.INVALID_HANDLE, outside, f"0x{h:x} is outside the session's range 0x{own.base:x}+"
              f"{own.count}" + (" and the table" if op == Opcode.LOAD else ""), "ok-outside-range"))
    if gen:
        add(Check(Status.STALE_GENERATION, None if e.generation is None else gen != e.generation,
                  f"the request names Generation {gen}, the entry has {e.generation}", "ok-generation"))
    _lengths(x, req, info, e)
    if op in (Opcode.LOAD, Opcode.STORE, Opcode.FREE):
        add(Check(Status.NOT_VALID, None if e.bound is None else not e.bound, f"0x{h:x} is not bound", "ok-state"))
    if op == Opcode.ALLOC_STORE:
        add(Check(Status.ALREADY_BOUND, e.bound, f"0x{h:x} is bound", "ok-state"))
    if op == Opcode.STORE and e.bound is not False:
        add(Check(Status.SEALED, e.sealed if e.bound else None, f"0x{h:x} is sealed", "ok-sealed"))
    if op == Opcode.LOAD and not flags & RequestFlag.ALLOW_UNSEALED and e.bound is not False:
        add(Check(Status.NOT_SEALED, None if e.sealed is None or not e.bound else not e.sealed,
                  f"0x{h:x} is not sealed and ALLOW_UNSEALED is not set", "ok-not-sealed"))
    if op in (Opcode.ALLOC_STORE, Opcode.BIND):
        _allocation(x, req, info, own, e, now, timeout)
    odd = _odd(req)
    if odd:
        add(Check(Status.MALFORMED, None, odd, ""))
    base = e.generation if e.generation is not None else (gen or None)
    if op in (Opcode.LOAD, Opcode.STORE):
        x.generation = base
    elif base is not None:
        x.generation, x.next_generation = next_generation(base), True
    if op == Opcode.LOAD:
        x.buffer, x.block_size = req["dd.length"], info.block_size
        if e.bound:
            x.length, x.block, x.data = e.length, e.block, e.data
    x.entry_generation, x.seen, x.lost = e.generation, e.seen, e.bound is None
    if op in (Opcode.ALLOC_STORE, Opcode.BIND):
        x.bound_blocks = {b: other for b, other in bound_blocks.items() if other != h}
    x.asked_record = op in FLAGGED and bool(flags & RequestFlag.RECORD)
    x.record = x.asked_record and bool(info.features & Feature.RECORD_COMPLETION)
    if op in (Opcode.LOAD, Opcode.STORE, Opcode.ALLOC_STORE) and flags & RequestFlag.INVALIDATE and not x.record:
        x.invalidate = req["dd.stag"] if ours(req["dd.stag"]) else None
    return x


def _lengths(x: Expect, req: AnyMessage, info: TargetInfo, e: Entry) -> None:
    """"Lengths MUST NOT exceed Block Size or the initiator's buffer" (TOO_LARGE)."""
    op, bs, add = x.op, info.block_size, x.checks.append
    if op in (Opcode.STORE, Opcode.ALLOC_STORE):
        n = req["dd.length"]
        add(Check(Status.TOO_LARGE, n > bs, f"Length {n} exceeds Block Size {bs}", "ok-too-large"))
        if req["flags"] & RequestFlag.INLINE and n > info.max_inline:     # Max Inline: the target's to enforce
            add(Check(Status.TOO_LARGE, None, f"inline Length {n} exceeds Max Inline {info.max_inline}", ""))
            add(Check(Status.MALFORMED, None, "inline data beyond Max Inline", ""))
    elif op == Opcode.LOAD:
        n = req["dd.length"]
        if e.bound is None or e.bound and e.length is None:
            add(Check(Status.TOO_LARGE, None, "the block's Data Length is not known", ""))
        elif e.bound and e.length is not None:
            add(Check(Status.TOO_LARGE, e.length > n, f"the block holds {e.length} octets, the buffer "
                      f"{n}", "ok-too-large"))
        if n > bs:
            add(Check(Status.TOO_LARGE, None, f"a buffer of {n} octets, Block Size {bs}", ""))
    elif op == Opcode.BIND:
        n = req["bind.data_length"]
        add(Check(Status.TOO_LARGE, n > bs, f"Data Length {n} exceeds Block Size {bs}", "ok-too-large"))


def _allocation(x: Expect, req: AnyMessage, info: TargetInfo, own: Knowledge, e: Entry,
                now: float, timeout: float) -> None:
    """Quota ("Allocation Quotas") and, for BIND, the ticket ("Direct Modes")."""
    add, q = x.checks.append, info.quota
    low, high = own.usage(now, timeout)
    x.new_block = True
    if "pool.count" in info.fields:
        x.pool = (info.block_size, info.fields["pool.count"], info.fields["pool.offset"])
    use = f"the session uses {low}" + ("" if high == low else f" to {high:g}") + f" of its quota of {q}"
    if own.spoiled:
        add(Check(None, None, "a FetchAdd with wrong operands moved this session's Head", ""))
    if x.op == Opcode.ALLOC_STORE:
        add(Check(Status.NO_SPACE, True if low >= q else False if high < q else None, use, "ok-quota"))
        return
    add(Check(None, e.bound, f"0x{x.handle:x} is bound", "ok-state"))
    ticket, block = req["bind.ticket"], req["bind.block_offset"]
    if not info.features & Feature.DIRECT_ALLOC:
        add(Check(None, True, "the session has no DIRECT_ALLOC", "ok-forged-bind"))
        return
    add(Check(Status.NO_SPACE, True if low > q else False if high <= q else None, use, "ok-quota"))
    if own.spoiled:
        return
    t = own.tickets.get(ticket)
    if ticket in own.lost:
        add(Check(Status.TICKET_ABANDONED, None, f"ticket {ticket} may have been abandoned", ""))
        add(Check(None, None, f"ticket {ticket} may have been reclaimed", ""))
    elif t is None:
        add(Check(None, True, f"ticket {ticket} is not one this session took and has not bound",
                  "ok-forged-bind"))
        return
    if t is not None and block != t.block:
        add(Check(None, True, f"the slot of ticket {ticket} holds block 0x{t.block:x}, not 0x{block:x}",
                  "ok-forged-bind"))
    if t is not None and now > t.seen + ABANDONED_AFTER * timeout + GRACE:
        add(Check(Status.TICKET_ABANDONED, True, f"ticket {ticket} was taken {now - t.seen:.2f} s ago, "
                  f"the Ticket Timeout is {timeout:g} s", "ok-abandoned-ticket"))
    elif t is not None:
        add(Check(Status.TICKET_ABANDONED, None, "", ""))
        x.young_until = t.taken + timeout


def expect_unparsed(sent: bytes, handle: int) -> Expect:
    """A request the codec cannot parse: any refusal; OK only where a lenient reading
    could be meant (a request opcode of Version 1, complete header, length off)."""
    op = sent[1] if len(sent) > 1 else -1
    lenient = len(sent) >= 24 and sent[0] == 1 and op in REQUESTS
    why = (f"{len(sent)} octets" if len(sent) < 24 else f"Version {sent[0]}" if sent[0] != 1
           else f"opcode {OPCODES.describe(op)} is not a request")
    x = Expect(op, handle, f"an unparseable request ({why if not lenient else 'length off'})",
               record=None, invalidate=None, parsed=False)
    x.checks.append(Check(None, None if lenient else True, why, "ok-unparseable"))
    return x


# -- judging an answer ---------------------------------------------------------------------

def judge(x: Expect, c: AnyMessage, *, record: bool, invalidated: int | None, at: float,
          data: bytes | None, tally: Tally) -> list[Finding]:
    """What the completion ``c`` (or completion record) breaks of ``x``; ``data`` is what
    an OK LOAD put into the fuzzer's buffer, when the fuzzer can tell. Every field of
    the answer is counted in ``tally``: judged, or not predicted and why."""
    a = "record" if record else "completion"
    out: list[Finding] = _echo(x, c, a, tally)
    status, name = c["status"], STATUS.describe(c["status"])
    tally.judge(f"{a}.status")
    if status == Status.OK:
        if x.ok:
            out += _ok_values(x, c, data, a, tally)
        else:
            out.append(Finding(x.failing[0].kind, f"OK for {x.what}, expected {x.expected()}: "
                               + "; ".join(ch.why for ch in x.failing)))
    elif not x.allows(status):
        kinds: dict[int, str] = {Status.NO_SPACE: "quota", Status.TICKET_ABANDONED: "ticket"}
        kind = kinds.get(status, "status")
        why = "; ".join(ch.why for ch in x.failing) or "nothing the wire showed makes it fail"
        detail = next((ch.why for ch in x.checks if ch.status == status and ch.fails is False), why)
        out.append(Finding(kind, f"{x.what} completed {name}, expected {x.expected()} ({detail})"))
    elif status == Status.TICKET_ABANDONED and x.young_until is not None and at < x.young_until:
        out.append(Finding("ticket", f"{x.what} completed TICKET_ABANDONED {x.young_until - at:.2f} s "
                           "before the ticket's Ticket Timeout could have passed"))
    if status != Status.OK:
        tally.cannot(NOT_FIXED_REFUSAL, f"{a}.data_length", f"{a}.block_offset")
        if status in (Status.MALFORMED, Status.INVALID_HANDLE):
            tally.cannot(NO_ENTRY_LOOKED, f"{a}.generation")
        elif x.entry_generation is None:
            tally.cannot(x.unknown, f"{a}.generation")
        else:
            tally.judge(f"{a}.generation")
            if c["generation"] != x.entry_generation:
                shown = f" ({x.seen})" if x.seen else ""
                out.append(Finding("generation", f"{x.what} completed {name} with Generation {c['generation']}, "
                                   f"the entry's is {x.entry_generation}{shown}"))
    if status != Status.MALFORMED:
        out += _form(x, record, invalidated)
    return out


def _echo(x: Expect, c: AnyMessage, a: str, tally: Tally) -> list[Finding]:
    """The header of the answer: the Request ID and (in a COMPLETION Send) the Block
    Handle echoed in full width, the reserved octets zero (the decoder already held
    Version to 1 and the Opcode to COMPLETION)."""
    out = []
    if x.request_id is None:
        tally.cannot(UNPARSED, f"{a}.request_id")
    else:
        tally.judge(f"{a}.request_id")
        if c["request_id"] != x.request_id:
            out.append(Finding("request-id", f"{x.what}: the answer carries Request ID 0x{c['request_id']:x}, "
                               f"the request 0x{x.request_id:x}"))
    if a == "record":
        return out
    tally.judge(f"{a}.version", f"{a}.opcode", f"{a}.reserved")
    tally.cannot(NO_FLAGS, f"{a}.flags")
    if not x.parsed:
        tally.cannot(UNPARSED, f"{a}.handle")
    else:
        tally.judge(f"{a}.handle")
        if c["handle"] != x.handle:
            out.append(Finding("echo", f"{x.what}: the COMPLETION carries Block Handle 0x{c['handle']:x}, "
                               f"not the request's 0x{x.handle:x}"))
    if c["completion.reserved"]:
        out.append(Finding("reserved", f"{x.what}: the COMPLETION's Reserved field is "
                           f"0x{c['completion.reserved']:08x}, not zero"))
    return out


def _ok_values(x: Expect, c: AnyMessage, data: bytes | None, a: str, tally: Tally) -> list[Finding]:
    out = []
    gen, length, block = c["generation"], c["completion.data_length"], c["completion.block_offset"]
    if x.generation is None:
        tally.cannot(x.unknown, f"{a}.generation")
    else:
        tally.judge(f"{a}.generation")
    if gen == 0:
        out.append(Finding("generation", f"OK for {x.what} with Generation 0, a value an entry never takes"))
    elif x.generation is not None and gen != x.generation:
        how = "the entry's Generation incremented by one, skipping zero" if x.next_generation else "the entry's"
        shown = f"; the entry's was shown by {x.seen}" if x.seen else ""
        out.append(Finding("generation", f"OK for {x.what} with Generation {gen}, expected {x.generation} "
                           f"({how}{shown})"))
    if x.op == Opcode.LOAD:
        out += _load_values(x, length, block, data, a, tally)
    else:
        tally.cannot(NOT_FIXED_OK, f"{a}.data_length")
        if not x.new_block:
            tally.cannot(NOT_FIXED_OK, f"{a}.block_offset")
    if x.new_block:
        tally.judge(f"{a}.block_offset")
        other = x.bound_blocks.get(block)
        # Block Offsets are Tagged Offsets of the Pool STag: from its descriptor's offset
        if x.pool and not is_block(block, x.pool[2], x.pool[1], x.pool[0]):
            out.append(Finding("block-offset", f"OK for {x.what} with Block Offset 0x{block:x}, not a block "
                               f"of the pool ({x.pool[1]} blocks of {x.pool[0]} octets)"))
        elif other is not None:
            out.append(Finding("block-offset", f"OK for {x.what} with Block Offset 0x{block:x}, which "
                               f"0x{other:x} is bound to"))
    return out


def _load_values(x: Expect, length: int, block: int, data: bytes | None, a: str, tally: Tally) -> list[Finding]:
    """An OK LOAD: the entry's Data Length (never beyond the buffer or the Block Size),
    its Block Offset, and the block as stored."""
    out = []
    tally.judge(f"{a}.data_length")          # at least against the buffer and the Block Size
    if x.buffer is not None and length > x.buffer:
        out.append(Finding("ok-too-large", f"LOAD of 0x{x.handle:x} reports {length} octets for a "
                           f"{x.buffer}-octet buffer"))
    elif x.block_size is not None and length > x.block_size:
        out.append(Finding("data-changed", f"LOAD of 0x{x.handle:x} reports {length} octets, more than "
                           f"the Block Size {x.block_size}"))
    elif x.length is not None and length != x.length:
        out.append(Finding("data-changed", f"LOAD of 0x{x.handle:x}: Data Length {length}, the block "
                           f"holds {x.length}"))
    elif x.data is not None and data is not None and data != x.data:
        at = next((i for i, (p, q) in enumerate(zip(data, x.data)) if p != q), min(len(data), len(x.data)))
        out.append(Finding("data-changed", f"LOAD of 0x{x.handle:x}: the block differs from what was "
                           f"stored from octet {at} on"))
    if x.data is None or data is None:
        tally.cannot(UNKNOWN_DATA, "load.data")
    else:
        tally.judge("load.data")
    if x.block is None:
        tally.cannot(x.unknown, f"{a}.block_offset")
    else:
        tally.judge(f"{a}.block_offset")
        if block != x.block:
            out.append(Finding("block-offset", f"LOAD of 0x{x.handle:x} shows Block Offset 0x{block:x}; "
                               f"{x.seen or 'an earlier answer'} showed 0x{x.block:x}"))
    return out


def _form(x: Expect, record: bool, invalidated: int | None) -> list[Finding]:
    if x.record is not None and record != x.record:
        return [Finding("record", f"{x.what} with RECORD on a session granted RECORD_COMPLETION was "
                        "answered by a COMPLETION Send, not a completion record" if x.record else
                        f"{x.what} was answered by a completion record, but "
                        + ("the session has no RECORD_COMPLETION" if x.asked_record else "it has no RECORD"))]
    if record or x.invalidate is None:
        return []
    if x.invalidate and invalidated != x.invalidate:
        got = "a plain Send" if invalidated is None else f"Send with Invalidate of STag 0x{invalidated:08x}"
        return [Finding("invalidate", f"{x.what} with INVALIDATE was answered by {got}, not Send with "
                        f"Invalidate of its Data Descriptor's STag 0x{x.invalidate:08x}")]
    if not x.invalidate and invalidated is not None:
        return [Finding("invalidate", f"{x.what} without INVALIDATE was answered by Send with Invalidate "
                        f"of STag 0x{invalidated:08x}")]
    return []


# -- learning from the answer ----------------------------------------------------------------

def learn(k: Knowledge | None, x: Expect, req: AnyMessage | None, c: AnyMessage | None, *,
          allowed: bool, stored: bytes | None = None, loaded: bytes | None = None) -> None:
    """Update ``k`` (the Knowledge of the session owning the handle, if ours) from the
    answer ``c`` to ``req``; ``c`` None when the outcome is unknown (no answer, the
    connection ended). ``stored`` is the data a store carried, ``loaded`` what a LOAD
    brought, when known."""
    if req is not None and req["opcode"] == Opcode.BIND and k is not None:
        _ticket_fate(k, req, c)
    if k is None:
        return
    h = x.handle
    if c is None or req is None:
        if c is None or c["status"] == Status.OK:
            k.forget(h)
        return
    e, status, flags = k.entry(h), c["status"], req.get("flags", 0)
    seen = f"the {STATUS.describe(status)} of {x.what}"
    if status == Status.OK:
        gen = c["generation"]
        if x.op == Opcode.LOAD and not allowed:
            return                              # a LOAD changes nothing: what the model knew stands
        if x.op == Opcode.LOAD:
            sealed = True if not flags & RequestFlag.ALLOW_UNSEALED else e.sealed
            length, block = c["completion.data_length"], c["completion.block_offset"]
            if loaded is None and (e.generation, e.length, e.block) == (gen, length, block):
                loaded = e.data                 # not seen this time, and nothing says it changed
            k.set(h, Entry(True, gen, sealed, length, loaded, block, seen))
        elif x.op == Opcode.STORE:
            k.set(h, replace(e, bound=True, generation=gen, sealed=bool(flags & RequestFlag.SEAL),
                             length=req["dd.length"], data=stored, seen=seen))
        elif x.op == Opcode.ALLOC_STORE:
            k.set(h, Entry(True, gen, bool(flags & RequestFlag.SEAL), req["dd.length"], stored,
                           c["completion.block_offset"], seen))
        elif x.op == Opcode.FREE:
            k.set(h, Entry(False, gen, seen=seen))
        elif x.op == Opcode.BIND:
            k.set(h, Entry(True, gen, None, req["bind.data_length"], stored, req["bind.block_offset"], seen))
        return
    if not allowed:
        if status != Status.NO_SPACE:
            k.forget(h)
        return
    if status in (Status.MALFORMED, Status.INVALID_HANDLE):
        return
    if e.generation is None:
        e = replace(e, generation=c["generation"], seen=seen)
    by_status: dict[int, Entry] = {
        Status.NOT_VALID: Entry(False, e.generation, seen=e.seen), Status.ALREADY_BOUND: replace(e, bound=True),
        Status.SEALED: replace(e, bound=True, sealed=True), Status.NOT_SEALED: replace(e, bound=True, sealed=False)}
    learned = by_status.get(status)
    k.set(h, learned if learned is not None and e.bound is None else e)


def _ticket_fate(k: Knowledge, req: AnyMessage, c: AnyMessage | None) -> None:
    ticket = req["bind.ticket"]
    t = k.tickets.get(ticket)
    if t is None:
        return
    if c is None or c["status"] == Status.TICKET_ABANDONED:
        k.lost[ticket] = k.tickets.pop(ticket)
    elif c["status"] == Status.OK and req["bind.block_offset"] == t.block:
        del k.tickets[ticket]
