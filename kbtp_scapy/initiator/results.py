"""What the initiator API returns and raises."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .. import codec
from ..rnic.memory import MemoryRegion
from ..rnic.qp import ENDINGS, ConnectionLost, Received
from ..tables import memory as M
from ..tables.enums import STATUS
from ..vocab import AnyMessage, Opcode

Waiting = dict[int, tuple[asyncio.Future, MemoryRegion | None]]
"""Requests awaiting their answer: Request ID -> (future, completion-record region)."""


class KbtpError(Exception):
    """A request completed with a non-OK status; ``status`` is its number, ``name`` its name."""

    def __init__(self, status: int, result: Result | None = None, detail: str = ""):
        self.status, self.name, self.result = status, STATUS.describe(status), result
        self.detail = detail        # what the initiator saw, when no completion said it
        self.hello_ack = b""        # a refused HELLO's HELLO_ACK, as it came
        super().__init__(f"{self.name}{': ' + detail if detail else ''}")


class SessionEnded(ConnectionLost):
    """The connection ended under a request the caller was waiting on (``raw``), or before a
    GOODBYE with RELEASE could be sent: ``how`` is its fate (``rnic.qp.ENDINGS``: terminate,
    dreq, fin, reset, qp_error, ...), ``reason`` the RNIC's words, ``answers`` what came back
    before the end."""

    def __init__(self, what: str, lost: BaseException, answers: list[Received] | None = None) -> None:
        how = getattr(lost, "how", "lost")
        self.reason = str(lost) or ENDINGS[how]
        self.answers = answers or []
        super().__init__(f"{what}: {ENDINGS[how]} ({self.reason})", how=how)


@dataclass
class Result:
    """A completed request: the COMPLETION's (or completion record's) values."""

    request_id: int
    status: int
    generation: int
    data_length: int
    block_offset: int
    data: bytes = b""               # LOAD and DIRECT_LOAD: the block's data
    record: bool = False            # completed through a completion record
    #: perf_counter_ns when the request was handed to the RNIC and when its answer came in:
    #: the request-to-completion time a capture shows (kbtp.time), for benchmarks
    sent_ns: int = 0
    answered_ns: int = 0

    @classmethod
    def of_completion(cls, request_id: int, c: AnyMessage) -> Result:
        """The result a decoded COMPLETION ``c`` gives the request ``request_id``."""
        return cls(request_id, c["status"], c["generation"], c["completion.data_length"],
                   c["completion.block_offset"])

    @property
    def status_name(self) -> str:
        return STATUS.describe(self.status)

    def as_dict(self) -> dict[str, Any]:
        d = {"request_id": self.request_id, "status": self.status_name, "generation": self.generation,
             "data_length": self.data_length, "block_offset": self.block_offset}
        if self.record:
            d["record"] = True
        return d


@dataclass
class TargetInfo:
    """The HELLO_ACK: what the target granted this session."""

    features: int
    request_credits: int
    block_size: int
    max_inline: int
    quota: int
    handle_base: int
    handle_count: int
    ticket_timeout_ms: int
    fields: dict[str, Any] = field(default_factory=dict)   # direct-mode descriptors

    def feature(self, flag: int) -> bool:
        return bool(self.features & flag)


def match_completion(msg: Received, waiting: Waiting,
                     addr_le: bool) -> tuple[asyncio.Future, Result] | None:
    """Take the request ``msg`` answers out of ``waiting``, with its ``Result``: a
    COMPLETION Send by Request ID, or a completion record written with Write with
    Immediate, whose Immediate Data is the low 32 bits of the ID. None when it answers
    none of them (the caller decides what an unmatched message is)."""
    if msg.write_imm:
        rid = next((r for r, (_, record) in waiting.items()
                    if record is not None and r & 0xFFFFFFFF == msg.imm), None)
        if rid is None:
            return None
        future, record = waiting.pop(rid)
        assert record is not None          # rid was found by its record
        d = codec.decode_struct(M.COMPLETION_RECORD, bytes(record.view), addr_le)
        return future, Result(d["record.request_id"], d["record.status"], d["record.generation"],
                              d["record.data_length"], d["record.block_offset"], record=True)
    try:
        c = codec.decode(msg.payload, addr_le)
    except codec.Malformed:
        return None
    if c["opcode"] != Opcode.COMPLETION or c["request_id"] not in waiting:
        return None
    future, _ = waiting.pop(c["request_id"])
    return future, Result.of_completion(c["request_id"], c)
