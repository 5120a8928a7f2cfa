"""Find every KBTP message in a capture, over either binding, with session state.

The transports reassemble RDMA messages (``transport.iwarp`` / ``transport.roce``);
this module decodes the Sends that carry KBTP with the codec, following each session's
ADDR_LE choice from its HELLO_ACK.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from scapy.error import Scapy_Exception
from scapy.packet import Packet
from scapy.utils import PcapReader

from . import codec, tables as T
from .layers.kbtp import looks_like_kbtp
from .transport import iwarp, roce
from .transport.message import RdmaMessage

SEND_KINDS = {"send", "send_inv"}
_ADDR_LE = T.flag(T.FEATURES, "ADDR_LE")


class CaptureError(Exception):
    """A file that is not a readable pcap or pcapng capture."""


@dataclass
class Found:
    """One KBTP message: where it was, what it says, and what is wrong with it."""

    frame: int
    transport: str
    conn: tuple
    fields: dict[str, Any]
    error: str | None = None


def read_packets(path: str | Path) -> list[Packet]:
    """All packets of a pcap or pcapng file (Ethernet or raw IP link types)."""
    try:
        with PcapReader(str(path)) as reader:
            return list(reader)
    except FileNotFoundError:
        raise CaptureError(f"{path}: no such file") from None
    except (Scapy_Exception, EOFError, ValueError, OSError) as exc:
        raise CaptureError(f"{path}: not a pcap or pcapng capture ({exc})") from None


def rdma_messages(packets: list[Packet]) -> list[RdmaMessage]:
    """RDMA messages of both bindings, in the order their last frame was captured."""
    found = list(iwarp.iter_rdma_messages(packets)) + list(roce.iter_rdma_messages(packets))
    return sorted(found, key=lambda m: m.frames[-1] if m.frames else 0)


def session_key(msg: RdmaMessage) -> frozenset:
    """Both directions of a connection share ADDR_LE state. On RoCEv2 the two directions
    name different QPs, so the pair of IP addresses stands for the session."""
    if msg.transport == "roce":
        return frozenset(msg.conn[:2])
    return frozenset(msg.conn)


def kbtp_messages(messages: Iterable[RdmaMessage], addr_le: bool | None = None) -> Iterator[Found]:
    """Decode the KBTP messages among RDMA messages; ``addr_le`` forces the byte order
    of sessions whose HELLO_ACK is not in the capture (None: follow HELLO_ACK)."""
    sessions: dict[frozenset, bool] = {}
    for msg in messages:
        if msg.kind not in SEND_KINDS or not looks_like_kbtp(msg.payload):
            continue
        key = session_key(msg)
        le = sessions.get(key, False) if addr_le is None else addr_le
        frame = msg.frames[-1] if msg.frames else 0
        try:
            fields = codec.decode(msg.payload, addr_le=le)
            error = None
        except codec.Malformed as exc:
            fields, error = exc.fields, exc.reason
        if fields.get("opcode") == T.BY_NAME["HELLO_ACK"].opcode and not fields.get("status"):
            sessions[key] = bool(fields.get("hello_ack.features", 0) & _ADDR_LE)
        yield Found(frame, msg.transport, msg.conn, fields, error)


def to_json(found: Found) -> dict[str, Any]:
    """JSON object keyed by display-filter names, numeric values, bytes as hex, and one
    0/1 key per named bit of every flags word (``kbtp.flags.inline``)."""
    out: dict[str, Any] = {"frame": found.frame, "transport": found.transport}
    msg = T.BY_OPCODE.get(found.fields.get("opcode"))
    index = T.wire_fields()
    for key, value in found.fields.items():
        out[f"kbtp.{key}"] = value.hex() if isinstance(value, bytes) else value
        for bit_key, mask in T.flag_bits(key, index[key][0], msg):
            out[f"kbtp.{bit_key}"] = int(bool(value & mask))
    if found.error:
        out["malformed"] = found.error
    return out
