"""What a target is told at start: pool geometry, session limits, features, timers."""
from __future__ import annotations

from dataclasses import dataclass

from ..tables.enums import FEATURES, flag

DIRECT_LOAD = flag(FEATURES, "DIRECT_LOAD")
DIRECT_ALLOC = flag(FEATURES, "DIRECT_ALLOC")
RECORD_COMPLETION = flag(FEATURES, "RECORD_COMPLETION")
ADDR_LE = flag(FEATURES, "ADDR_LE")


@dataclass
class TargetConfig:
    """A target's parameters; ``validate`` says in one line what is inconsistent.

    Each session gets ``quota`` blocks and a range of ``handles_per_initiator``
    handles. ``direct_partitions`` of ``quota`` blocks each are set aside at the end
    of the pool for DIRECT_ALLOC sessions; the rest feeds the shared ring, so the sum
    of the quotas of the admitted sessions never exceeds F (spec "Allocation Quotas").
    """

    blocks: int = 1024
    block_size: int = 4096
    features: int = DIRECT_LOAD | DIRECT_ALLOC | RECORD_COMPLETION
    addr_le: bool = False
    max_initiators: int = 8
    quota: int = 0                   # 0: blocks // max_initiators
    handles_per_initiator: int = 0   # 0: 2 * quota
    direct_partitions: int = -1      # -1: max_initiators // 2 when DIRECT_ALLOC is offered
    base_handle: int = 0x4000
    request_credits: int = 32
    max_inline: int = 4096
    ticket_timeout_ms: int = 2000
    retention_s: float = 300.0
    clear_freed: bool = True         # clear blocks on free: initiators are separate trust domains
    memory_order: str = "little"     # the target's memory byte order (ring counters)

    def __post_init__(self) -> None:
        if not self.quota and self.max_initiators > 0:
            self.quota = self.blocks // self.max_initiators
        if not self.handles_per_initiator:
            self.handles_per_initiator = max(16, 2 * self.quota)
        if self.direct_partitions < 0:
            self.direct_partitions = self.max_initiators // 2 if self.features & DIRECT_ALLOC else 0
        self.max_inline = min(self.max_inline, self.block_size)

    def validate(self) -> None:
        if self.blocks < 1 or self.block_size < 1:
            raise ValueError("--blocks and --block-size must be at least 1")
        if self.block_size % 8:
            raise ValueError("--block-size must be a multiple of 8")
        if self.max_initiators < 1 or self.quota < 1:
            raise ValueError(f"{self.blocks} blocks cannot give {self.max_initiators} initiators "
                             f"a quota of at least one block")
        if self.quota * self.max_initiators > self.blocks:
            raise ValueError(f"quota {self.quota} x {self.max_initiators} initiators exceeds "
                             f"the {self.blocks} blocks (the sum of quotas must not exceed F)")
        if self.direct_partitions > self.max_initiators:
            raise ValueError("--direct-partitions cannot exceed --max-initiators")
        if self.base_handle + self.max_initiators * self.handles_per_initiator >= 1 << 64:
            raise ValueError("handle ranges do not fit in 64 bits")
        if not 1 <= self.request_credits <= 0xFFFF:
            raise ValueError("--credits must be 1 to 65535")

    @property
    def shared_blocks(self) -> int:
        return self.blocks - self.direct_partitions * self.quota
