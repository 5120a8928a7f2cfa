"""What the initiator API returns and raises."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..tables.enums import STATUS


class KbtpError(Exception):
    """A request completed with a non-OK status; ``status`` is its number, ``name`` its name."""

    def __init__(self, status: int, result: Result | None = None, detail: str = ""):
        self.status, self.name, self.result = status, STATUS.describe(status), result
        super().__init__(f"{self.name}{': ' + detail if detail else ''}")


@dataclass
class Result:
    """A completed request: the COMPLETION's (or completion record's) values."""

    request_id: int
    status: int
    generation: int
    data_length: int
    block_offset: int
    data: bytes | None = None       # LOAD and DIRECT_LOAD: the block's data
    record: bool = False            # completed through a completion record

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
