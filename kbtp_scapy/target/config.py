"""What a target is told at start: pool geometry, session limits, features, timers."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..rnic.memory import ByteOrder
from ..vocab import Feature

#: Who may be offered the direct modes unless told otherwise: this host's own peers only
#: (docs/DECISIONS.md, "Trust for the direct modes").
LOOPBACK = ("127.0.0.0/8", "::1/128")


@dataclass
class TargetConfig:
    """A target's parameters; ``validate`` says in one line what is inconsistent.

    Each session gets ``quota`` blocks and a range of ``handles_per_initiator``
    handles. ``direct_partitions`` of ``quota`` blocks each are set aside at the end
    of the pool for DIRECT_ALLOC sessions; the rest feeds the shared ring, so the sum
    of the quotas of the admitted sessions never exceeds F (spec "Allocation Quotas").

    The limits below bound what one peer can make the target hold, in count and in time
    (docs/TOOLS.md, "Limits"): liveness probes, the backlog of undelivered data per connection,
    connections in set-up, and the deadline of each set-up phase.
    """

    blocks: int = 1024
    block_size: int = 4096
    features: int = Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC | Feature.RECORD_COMPLETION
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
    min_retention_s: float = 10.0    # under pressure, a retained session holding blocks gives way after this
    idle_timeout_s: float = 30.0     # under pressure, an active session silent this long gives way
    min_tenure_s: float = 30.0       # when full, a busy session held this long may be displaced
    clear_freed: bool = True         # clear blocks on free: initiators are separate trust domains
    trust: tuple[str, ...] = LOOPBACK    # peers (CIDR) offered DIRECT_LOAD and DIRECT_ALLOC
    memory_order: ByteOrder = "little"     # the target's memory byte order (ring counters)
    probe_interval_s: float = 10.0   # silence before a liveness probe (and TCP keepalive)
    probe_timeout_s: float = 10.0    # a probe's answer deadline (and TCP_USER_TIMEOUT)
    max_backlog: int = 4 << 20       # undelivered octets per connection before it is throttled
    backlog_timeout_s: float = 10.0  # throttled longer than this: the connection is terminated
    max_half_open: int = 128         # connections in set-up or without a session, per listener
    max_half_open_per_source: int = 16   # the same, per source address
    max_sessions_per_source: int = 4     # sessions (active or retained) per untrusted source
    cm_timeout_s: float = 1.0        # RoCEv2: REP resent after this long without RTU
    cm_retries: int = 2              # RoCEv2: REP resends per REQ
    mpa_timeout_s: float = 5.0       # iWARP: MPA set-up deadline after the TCP handshake
    hello_timeout_s: float = 5.0     # a connection without a session is closed after this
    execution: str = "software"      # or "chains": LOAD, inline STORE as chains (target/chains.py)

    def __post_init__(self) -> None:
        if not self.quota and self.max_initiators > 0:
            self.quota = self.blocks // self.max_initiators
        if not self.handles_per_initiator:
            self.handles_per_initiator = max(16, 2 * self.quota)
        if self.direct_partitions < 0:
            self.direct_partitions = self.max_initiators // 2 if self.features & Feature.DIRECT_ALLOC else 0
        self.max_inline = min(self.max_inline, self.block_size)
        if self.execution == "chains":   # a chain's CAS compares octets in its WQE order
            self.memory_order = "little" if self.addr_le else "big"
        self._trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def trusts(self, host: str) -> bool:
        """Whether a peer at ``host`` may be offered the direct modes (spec "Security
        Considerations": only to initiators trusted for every block the STags reach)."""
        if not self._trusted:
            self._trusted = tuple(ipaddress.ip_network(n, strict=False) for n in self.trust)
        try:
            address = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return False
        if address.version == 6 and address.ipv4_mapped:
            address = address.ipv4_mapped
        return any(address in net for net in self._trusted)

    def validate(self) -> None:
        if self.blocks < 1 or self.block_size < 1:
            raise ValueError("--blocks and --block-size must be at least 1")
        for net in self.trust:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"--trust {net}: not an address or CIDR network "
                                 "(for example 10.0.0.0/8 or fd00::/8)") from None
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
        if self.execution not in ("software", "chains"):
            raise ValueError("--execution is software or chains")
        if not 1 <= self.request_credits <= 0xFFFF:
            raise ValueError("--credits must be 1 to 65535")
        for name, value in self.limits().items():
            zero_ok = name in ("cm_retries", "retention", "min_retention")
            if value < 0 or value == 0 and not zero_ok:
                raise ValueError(f"--{name.replace('_', '-')} must be "
                                 f"{'at least 0' if zero_ok else 'positive'}")

    def limits(self) -> dict[str, float]:
        """Every bound on what a peer can make the target hold, by option name (without
        the ``_s`` of seconds): shown by ``kbtp target --help`` and in the metrics."""
        names = ("probe_interval_s", "probe_timeout_s", "max_backlog", "backlog_timeout_s",
                 "max_half_open", "max_half_open_per_source", "cm_timeout_s", "cm_retries",
                 "mpa_timeout_s", "hello_timeout_s", "retention_s", "min_retention_s",
                 "idle_timeout_s", "min_tenure_s", "max_sessions_per_source")
        return {name.removesuffix("_s"): getattr(self, name) for name in names}

    @property
    def shared_blocks(self) -> int:
        return self.blocks - self.direct_partitions * self.quota
