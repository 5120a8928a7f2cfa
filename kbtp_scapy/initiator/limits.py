"""What a target's figures may make the initiator spend: its own limits, never the peer's word.

The client tools exist to be pointed at targets that are wrong. A HELLO_ACK's Block Size
sizes every buffer of a LOAD and every block a benchmark writes, its quota and the direct
modes' counts size loops, and every answer is waited for: each figure is checked against a
limit of the initiator's own, and every wait has a deadline (docs/DECISIONS.md, "The client
tools' own limits").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocab import Status
from .results import KbtpError

if TYPE_CHECKING:
    from .results import TargetInfo

MAX_BLOCK_SIZE = 16 << 20       # octets: a KV block of a large model is a few MiB (DECISIONS)
MAX_BLOCKS = 1 << 16            # blocks of a quota, a partition or a ring
WAIT = 60.0                     # seconds for any one answer, where the caller names no --timeout
MAX_UNMATCHED = 1024            # answers to no request kept for ``Initiator.raw``; older ones dropped


class PeerLimit(KbtpError):
    """The target's HELLO_ACK asks the initiator to spend more than its limits allow: the
    target's fault, said as MALFORMED as any HELLO_ACK the initiator cannot use is;
    ``target`` is what it granted."""

    def __init__(self, detail: str, target: TargetInfo) -> None:
        super().__init__(Status.MALFORMED, detail=detail)
        self.target = target


def connect_deadline(wait: float) -> float:
    """The bound on a whole ``Initiator.connect`` whose steps each wait ``wait`` seconds: the
    RNIC's set-up (its ``connect_timeout``) and then the HELLO_ACK. A bound of ``wait`` alone
    cut a silent HELLO_ACK short with a bare timeout, said as "is a target listening there?"
    where the connection was up and only the HELLO_ACK was missing."""
    return 2 * wait


class NoAnswer(TimeoutError):
    """The target did not answer within the initiator's deadline (``Limits.wait``)."""


@dataclass(frozen=True)
class Limits:
    """The initiator's own bounds on what a target's figures may make it spend."""

    max_block_size: int = MAX_BLOCK_SIZE    # Block Size and Max Inline, in octets
    max_blocks: int = MAX_BLOCKS            # Allocation Quota, Partition and Ring Counts
    wait: float = WAIT                      # seconds: HELLO_ACK, each completion, each RDMA Read,
    #                                         Write and atomic of the direct modes
    max_unmatched: int = MAX_UNMATCHED

    def check(self, target: TargetInfo) -> None:
        """``PeerLimit`` naming the first figure of ``target`` past its limit."""
        octets = {"Block Size": target.block_size, "Max Inline": target.max_inline}
        blocks = {"Allocation Quota": target.quota,
                  "Partition Count": target.fields.get("partition.count", 0),
                  "Ring Count": target.fields.get("ring.count", 0)}
        for name, value in octets.items():
            if value > self.max_block_size:
                raise PeerLimit(f"the HELLO_ACK's {name} of {value} octets is past this initiator's "
                                f"limit of {self.max_block_size}", target)
        for name, value in blocks.items():
            if value > self.max_blocks:
                raise PeerLimit(f"the HELLO_ACK's {name} of {value} is past this initiator's limit "
                                f"of {self.max_blocks} blocks", target)
