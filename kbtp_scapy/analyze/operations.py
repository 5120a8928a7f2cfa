"""The one-sided RDMA operations of a capture, each put together with its answer.

``decode.rdma_operations`` yields RDMA messages as the wire carries them: a Read Request
and, later and the other way, its Read Response; an Atomic and its answer. Here each
becomes one ``Operation`` in the terms both bindings share (STag, offset, length, the
operands and the original value), the answer paired with its request as the binding
pairs them: on iWARP a Read Response by the sink STag and Tagged Offset its request
named (RFC 5040 s4.5), an Atomic Response by the request's identifier (RFC 7306 s5); on
RoCEv2 both by the PSN of the request they answer, on the opposite direction (IBA 9.7.1).
Requests waiting for their answer are bounded (``MAX_WAITING``), so a peer that never
answers costs no memory: the oldest is given up, unanswered.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import StrEnum

from ..capture import session_key
from ..wire.iwarp import ATOMIC_CMP_SWAP, ATOMIC_FETCH_ADD, ATOMIC_SWAP
from ..wire.message import RdmaMessage

MAX_WAITING = 1 << 12       # Reads and Atomics of a capture waiting for their answer


class RdmaOp(StrEnum):
    """What an ``Operation`` did, as the ``rdma_op`` column names it."""

    WRITE = "WRITE"
    READ = "READ"
    FETCH_ADD = "FETCH_ADD"
    SWAP = "SWAP"
    CMP_SWAP = "CMP_SWAP"


_IWARP_ATOMICS = {ATOMIC_FETCH_ADD: RdmaOp.FETCH_ADD, ATOMIC_SWAP: RdmaOp.SWAP,
                  ATOMIC_CMP_SWAP: RdmaOp.CMP_SWAP}
_ROCE_ATOMICS = {"RC_FETCH_ADD": RdmaOp.FETCH_ADD, "RC_COMPARE_SWAP": RdmaOp.CMP_SWAP}


@dataclass
class Operation:
    """One RDMA operation: who asked (``src``) of whom (``dst``), on which memory, and
    what came back. ``frames`` carried the request; ``data`` is what was written or read
    where the decoder kept it (small ones: a table entry, a ring slot, a record)."""

    op: RdmaOp
    transport: str
    session: Hashable
    src: str
    dst: str
    frames: list[int]
    time: float | None
    stag: int
    offset: int
    length: int = 0
    data: bytes = b""
    operand: int | None = None          # FetchAdd's Add Data, Swap's or CmpSwap's Swap Data
    compare: int | None = None          # CmpSwap's Compare Data
    original: int | None = None         # an Atomic's answer: the value before it
    answer_frames: list[int] = field(default_factory=list)
    answer_time: float | None = None
    message: RdmaMessage | None = None  # the request, for its connection's number


def _ends(msg: RdmaMessage) -> tuple[str, str]:
    if msg.transport == "iwarp":
        return str(msg.conn[0][0]), str(msg.conn[1][0])
    return str(msg.conn[0]), str(msg.conn[1])


def _operation(msg: RdmaMessage, op: RdmaOp, stag: int, offset: int, length: int, data: bytes = b"",
               operand: int | None = None, compare: int | None = None) -> Operation:
    src, dst = _ends(msg)
    return Operation(op, msg.transport, session_key(msg), src, dst, list(msg.frames), msg.time,
                     stag, offset, length, data, operand, compare, message=msg)


def _length(msg: RdmaMessage) -> int:
    return int(msg.info.get("length", len(msg.payload)))


class Pairing:
    """Feed every RDMA message that is not a Send; get the operations they complete."""

    def __init__(self) -> None:
        self._waiting: dict[tuple, Operation] = {}

    def feed(self, msg: RdmaMessage) -> list[Operation]:
        info, kind = msg.info, msg.kind
        roce = msg.transport == "roce"
        if kind in ("write", "write_imm"):
            if not _length(msg):
                return []                   # no data: an iWARP RTR, a zero-length probe
            small = msg.payload if _length(msg) == len(msg.payload) else b""
            stag, offset = (info.get("rkey"), info.get("va")) if roce else (info.get("stag"), info.get("to"))
            if stag is None or offset is None:
                return []                   # a Write whose first packet the capture lacks
            return [_operation(msg, RdmaOp.WRITE, stag, offset, length=_length(msg), data=small)]
        if kind == "read_request":
            if roce:
                if "rkey" not in info:
                    return []
                op = _operation(msg, RdmaOp.READ, info["rkey"], info["va"], length=info["dma_length"])
                return self._wait((msg.conn[0], msg.conn[1], info["psn"]), op)
            if "src_stag" not in info:
                return []
            op = _operation(msg, RdmaOp.READ, info["src_stag"], info["src_to"], length=info["read_size"])
            return self._wait((msg.conn, info["sink_stag"], info["sink_to"]), op)
        if kind == "atomic_request":
            if roce:
                which = _ROCE_ATOMICS.get(info.get("opcode", ""))
                if which is None:
                    return []
                op = _operation(msg, which, info["rkey"], info["va"], length=8, operand=info["swap_add"],
                                compare=info["compare"] if which == RdmaOp.CMP_SWAP else None)
                return self._wait((msg.conn[0], msg.conn[1], info["psn"]), op)
            which = _IWARP_ATOMICS.get(info.get("aopcode", -1))
            if which is None:
                return []
            op = _operation(msg, which, info["remote_stag"], info["remote_to"], length=8, operand=info["data"],
                            compare=info["compare_data"] if which == RdmaOp.CMP_SWAP else None)
            return self._wait((msg.conn, "atomic", info["req_id"]), op)
        if kind == "read_response":
            key = ((msg.conn[1], msg.conn[0], info.get("psn")) if roce else
                   ((msg.conn[1], msg.conn[0]), info.get("stag"), info.get("to")))
            return self._answer(key, msg, data=msg.payload if _length(msg) == len(msg.payload) else b"")
        if kind == "atomic_response":
            key = ((msg.conn[1], msg.conn[0], info.get("psn")) if roce else
                   ((msg.conn[1], msg.conn[0]), "atomic", info.get("orig_req_id")))
            return self._answer(key, msg, original=info.get("orig_data"))
        return []

    def _wait(self, key: tuple, op: Operation) -> list[Operation]:
        given_up = [self._waiting.pop(key)] if key in self._waiting else []
        self._waiting[key] = op
        if len(self._waiting) > MAX_WAITING:
            given_up.append(self._waiting.pop(next(iter(self._waiting))))
        return given_up

    def _answer(self, key: tuple, msg: RdmaMessage, data: bytes = b"",
                original: int | None = None) -> list[Operation]:
        op = self._waiting.pop(key, None)
        if op is None:
            return []
        op.answer_frames, op.answer_time = list(msg.frames), msg.time
        op.data, op.original = data, original
        return [op]

    def flush(self) -> list[Operation]:
        """Reads and Atomics never answered in the capture."""
        left = list(self._waiting.values())
        self._waiting.clear()
        return left
