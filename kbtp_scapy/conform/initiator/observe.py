"""What the checking target saw an initiator do: its messages and its one-sided accesses.

One ``Session`` per connection: the HELLO, every request as it was taken from its
receive buffer (with how many requests were then in flight), every completion sent,
and every RDMA Read, Write and atomic of the initiator on the target's memory, named by
the region the STag belongs to (table, pool, partition, ring, head, or an STag the
target never granted). Cases judge from these records after the program has ended.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ... import codec
from ...vocab import REQUESTS, AnyMessage, HelloAck, Opcode
from ...wire.iwarp import Startup
from ..registry import Skip

REGIONS = ("table", "pool", "partition", "ring", "head")


class Altered(Enum):
    """What the checking target did to the answer of one request, beyond the text."""

    WITHHELD = "its completion withheld"
    MISREPORTED = "executed, and answered with another status"
    NOT_EXECUTED = "answered with a status without being executed"
    LENGTH_LIE = "answered with a Data Length past its buffer"


@dataclass
class Access:
    """One RDMA access of the initiator on target memory."""

    at: float
    kind: str                    # "read", "write", "fetch_add", "compare_swap"
    region: str                  # one of REGIONS, or "unknown"
    stag: int
    offset: int
    length: int
    add: int = 0
    mask: int | None = None
    refused: str = ""            # why the RNIC refused it ("" when served)
    duplicate: bool = False      # a retransmitted Read the transport served again
    served: bytes = b""          # what a Read returned


@dataclass
class Message:
    at: float
    payload: bytes
    decoded: AnyMessage | None
    in_flight: int = 0           # requests taken and not yet completed, this one included


@dataclass
class Session:
    """One connection of the initiator under test."""

    opened: float = field(default_factory=time.monotonic)
    hello: AnyMessage | None = None
    hello_raw: bytes = b""
    granted: HelloAck = field(default_factory=lambda: HelloAck())   # the HELLO_ACK body sent
    stags: dict[int, str] = field(default_factory=dict)     # granted STag -> region
    addr_le: bool = False
    messages: list[Message] = field(default_factory=list)
    #: (time, Request ID, status, Block Offset) of each completion sent
    completions: list[tuple[float, int, int, int]] = field(default_factory=list)
    observed: list[Access] = field(default_factory=list)
    #: why the one-sided accesses cannot be seen ("" when they can)
    hidden: str = ""
    in_flight: int = 0
    max_in_flight: int = 0
    #: the initiator's MPA Request (iWARP; None where an RDMA device's CM took it)
    mpa: Startup | None = None
    closed: float | None = None
    #: the Generation each answer carried, by Request ID (what the initiator was shown)
    generations: dict[int, int] = field(default_factory=dict)
    #: Request ID -> what a misbehaving target did to its answer (``Altered``), for a
    #: model that must not read a withheld or misreported answer as the text's
    altered: dict[int, Altered] = field(default_factory=dict)
    #: (rule, detail): what only the checking target could see as it happened (a probe of
    #: a buffer refused, a Read issued while another was unanswered)
    noted: list[tuple[str, str]] = field(default_factory=list)

    @property
    def accesses(self) -> list[Access]:
        """The initiator's one-sided accesses: a case that judges them is a SKIP where the
        checker cannot see them (an RDMA device's responder serves them, in the kernel)."""
        if self.hidden:
            raise Skip(self.hidden)
        return self.observed

    def region(self, stag: int) -> str:
        return self.stags.get(stag, "unknown")

    def granted_features(self) -> int:
        return self.granted.get("hello_ack.features", 0)

    def requests(self, opcode: str | None = None) -> list[AnyMessage]:
        """The decoded requests (not HELLO or GOODBYE), of one opcode if given."""
        return [m.decoded for m in self.messages if m.decoded is not None
                and m.decoded["opcode"] in REQUESTS
                and (opcode is None or m.decoded["opcode"] == Opcode[opcode])]

    def message_opcodes(self) -> list[int]:
        return [m.payload[1] if len(m.payload) > 1 else -1 for m in self.messages]

    def taken(self, payload: bytes) -> Message:
        """A message the target took from a receive buffer."""
        try:
            decoded = codec.decode(payload, self.addr_le)
        except codec.Malformed:
            decoded = None
        if decoded is not None and decoded["opcode"] in REQUESTS:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        msg = Message(time.monotonic(), payload, decoded, self.in_flight)
        self.messages.append(msg)
        return msg

    def completed(self, request_id: int, status: int, block_offset: int = 0,
                  generation: int = 0) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self.completions.append((time.monotonic(), request_id, status, block_offset))
        self.generations[request_id] = generation

    def reads(self, region: str | None = None) -> list[Access]:
        return [a for a in self.accesses if a.kind == "read" and not a.duplicate
                and (region is None or a.region == region)]


class Record:
    """Every session of one case, in the order they connected."""

    def __init__(self, hidden: str = "") -> None:
        self.sessions: list[Session] = []
        self.hidden = hidden

    def new(self) -> Session:
        s = Session(hidden=self.hidden)
        self.sessions.append(s)
        return s

    @property
    def hellos(self) -> list[AnyMessage]:
        return [s.hello for s in self.sessions if s.hello is not None]

    def all(self, what: str) -> list[Any]:
        """``requests``, ``accesses`` or ``completions`` of every session, in order."""
        out: list[Any] = []
        for s in self.sessions:
            out += s.requests() if what == "requests" else getattr(s, what)
        return out
