"""Find every KBTP message in a capture, over either binding, with session state.

Two ways in, one way out. ``kbtp decode`` reads captures with the streaming decoder
(``kbtp_scapy.decode``: octets to RDMA messages, no Scapy); ``read_packets`` and
``rdma_messages`` are the Scapy path (``builders.iwarp`` / ``builders.roce`` over
Scapy packets) that replay and the tests use. Either gives ``RdmaMessage`` objects, and
``kbtp_messages`` decodes the Sends that carry KBTP with the codec, following each
session's ADDR_LE choice from its HELLO_ACK; ``to_json`` gives the JSON object of one.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import codec, tables as T
from .codec import looks_like_kbtp
from .decode.pcapfile import CaptureError
from .tables import memory as M
from .vocab import AnyMessage, AnyStruct, Feature, Opcode, RequestFlag
from .wire.message import RdmaMessage
from .words import count

if TYPE_CHECKING:
    from scapy.packet import Packet

__all__ = ["CaptureError", "Found", "KbtpSessions", "ResponseTimes", "asks_for_record", "completion_record",
           "kbtp_messages", "rdma_messages", "read_packets", "session_key", "to_json", "where_it_ends"]

SEND_KINDS = {"send", "send_inv"}
#: requests of one capture (``ResponseTimes``) or connection (``kbtp analyze``) kept waiting
#: for their answer; past this the oldest is given up as unanswered, so a capture of a peer
#: that never answers is read in bounded memory
MAX_PENDING = 1 << 16
_HELLO_ACK = T.BY_NAME["HELLO_ACK"].opcode


@dataclass
class Found:
    """One KBTP message: where it was, what it says, and what is wrong with it.

    ``conn`` is the RDMA message's connection and direction (see ``RdmaMessage``);
    ``connection`` numbers the connections (sessions) from 0 in order of appearance;
    ``src_qp`` is the RoCE QP it came from, once the decoder has tied the connection's QPs.
    """

    frame: int
    transport: str
    conn: tuple
    fields: AnyMessage
    error: str | None = None
    time: float | None = None
    connection: int | None = None
    payload: bytes = b""
    addr_le: bool = False
    icrc_bad: tuple[int, ...] = ()      # RoCE frames of the message with a wrong ICRC
    src_qp: int | None = None


def read_packets(path: str | Path) -> list[Packet]:
    """All packets of a pcap or pcapng file as Scapy packets (the Scapy path)."""
    from scapy.error import Scapy_Exception
    from scapy.utils import PcapReader

    from .builders import iwarp, roce  # noqa: F401 - the layers the packets dissect into
    try:
        with PcapReader(str(path)) as reader:
            return list(reader)
    except FileNotFoundError:
        raise CaptureError(f"{path}: no such file") from None
    except (Scapy_Exception, EOFError, ValueError, OSError) as exc:
        raise CaptureError(_refused(path) or f"{path}: not a pcap or pcapng capture ({exc})") from None


def _refused(path: str | Path) -> str | None:
    """What ``kbtp decode``'s reader says of a file Scapy's refused (a header cut short, an
    empty file), so every tool words it alike; None where it takes the file."""
    from .decode.pcapfile import Reader
    try:
        with open(path, "rb") as stream:
            Reader(stream, str(path))
    except CaptureError as exc:
        return str(exc)
    except OSError:
        pass
    return None


def asks_for_record(fields: Mapping[str, Any]) -> bool:
    """Whether a request asks to be answered by a completion record, Written into its
    Completion Descriptor, instead of a COMPLETION (RECORD set; BIND's bit means else)."""
    return bool(fields.get("flags", 0) & RequestFlag.RECORD) and fields.get("opcode") != Opcode.BIND


def completion_record(data: bytes, addr_le: bool) -> AnyStruct | None:
    """The completion record an RDMA Write carried, or None when its octets are no record's size."""
    if len(data) != M.COMPLETION_RECORD.size:
        return None
    return codec.decode_struct(M.COMPLETION_RECORD, data, addr_le)


@dataclass
class ResponseTimes:
    """Request-to-answer times of a capture, per request opcode and per opcode and status
    of the answer: what tshark's ``-z kbtp,srt`` gives, without the C plugin. A request is
    answered by the next message of its answer's opcode with its Request ID on its
    connection (a HELLO by the HELLO_ACK), or by the completion record it asked for
    (``written``). At most ``MAX_PENDING`` requests wait for their answer; past that the
    oldest is given up as unanswered, so a capture of a peer that never answers is read in
    bounded memory."""

    pending: dict[tuple, Found] = field(default_factory=dict)
    by_opcode: dict[int, list[float]] = field(default_factory=dict)
    by_status: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    given_up: int = 0

    def add(self, found: Found) -> None:
        msg = T.BY_OPCODE.get(found.fields.get("opcode", -1))
        if msg is None or found.time is None:
            return
        key = (found.transport, found.connection, found.fields.get("request_id"))
        if msg.answer:
            self.pending[(*key, msg.answer)] = found
            if len(self.pending) > MAX_PENDING:
                del self.pending[next(iter(self.pending))]
                self.given_up += 1
            return
        request = self.pending.pop((*key, msg.name), None)
        if request is not None:
            self._answered(request, found.fields.get("status", -1), found.time)

    def written(self, transport: str, connection: int, stag: int, offset: int, data: bytes,
                time: float | None) -> None:
        """An RDMA Write on a connection: the completion record a waiting request asked for
        at this STag and Tagged Offset answers it, as ``kbtp analyze`` reads it. Its Request
        ID and Status are in network order in every session (ADDR_LE does not apply)."""
        record = completion_record(data, False)
        if record is None or time is None:
            return
        key = (transport, connection, record["record.request_id"], "COMPLETION")
        request = self.pending.get(key)
        if (request is None or not asks_for_record(request.fields)
                or (request.fields.get("cd.stag"), request.fields.get("cd.offset")) != (stag, offset)):
            return
        del self.pending[key]
        self._answered(request, record["record.status"], time)

    def _answered(self, request: Found, status: int, time: float) -> None:
        if request.time is None:
            return
        opcode, seconds = request.fields["opcode"], time - request.time
        self.by_opcode.setdefault(opcode, []).append(seconds)
        self.by_status.setdefault(opcode, {}).setdefault(status, []).append(seconds)

    @staticmethod
    def summary(times: list[float]) -> dict[str, float | int]:
        return {"calls": len(times), "min": min(times), "max": max(times),
                "avg": sum(times) / len(times), "sum": sum(times)}

    def tables(self) -> list[tuple[str, dict[str, list[float]]]]:
        """(column, rows by name) of each table, in opcode and status order, as tshark's."""
        def name(opcode: int) -> str:
            return T.BY_OPCODE[opcode].name
        out = [("Opcode", {name(op): self.by_opcode[op] for op in sorted(self.by_opcode)})]
        out += [(f"{name(op)} status", {T.STATUS.describe(st): rows[st] for st in sorted(rows)})
                for op, rows in sorted(self.by_status.items())]
        return out

    def as_json(self) -> dict[str, Any]:
        by_opcode, *by_status = self.tables()
        return {"by_opcode": {op: self.summary(t) for op, t in by_opcode[1].items()},
                "by_opcode_status": {column.removesuffix(" status"): {st: self.summary(t) for st, t in rows.items()}
                                     for column, rows in by_status},
                "unanswered": self.unanswered}

    def text(self) -> list[str]:
        """tshark's SRT tables, in seconds: per opcode, then each opcode per status."""
        out: list[str] = []
        for column, rows in self.tables():
            if out:
                out.append("")
            out.append(f"{column:<22} {'Calls':>6} {'Min SRT':>10} {'Max SRT':>10} {'Avg SRT':>10} {'Sum SRT':>10}")
            for name, times in rows.items():
                s = self.summary(times)
                out.append(f"{name:<22} {s['calls']:>6} {s['min']:>10.6f} {s['max']:>10.6f} "
                           f"{s['avg']:>10.6f} {s['sum']:>10.6f}")
        answered = sum(len(t) for t in self.by_opcode.values())
        return [*out, "", f"{count(answered, 'request')} answered, {self.unanswered:,} unanswered"]

    @property
    def unanswered(self) -> int:
        return len(self.pending) + self.given_up


def where_it_ends(path: str | Path) -> str | None:
    """Why a capture stops being readable before its end (cut in the middle of a frame,
    a corrupt record), in ``kbtp decode``'s words; None when it reads to its end. Scapy's
    reader stops there silently, so what is built from its packets says this beside them."""
    from .decode.pcapfile import Reader
    try:
        with open(path, "rb") as stream:
            reader = Reader(stream, str(path))
            for _ in reader:
                pass
    except (OSError, CaptureError):
        return None                              # read_packets says what is wrong with it
    if reader.damage:
        return reader.damage
    return f"the capture ends in the middle of frame {reader.cut_short}" if reader.cut_short else None


def rdma_messages(packets: list[Packet]) -> list[RdmaMessage]:
    """RDMA messages of both bindings in Scapy packets, in the order their last frame
    was captured."""
    from .builders import iwarp, roce
    found = list(iwarp.iter_rdma_messages(packets)) + list(roce.iter_rdma_messages(packets))
    return sorted(found, key=lambda m: m.frames[-1] if m.frames else 0)


def session_key(msg: RdmaMessage) -> Hashable:
    """Both directions of a connection share its number and ADDR_LE state. On RoCEv2 the
    two directions name different QPs: ``decode.connections`` ties them for the streaming
    decoder and the Scapy path alike (``info["connection"]``); a message without it (one
    built by hand) falls back to the pair of IP addresses."""
    if msg.transport == "roce":
        return msg.info.get("connection") or frozenset(msg.conn[:2])
    return frozenset(msg.conn)


class KbtpSessions:
    """What ``kbtp_messages`` keeps while it reads: each connection's number (from 0, in
    order of appearance) and each session's ADDR_LE choice from its HELLO_ACK; ``addr_le``
    forces the byte order of sessions whose HELLO_ACK is not in the capture."""

    def __init__(self, addr_le: bool | None = None) -> None:
        self.addr_le = addr_le
        self._le: dict[Hashable, bool] = {}
        self._numbers: dict[Hashable, int] = {}

    def number(self, msg: RdmaMessage) -> int:
        """The connection number of any RDMA message of the session."""
        key = session_key(msg)
        return self._numbers.setdefault(key, len(self._numbers))

    def numbered(self, msg: RdmaMessage) -> int | None:
        """The connection number of the message's session, if a KBTP message gave it one."""
        return self._numbers.get(session_key(msg))

    def decode(self, msg: RdmaMessage) -> Found | None:
        """The KBTP message a Send carries, or None for anything else."""
        if msg.kind not in SEND_KINDS or not looks_like_kbtp(msg.payload):
            return None
        key = session_key(msg)
        number = self._numbers.setdefault(key, len(self._numbers))
        le = self._le.get(key, False) if self.addr_le is None else self.addr_le
        frame = msg.frames[-1] if msg.frames else 0
        try:
            fields = codec.decode(msg.payload, addr_le=le)
            error = None
        except codec.Malformed as exc:
            fields, error = exc.fields, exc.reason
        if fields.get("opcode") == _HELLO_ACK and not fields.get("status"):
            self._le[key] = bool(fields.get("hello_ack.features", 0) & Feature.ADDR_LE)
        return Found(frame, msg.transport, msg.conn, fields, error, msg.time, number,
                     msg.payload, le, tuple(msg.info.get("icrc_bad", ())), msg.info.get("src_qp"))


def kbtp_messages(messages: Iterable[RdmaMessage], addr_le: bool | None = None) -> Iterator[Found]:
    """Decode the KBTP messages among RDMA messages; ``addr_le`` forces the byte order
    of sessions whose HELLO_ACK is not in the capture (None: follow HELLO_ACK)."""
    decode = KbtpSessions(addr_le).decode
    for msg in messages:
        found = decode(msg)
        if found is not None:
            yield found


@cache
def _bits(opcode: int | None, key: str) -> tuple[tuple[str, int], ...]:
    """``(kbtp.flags.inline, mask)`` pairs of a flags word of this opcode."""
    index = T.wire_fields()
    if key not in index:
        return ()
    return tuple((f"kbtp.{bit}", mask) for bit, mask in
                 T.flag_bits(key, index[key][0], None if opcode is None else T.BY_OPCODE.get(opcode)))


@cache
def _json_key(key: str) -> str:
    return f"kbtp.{key}"


def endpoints(found: Found) -> dict[str, Any]:
    """Source and destination of the message: addresses, and the TCP ports (iWARP) or
    the destination QP (RoCE)."""
    if found.transport == "iwarp":
        (src, sport), (dst, dport) = found.conn
        return {"src": src, "src_port": sport, "dst": dst, "dst_port": dport}
    if found.transport == "roce":
        src, dst, qp = found.conn
        return {"src": src, "dst": dst, "dst_qp": qp}
    return {}


def to_json(found: Found) -> dict[str, Any]:
    """JSON object: frame, time (seconds since the epoch), transport, connection number
    and endpoints, then the fields keyed by display-filter names, numeric values, bytes as
    hex, one 0/1 key per named bit of every flags word (``kbtp.flags.inline``),
    ``malformed`` with the reason when the message is, and ``icrc_bad`` with the frames
    whose RoCE ICRC is wrong (the receiving NIC dropped them)."""
    out: dict[str, Any] = {"frame": found.frame}
    if found.time is not None:
        out["time"] = round(found.time, 6)     # a double holds no finer time this far from 1970
    out["transport"] = found.transport
    if found.connection is not None:
        out["conn"] = found.connection
        out.update(endpoints(found))
    fields: Mapping[str, Any] = found.fields      # every key, read generically
    opcode = fields.get("opcode")
    for key, value in fields.items():
        if isinstance(value, bytes):
            out[_json_key(key)] = value.hex()
            continue
        out[_json_key(key)] = value
        for bit_key, mask in _bits(opcode, key):
            out[bit_key] = int(bool(value & mask))
    if found.error:
        out["malformed"] = found.error
    if found.icrc_bad:
        out["icrc_bad"] = list(found.icrc_bad)
    return out
