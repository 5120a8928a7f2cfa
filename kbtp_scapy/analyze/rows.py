"""One row per KBTP message of a capture, with what the capture tells about it.

A request's row waits (in bounded memory) for the COMPLETION that answers it, then both
rows come out: the request with its answer's frame, time, status, Generation and the
latency, the COMPLETION with the request's frame and opcode. Each row also says which
session it belongs to (the Initiator ID where the HELLO is in the capture), who is the
initiator and who the target, and, for a request, how many requests of its session were
in flight when it was sent and how many Request Credits the session was granted.

The one-sided RDMA operations of each session are rows too (``rdma_op`` set, no
opcode): each names the memory it touched by the HELLO_ACK's descriptor (``rdma_region``:
table, pool, ring, head, partition) or by the request whose data it carried (a LOAD's
Write into its Data Descriptor, a STORE's Read of it: ``request_frame``, and the
request's ``data_frames``). A Read of a table entry gives the entry's fields and its
handle; a FetchAdd on a Head, the ticket it took.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import codec, tables as T
from ..capture import MAX_PENDING, Found, KbtpSessions, asks_for_record, completion_record, endpoints
from ..decode import CaptureError, Reader, Stats, rdma_operations
from ..tables import RING_COUNTER, memory as M
from ..vocab import REQUESTS, Feature, Opcode
from .operations import Operation, Pairing, RdmaOp

__all__ = ["CaptureError", "MAX_PENDING", "Row", "capture_rows", "column"]

Row = dict[str, Any]


_OPCODE_NAMES = {v.value: v.name for v in T.OPCODES.values}
_STATUS_NAMES = {v.value: v.name for v in T.STATUS.values}
#: the HELLO_ACK's direct-mode descriptors, by name (table, pool, partition, ring, head)
DESCRIPTORS = tuple(k.split(".")[1] for k in T.wire_fields() if k.startswith("hello_ack.") and k.endswith(".stag"))


def column(key: str) -> str:
    """The column of a table field: its display-filter key with '_' for '.'
    (``dd.stag`` is ``dd_stag``), a name SQL takes unquoted."""
    return key.replace(".", "_")


@dataclass
class _Session:
    """What one connection of the capture has said so far."""

    number: int
    initiator: str | None = None
    target: str | None = None
    session: str | None = None
    credits: int | None = None
    ticket_timeout_s: float | None = None
    addr_le: bool = False
    #: STag -> (descriptor name, Tagged Offset, Count), from the HELLO_ACK
    regions: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    table_base_handle: int = 0
    pending: dict[int, Row] = field(default_factory=dict)


def _row(name: str, found: Found) -> Row:
    ends = endpoints(found)
    row: Row = {"capture": name, "frame": found.frame, "time": found.time,
                "transport": found.transport, "conn": found.connection,
                "src": ends.get("src"), "dst": ends.get("dst")}
    for key, value in found.fields.items():
        row[column(key)] = value.hex() if key == "hello.initiator_id" and isinstance(value, bytes) else value
    opcode = found.fields.get("opcode")
    row["opcode_name"] = _OPCODE_NAMES.get(opcode, f"0x{opcode:02x}") if opcode is not None else None
    if opcode == Opcode.COMPLETION or opcode == Opcode.HELLO_ACK:
        status = found.fields.get("status", 0)
        row["status_name"] = _STATUS_NAMES.get(status, str(status))
    row["malformed"] = found.error
    return row


def capture_rows(path: str | Path, name: str | None = None,
                 progress: Callable[[int], None] | None = None,
                 damaged: Callable[[str], None] | None = None) -> Iterator[Row]:
    """The rows of one capture file, a request's row once it is answered (or at the end).
    A capture that ends inside a frame or stops making sense gives every message before
    that, and ``damaged`` hears why it ended early."""
    name = name or Path(path).stem
    sessions: dict[int, _Session] = {}
    stats = Stats()
    try:
        stream = open(path, "rb")
    except OSError as exc:
        raise CaptureError(f"{path}: {exc.strerror or exc}") from None
    kbtp, pairing = KbtpSessions(), Pairing()
    with stream:
        reader = Reader(stream, str(path))
        last_time = None
        for count, msg in enumerate(rdma_operations(reader, stats)):
            found = kbtp.decode(msg)
            if found is None:
                for op in pairing.feed(msg):
                    yield from _operation(_state(sessions, kbtp, op), name, op)
                continue
            if found.connection is None:
                continue
            state = sessions.setdefault(found.connection, _Session(found.connection))
            row = _row(name, found)
            last_time = found.time if found.time is not None else last_time
            yield from _place(state, row, found)
            if progress is not None and not count % 1024:
                progress(reader.position)
    if damaged is not None and (reader.cut_short or reader.problem):
        damaged(reader.problem or f"the capture ends in the middle of frame {reader.cut_short}")
    for op in pairing.flush():
        yield from _operation(_state(sessions, kbtp, op), name, op)
    for state in sessions.values():         # never answered: the capture ended first
        for pending in state.pending.values():
            pending["capture_end"] = last_time
            yield pending
        state.pending.clear()


def _state(sessions: dict[int, _Session], kbtp: KbtpSessions, op: Operation) -> _Session:
    assert op.message is not None
    number = kbtp.number(op.message)
    return sessions.setdefault(number, _Session(number))


def _operation(state: _Session, name: str, op: Operation) -> Iterator[Row]:
    """The row of an RDMA operation of the session: what memory it touched, and the
    request whose data it carried, whose row learns of it; the Write of a completion
    record answers its request, whose row then comes out too."""
    frame = op.frames[-1] if op.frames else 0
    row: Row = {"capture": name, "frame": frame, "time": op.time, "transport": op.transport,
                "conn": state.number, "src": op.src, "dst": op.dst, "initiator": state.initiator,
                "target": state.target, "credits": state.credits, "ticket_timeout_s": state.ticket_timeout_s,
                "session": state.session or f"{name}#{state.number}",
                "rdma_op": op.op.value, "rdma_stag": op.stag, "rdma_offset": op.offset,
                "rdma_length": op.length, "rdma_operand": op.operand, "rdma_compare": op.compare,
                "rdma_original": op.original}
    if op.answer_frames:
        row["answer_frame"], row["answer_time"] = op.answer_frames[-1], op.answer_time
        if op.time is not None and op.answer_time is not None:
            row["latency_s"] = op.answer_time - op.time
    # the descriptors name the target's memory: only what is asked of the target touches it
    # (an initiator's STag may have the same value in its own RNIC's key space)
    toward_target = op.dst != state.initiator or op.src == op.dst
    region = state.regions.get(op.stag) if toward_target else None
    if region is not None:
        row["rdma_region"] = region[0]
        if region[0] == "table" and op.op == RdmaOp.READ:
            _entry(row, state, op, region)
        elif region[0] == "head" and op.op == RdmaOp.FETCH_ADD and op.original is not None:
            row["ticket"] = op.original >> RING_COUNTER.ticket_shift & 0xFFFFFFFF
        yield row
        return
    if op.op in (RdmaOp.WRITE, RdmaOp.READ):
        for request in state.pending.values():
            stag, offset = request.get("dd_stag"), request.get("dd_offset")
            if (stag == op.stag and offset is not None and op.length
                    and offset <= op.offset < offset + (request.get("dd_length") or 0)):
                request.setdefault("data_frames", []).extend(op.frames + op.answer_frames)
                request["data_octets"] = (request.get("data_octets") or 0) + op.length
                row.update(request_frame=request["frame"], request_opcode_name=request["opcode_name"])
                break
        else:
            if op.op == RdmaOp.WRITE:
                yield from _record(state, row, op)
    yield row


def _record(state: _Session, row: Row, op: Operation) -> Iterator[Row]:
    """A Write of a completion record into the Completion Descriptor of the request it
    names: that request's answer, as a COMPLETION would have been."""
    record = completion_record(op.data, state.addr_le)
    if record is None:
        return
    request = state.pending.get(record["record.request_id"])
    if request is None or not request.get("recorded") or (request.get("cd_stag"), request.get("cd_offset")) != (
            op.stag, op.offset):
        return
    del state.pending[record["record.request_id"]]
    _answered(request, row, record["record.status"], record["record.generation"], record["record.data_length"])
    yield request


def _entry(row: Row, state: _Session, op: Operation, region: tuple[str, int, int]) -> None:
    """A Read of one whole table entry: its handle and, when answered, its fields."""
    _, base, count = region
    index, rest = divmod(op.offset - base, M.ENTRY_SIZE)
    if rest or not 0 <= index < count or op.length != M.ENTRY_SIZE:
        return
    row["handle"] = state.table_base_handle + index
    if len(op.data) == M.ENTRY_SIZE:
        for key, value in codec.decode_struct(M.TABLE_ENTRY, op.data, state.addr_le).items():
            row[column(key)] = value


def _answered(request: Row, row: Row, status: int, generation: int | None, length: int | None) -> None:
    """``row`` (a COMPLETION, or the RDMA Write of a completion record) answers ``request``."""
    request.update(answer_frame=row["frame"], answer_time=row["time"], answer_status=status,
                   answer_status_name=_STATUS_NAMES.get(status, str(status)),
                   answer_generation=generation, answer_data_length=length)
    if request["time"] is not None and row["time"] is not None:
        request["latency_s"] = row["time"] - request["time"]
    row.update(request_frame=request["frame"], request_opcode_name=request["opcode_name"],
               latency_s=request.get("latency_s"))


def _ends(found: Found) -> tuple[str, str]:
    """(initiator, target) of a message the initiator sent: the initiator by its address,
    the target as ``iwarp:ADDR:PORT`` or ``roce:ADDR``, the endpoint a fleet's captures share."""
    ends = endpoints(found)
    where = f"{found.transport}:{ends.get('dst')}"
    if ends.get("dst_port") is not None:
        where += f":{ends['dst_port']}"
    return str(ends.get("src")), where


def _place(state: _Session, row: Row, found: Found) -> Iterator[Row]:
    """Fill ``row``'s derived columns from its session; yield what is complete."""
    fields = found.fields
    opcode = fields.get("opcode")
    if opcode == Opcode.HELLO:
        state.initiator, state.target = _ends(found)
        state.session = row.get("hello_initiator_id")
    elif opcode == Opcode.HELLO_ACK and not fields.get("status"):
        state.credits = fields.get("hello_ack.request_credits")
        timeout_ms = fields.get("hello_ack.ticket_timeout")
        state.ticket_timeout_s = None if timeout_ms is None else timeout_ms / 1000
        state.addr_le = bool(fields.get("hello_ack.features", 0) & Feature.ADDR_LE)
        state.table_base_handle = fields.get("hello_ack.table_base_handle", 0)
        named: Mapping[str, Any] = fields            # descriptor keys, read generically
        state.regions = {named[f"hello_ack.{d}.stag"]: (d, named[f"hello_ack.{d}.offset"],
                                                        named[f"hello_ack.{d}.count"])
                         for d in DESCRIPTORS if f"hello_ack.{d}.stag" in named}
    elif state.initiator is None and opcode in REQUESTS:
        state.initiator, state.target = _ends(found)
    row["initiator"], row["target"] = state.initiator, state.target
    row["session"] = state.session or f"{row['capture']}#{state.number}"
    row["credits"] = state.credits
    row["ticket_timeout_s"] = state.ticket_timeout_s
    if opcode in REQUESTS and "request_id" in fields:      # a malformed one is answered too
        rid = fields["request_id"]
        row["recorded"] = asks_for_record(fields)
        row["in_flight"] = len(state.pending) + 1
        old = state.pending.pop(rid, None)
        if old is not None:                   # a Request ID reused before its answer
            yield old
        state.pending[rid] = row
        if len(state.pending) > MAX_PENDING:
            yield state.pending.pop(next(iter(state.pending)))
        return
    if opcode == Opcode.COMPLETION:
        request = state.pending.pop(fields.get("request_id", 0), None)
        if request is not None:
            _answered(request, row, fields.get("status", 0), fields.get("generation"),
                      fields.get("completion.data_length"))
            yield request
        else:                                 # answers nothing in the capture
            row["unsolicited"] = True
    yield row

