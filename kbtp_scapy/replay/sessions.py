"""Rebuild the initiator sessions of a capture: what each initiator asked, supplied and got.

A session starts with a HELLO and its HELLO_ACK. Its requests are paired with their
COMPLETIONs (or completion records) by Request ID; the RDMA Writes a LOAD received are
found by the STag of its Data Descriptor, the RDMA Read Responses a non-inline store
served by the STag the target read. The initiator's own one-sided operations (the reads,
FetchAdds and Writes of DIRECT_LOAD and DIRECT_ALLOC) become steps too, named by the
HELLO_ACK descriptor whose STag they use. Every step keeps the frame it was issued in
and the frame its answer came in, which is what the player orders the replay by.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .. import codec
from ..capture import rdma_messages, read_packets, where_it_ends
from ..layers.kbtp import looks_like_kbtp
from ..tables import RING_COUNTER, memory as M
from ..tables.enums import OPCODES
from ..vocab import AnyMessage, Feature, Opcode
from ..wire.message import RdmaMessage

DIRECT_REGIONS = ("table", "pool", "partition", "ring", "head")
MAX_BLOCK = 1 << 24    # the largest Block Size replay makes buffers for (16 MiB)


@dataclass
class Outcome:
    """What the target answered to one step, in the capture or in the replay."""

    status: int | None = None
    generation: int | None = None
    data_length: int | None = None
    block_offset: int | None = None
    data: bytes | None = None          # a LOAD's block data, a one-sided read's octets
    ticket: int | None = None          # a FetchAdd on Head
    flags: int | None = None           # a table entry read
    form: str = "completion"           # completion, record, hello_ack, read, fetch_add, write

    def values(self) -> dict[str, Any]:
        names = ("status", "generation", "data_length", "block_offset", "data", "ticket", "flags")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


@dataclass
class Step:
    """One thing the initiator did: a Send (request, GOODBYE) or a one-sided operation."""

    session: Session
    kind: str                          # request, goodbye, read, write, fetch_add
    frame: int
    time: float
    fields: AnyMessage = field(default_factory=AnyMessage)   # decoded request
    payload: bytes = b""               # the captured Send (used when it did not decode)
    error: str | None = None           # decoder's complaint about the request
    region: str | None = None          # one-sided: HELLO_ACK descriptor it uses
    offset: int = 0                    # one-sided: captured Tagged Offset
    length: int = 0
    data: bytes = b""                  # a one-sided Write's data
    supplied: bytearray | None = None  # a non-inline store's data, as the target read it
    supplied_seen: int = 0
    loaded: bytearray | None = None    # a LOAD's buffer, as the target wrote it
    captured: Outcome | None = None
    done_frame: float = float("inf")   # frame of the captured answer
    problem: str | None = None         # why it cannot be replayed faithfully
    cut: str | None = None             # why its captured answer cannot be compared: the capture cut it

    @property
    def handle(self) -> int | None:
        """The captured handle the step is about: a request's, or the one whose table
        entry a one-sided operation on the table reads (None for any other step)."""
        if self.kind == "request":
            return self.fields.get("handle")
        table = self.session.descriptor("table") if self.region == "table" else None
        if table is None:
            return None
        return self.session.ack.get("hello_ack.table_base_handle", 0) + \
            (self.offset - table[1]) // M.ENTRY_SIZE

    @property
    def name(self) -> str:
        if self.kind == "request":
            return OPCODES.describe(self.fields.get("opcode", -1))
        if self.kind in ("read", "write", "fetch_add"):
            return f"{self.kind.upper()} {self.region}"
        return self.kind.upper()


@dataclass
class Session:
    """One initiator session of the capture."""

    index: int
    transport: str
    request_conn: tuple
    hello: AnyMessage
    frame: int
    time: float
    reply_conn: tuple | None = None
    ack: AnyMessage = field(default_factory=AnyMessage)
    ack_frame: float = float("inf")
    addr_le: bool = False
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pending: dict[int, Step] = field(default_factory=dict)      # Request ID -> step
    reads_out: deque = field(default_factory=deque)             # target's reads of our data
    ours_out: deque = field(default_factory=deque)              # our reads and atomics

    @property
    def initiator_id(self) -> bytes:
        return self.hello.get("hello.initiator_id", b"")

    def descriptor(self, name: str) -> tuple[int, int, int] | None:
        ack: Mapping[str, Any] = self.ack      # the descriptor named at run time
        stag = ack.get(f"hello_ack.{name}.stag")
        if stag is None:
            return None
        return stag, ack[f"hello_ack.{name}.offset"], ack[f"hello_ack.{name}.count"]

    @property
    def handle_range(self) -> range:
        base = self.ack.get("hello_ack.handle_base", 0)
        return range(base, base + self.ack.get("hello_ack.handle_count", 0))


@dataclass
class Capture:
    """Sessions of a capture, in the order their HELLOs were captured."""

    path: str
    sessions: list[Session]
    times: dict[int, float]
    notes: list[str] = field(default_factory=list)
    ends: str | None = None            # where a truncated or damaged capture stops being read

    def steps(self) -> list[Step]:
        return sorted((s for ses in self.sessions for s in ses.steps), key=lambda s: s.frame)


def _tagged(msg: RdmaMessage) -> tuple[int, int]:
    """(STag, Tagged Offset) of a Write or Read Response, either binding."""
    i = msg.info
    return i.get("stag", i.get("rkey", 0)), i.get("to", i.get("va", 0))


def _read_source(msg: RdmaMessage) -> tuple[int, int, int]:
    """(STag, Tagged Offset, length) a Read Request reads, either binding."""
    i = msg.info
    return (i.get("src_stag", i.get("rkey", 0)), i.get("src_to", i.get("va", 0)),
            i.get("read_size", i.get("dma_length", 0)))


def _place(buf: bytearray, at: int, data: bytes) -> int:
    """Copy ``data`` into ``buf`` at ``at`` as far as it fits; octets placed."""
    if at < 0 or at >= len(buf):
        return 0
    chunk = data[:len(buf) - at]
    buf[at:at + len(chunk)] = chunk
    return len(chunk)


@contextmanager
def _scapy_quiet() -> Iterator[None]:
    """Scapy warns of a cut frame on stderr; the replay says so in its own words (a note,
    and the steps it cut unchecked)."""
    log = logging.getLogger("scapy.runtime")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _cut_frames(packets: list) -> dict[int, str]:
    """Frame number: how the capture cut it, for each frame it holds fewer octets of than
    were on the wire (a snapshot length, or a file that ends inside the frame)."""
    cut = {}
    for number, pkt in enumerate(packets, 1):
        held, wire = len(getattr(pkt, "original", None) or bytes(pkt)), getattr(pkt, "wirelen", None)
        if wire and held < wire:
            cut[number] = f"the capture holds {held} of the {wire} octets of frame {number}"
    return cut


class _Builder:
    def __init__(self, path: str) -> None:
        with _scapy_quiet():
            self.packets = read_packets(path)
        self.cut = _cut_frames(self.packets)
        self.times = {n: float(p.time) for n, p in enumerate(self.packets, 1)}
        self.capture = Capture(str(path), [], self.times, ends=where_it_ends(path))
        self.by_conn: dict[tuple, tuple[Session, str]] = {}
        self.awaiting_ack: list[Session] = []

    def cut_short(self, msg: RdmaMessage) -> str | None:
        """Why the capture does not hold all of ``msg``, or None when it does."""
        if msg.info.get("complete") is False:
            return "the capture holds only part of its answer"
        return next((f"{self.cut[f]}, part of its answer" for f in msg.frames if f in self.cut), None)

    def time(self, msg: RdmaMessage) -> float:
        return self.times.get(msg.frames[0] if msg.frames else 0, 0.0)

    def build(self) -> Capture:
        for msg in rdma_messages(self.packets):
            if msg.transport == "roce" and msg.info.get("opcode", "").startswith("UD_"):
                continue                                   # CM MADs on QP1
            try:
                self.message(msg)
            except Exception as exc:  # noqa: BLE001 - a capture may hold anything
                self.capture.notes.append(f"frame {msg.frames[-1] if msg.frames else '?'}: "
                                          f"skipped ({exc})")
        for ses in self.capture.sessions:
            for step in ses.pending.values():
                if step.captured is None:
                    step.problem = step.problem or "no answer in the capture"
        return self.capture

    def message(self, msg: RdmaMessage) -> None:
        owner = self.by_conn.get(msg.conn)
        kbtp = msg.kind in ("send", "send_inv") and looks_like_kbtp(msg.payload)
        if kbtp:
            header = codec.decode_header(msg.payload[:24]) if len(msg.payload) >= 24 else {}
            opcode = header.get("opcode")
            if opcode == Opcode.HELLO:
                self.hello(msg)
                return
            if opcode == Opcode.HELLO_ACK and self.hello_ack(msg):
                return
        if owner is None:
            return
        ses, direction = owner
        if direction == "request":
            self.from_initiator(ses, msg, kbtp)
        else:
            self.from_target(ses, msg, kbtp)

    # -- session start -------------------------------------------------------------------

    def hello(self, msg: RdmaMessage) -> None:
        try:
            fields = codec.decode(msg.payload)
        except codec.Malformed as exc:
            fields = exc.fields
        ses = Session(len(self.capture.sessions), msg.transport, msg.conn, fields,
                      msg.frames[-1], self.time(msg))
        self.capture.sessions.append(ses)
        self.by_conn[msg.conn] = (ses, "request")
        if msg.transport == "iwarp":
            ses.reply_conn = (msg.conn[1], msg.conn[0])
            self.by_conn[ses.reply_conn] = (ses, "reply")
        self.awaiting_ack.append(ses)

    def hello_ack(self, msg: RdmaMessage) -> bool:
        """Attach a HELLO_ACK to the oldest session of that connection still waiting for one."""
        def answers(ses: Session) -> bool:
            if ses.transport != msg.transport:
                return False
            if msg.transport == "iwarp":
                return ses.reply_conn == msg.conn
            return ses.request_conn[:2] == (msg.conn[1], msg.conn[0])
        ses = next((s for s in self.awaiting_ack if answers(s)), None)
        if ses is None:
            return False
        self.awaiting_ack.remove(ses)
        ses.reply_conn = msg.conn
        self.by_conn[msg.conn] = (ses, "reply")
        try:
            ses.ack = codec.decode(msg.payload)
        except codec.Malformed as exc:
            ses.ack = exc.fields
            ses.notes.append(f"HELLO_ACK malformed: {exc.reason}")
        ses.ack_frame = msg.frames[-1]
        ses.addr_le = bool(ses.ack.get("hello_ack.features", 0) & Feature.ADDR_LE) and not ses.ack.get("status")
        return True

    # -- initiator to target ---------------------------------------------------------------

    def from_initiator(self, ses: Session, msg: RdmaMessage, kbtp: bool) -> None:
        frame, t = msg.frames[-1], self.time(msg)
        if msg.kind in ("send", "send_inv"):
            self.request(ses, msg, frame, t, kbtp)
        elif msg.kind == "read_response":
            self.served(ses, msg)
        elif msg.kind in ("read_request", "atomic_request", "write"):
            self.one_sided(ses, msg, frame, t)
        elif msg.kind == "terminate":
            ses.notes.append(f"frame {frame}: the initiator sent a Terminate")

    def request(self, ses: Session, msg: RdmaMessage, frame: int, t: float, kbtp: bool) -> None:
        if not kbtp:
            ses.notes.append(f"frame {frame}: a Send that is not KBTP ({len(msg.payload)} octets)")
            return
        error = None
        try:
            fields = codec.decode(msg.payload, ses.addr_le)
        except codec.Malformed as exc:
            fields, error = exc.fields, exc.reason
        kind = "goodbye" if fields.get("opcode") == Opcode.GOODBYE else "request"
        step = Step(ses, kind, frame, t, fields, msg.payload, error)
        opcode = fields.get("opcode")
        # A block's data is at most Block Size: buffers are sized by that (and a sane cap on
        # it), never by a length field alone, which a damaged capture may set to gigabytes.
        most = min(ses.ack.get("hello_ack.block_size", 0) or MAX_BLOCK, MAX_BLOCK)
        if opcode in (Opcode.LOAD,) and "dd.length" in fields:
            step.loaded = bytearray(min(fields["dd.length"], most))
        if opcode in (Opcode.STORE, Opcode.ALLOC_STORE) and fields.get("dd.stag") and \
                "inline_data" not in fields:
            step.supplied = bytearray(min(fields.get("dd.length", 0), most))
        if kind == "goodbye":
            step.captured = Outcome(form="goodbye")       # answered by closing, not compared
        elif "request_id" in fields:
            ses.pending[fields["request_id"]] = step
        ses.steps.append(step)

    def served(self, ses: Session, msg: RdmaMessage) -> None:
        """A Read Response carrying data the target read from the initiator."""
        if not ses.reads_out:
            ses.notes.append(f"frame {msg.frames[-1]}: Read Response to no Read Request")
            return
        step, at = ses.reads_out.popleft()
        if step is not None and step.supplied is not None:
            step.supplied_seen += _place(step.supplied, at, msg.payload)

    def one_sided(self, ses: Session, msg: RdmaMessage, frame: int, t: float) -> None:
        if msg.kind == "read_request":
            stag, to, length = _read_source(msg)
            kind = "read"
        elif msg.kind == "write":
            (stag, to), length = _tagged(msg), len(msg.payload)
            kind = "write"
            if length == 0 and stag == 0:
                return                                   # iWARP RTR
        else:
            i = msg.info
            stag, to, length = i.get("remote_stag", i.get("rkey", 0)), i.get("remote_to", i.get("va", 0)), 8
            kind = "fetch_add"
        region = next((r for r in DIRECT_REGIONS if (d := ses.descriptor(r)) and d[0] == stag), None)
        step = Step(ses, kind, frame, t, region=region, offset=to, length=length,
                    data=msg.payload if kind == "write" else b"")
        if region is None:
            step.problem = f"STag 0x{stag:08x} is not one the HELLO_ACK granted"
        elif kind == "fetch_add" and (msg.info.get("opcode") == "RC_COMPARE_SWAP"
                                      or msg.info.get("aopcode", 0) not in (0, 1)):
            step.problem = "an atomic other than FetchAdd"
        if kind == "write":
            step.captured = Outcome(form="write")
            step.done_frame = frame
        else:
            ses.ours_out.append(step)
        ses.steps.append(step)

    # -- target to initiator ----------------------------------------------------------------

    def from_target(self, ses: Session, msg: RdmaMessage, kbtp: bool) -> None:
        frame = msg.frames[-1]
        if msg.kind in ("send", "send_inv") and kbtp:
            self.completion(ses, msg)
        elif msg.kind in ("write", "write_imm"):
            self.placed(ses, msg)
        elif msg.kind == "read_request":
            stag, to, _ = _read_source(msg)
            step = self.pending_with(ses, "dd.stag", stag, lambda s: s.supplied is not None)
            ses.reads_out.append((step, to - step.fields.get("dd.offset", 0) if step else 0))
            if step is None:
                ses.notes.append(f"frame {frame}: the target read STag 0x{stag:08x}, "
                                 "which no store names")
        elif msg.kind in ("read_response", "atomic_response"):
            self.answered(ses, msg)
        elif msg.kind == "terminate":
            ses.notes.append(f"frame {frame}: the target sent a Terminate")

    @staticmethod
    def pending_with(ses: Session, key: str, stag: int, extra=lambda s: True) -> Step | None:
        """The latest request still waiting for its answer whose ``key`` names ``stag``."""
        return next((s for s in reversed(ses.pending.values())
                     if s.captured is None and s.fields.get(key) == stag and extra(s)), None)

    def completion(self, ses: Session, msg: RdmaMessage) -> None:
        try:
            c = codec.decode(msg.payload, ses.addr_le)
        except codec.Malformed as exc:
            c = exc.fields
        if c.get("opcode") != Opcode.COMPLETION:
            ses.notes.append(f"frame {msg.frames[-1]}: the target sent "
                             f"{OPCODES.describe(c.get('opcode', -1))}")
            return
        step = ses.pending.get(c.get("request_id", -1))
        if step is None or step.captured is not None:
            ses.notes.append(f"frame {msg.frames[-1]}: COMPLETION of unknown Request ID "
                             f"{c.get('request_id')}")
            return
        step.captured = Outcome(c.get("status"), c.get("generation"),
                                c.get("completion.data_length"), c.get("completion.block_offset"))
        step.cut = step.cut or self.cut_short(msg)
        self.finish(step, msg.frames[-1])

    def placed(self, ses: Session, msg: RdmaMessage) -> None:
        stag, to = _tagged(msg)
        if msg.kind == "write_imm":
            step = self.pending_with(ses, "cd.stag", stag)
            if step is not None and len(msg.payload) >= M.COMPLETION_RECORD.size:
                r = codec.decode_struct(M.COMPLETION_RECORD, msg.payload[:M.COMPLETION_RECORD.size],
                                        ses.addr_le)
                step.captured = Outcome(r["record.status"], r["record.generation"],
                                        r["record.data_length"], r["record.block_offset"],
                                        form="record")
                step.cut = step.cut or self.cut_short(msg)
                self.finish(step, msg.frames[-1])
                return
        step = self.pending_with(ses, "dd.stag", stag, lambda s: s.loaded is not None)
        if step is None and msg.kind == "write" and not msg.payload:
            return               # a liveness probe: a zero-length Write places nothing
        if step is None:
            ses.notes.append(f"frame {msg.frames[-1]}: RDMA Write to STag 0x{stag:08x}, "
                             "which no pending LOAD names")
            return
        assert step.loaded is not None           # pending_with chose it for its buffer
        step.cut = step.cut or self.cut_short(msg)
        _place(step.loaded, to - step.fields.get("dd.offset", 0), msg.payload)

    def answered(self, ses: Session, msg: RdmaMessage) -> None:
        """The answer to one of the initiator's reads or FetchAdds."""
        if not ses.ours_out:
            return
        step = ses.ours_out.popleft()
        if msg.kind == "read_response":
            step.captured = Outcome(data=msg.payload, form="read")
        else:
            step.captured = Outcome(ticket=captured_ticket(msg.info.get("orig_data", 0)),
                                    form="fetch_add")
        step.cut = self.cut_short(msg)
        step.done_frame = msg.frames[-1]

    @staticmethod
    def finish(step: Step, frame: int) -> None:
        step.done_frame = frame
        assert step.captured is not None         # what the capture answered, set by the caller
        if step.loaded is not None and step.captured.data_length is not None:
            step.captured.data = bytes(step.loaded[:step.captured.data_length])
        if step.supplied is not None and step.supplied_seen < len(step.supplied):
            step.problem = (f"the capture shows {step.supplied_seen} of the "
                            f"{len(step.supplied)} octets the target read")


def captured_ticket(original: int) -> int:
    """The Ticket a FetchAdd on Head returned (both counter forms keep it in bits 63-32)."""
    return original >> RING_COUNTER.ticket_shift


def slot_of(ticket: int, ring_count: int) -> int:
    """Slot Offset of a ticket in a ring of ``ring_count`` slots (both counter forms)."""
    return RING_COUNTER.slot_size * (ticket % max(ring_count, 1))


def load(path: str) -> Capture:
    """Read a capture and rebuild its sessions; ``CaptureError`` if it is not a capture."""
    return _Builder(path).build()
