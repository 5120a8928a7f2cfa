"""Sample sessions: every opcode and every status code, with the RDMA traffic each causes.

The session is written once against ``builders.recorder.Recorder`` and recorded over both
bindings; ``tools/make_pcaps.py`` writes the committed ``pcaps/`` from it, and
``kbtp demo`` decodes it back. Messages are built with the codec from the tables.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from . import codec, ring, tables as T
from .builders.recorder import TRANSPORTS, recorder
from .vocab import AnyMessage, Completion, Feature, GoodbyeFlag, Opcode, RequestFlag, Status

BLOCK = 32 * 1024
POOL_STAG, TABLE_STAG, RING_STAG, HEAD_STAG, PARTITION_STAG = 0x100, 0x200, 0x300, 0x400, 0x500
BUF_STAG, RECORD_STAG = 0x1234, 0x5678
HANDLE_BASE = 0x4000
RING_LOG2 = 2                     # the ring has N = 2**n slots; ring.* take n
RING_N = 1 << RING_LOG2


def _flags(*names: str) -> int:
    return sum(RequestFlag[n] for n in names)


class _Session:
    """Request IDs, completions and the RDMA operations of one scripted session."""

    def __init__(self, transport: str, addr_le: bool, ipv6: bool) -> None:
        self.rec = recorder(transport, ipv6=ipv6)
        self.transport = transport
        self.addr_le = addr_le
        self.rid = 0

    def request(self, **values: Any) -> int:
        """One request; ``values`` as the codec's keys (dotted ones through ``**{...}``)."""
        self.rid += 1
        self.rec.send(True, codec.encode(cast(AnyMessage, {"request_id": self.rid, **values}), self.addr_le))
        return self.rid

    def complete(self, rid: int, handle: int, status: str = "OK", generation: int = 0,
                 length: int = 0, offset: int = 0, invalidate: int | None = None) -> None:
        msg: Completion = {"opcode": Opcode.COMPLETION, "request_id": rid, "handle": handle,
               "generation": generation, "status": Status[status],
               "completion.data_length": length, "completion.block_offset": offset}
        self.rec.send(False, codec.encode(msg, self.addr_le), invalidate=invalidate)

    def record(self, rid: int, status: str, generation: int, length: int, offset: int) -> None:
        """A completion record written with RDMA Write with Immediate (RoCEv2 only)."""
        rec = codec.encode_struct(T.COMPLETION_RECORD, {
            "record.request_id": rid, "record.status": Status[status], "record.generation": generation,
            "record.data_length": length, "record.block_offset": offset}, self.addr_le)
        self.rec.write(False, rec, RECORD_STAG, 0, imm=rid & 0xFFFFFFFF)


def record_session(transport: str, path: str | Path, addr_le: bool = False,
                   ipv6: bool = False) -> None:
    """Write one capture holding every opcode and status code over ``transport``."""
    s = _Session(transport, addr_le, ipv6)
    features = ["DIRECT_LOAD", "DIRECT_ALLOC"] + (["RECORD_COMPLETION"] if transport == "roce" else [])
    if addr_le:
        features.append("ADDR_LE")
    feature_bits = sum(Feature[f] for f in features)
    s.rec.send(True, codec.encode({"opcode": Opcode.HELLO, "hello.requested_features": feature_bits,
                                   "hello.completion_credits": 16,
                                   "hello.initiator_id": bytes(range(16))}))
    s.rec.send(False, codec.encode({
        "opcode": Opcode.HELLO_ACK, "hello_ack.features": feature_bits,
        "hello_ack.request_credits": 16, "hello_ack.block_size": BLOCK, "hello_ack.max_inline": 4096,
        "hello_ack.allocation_quota": 8, "hello_ack.handle_base": HANDLE_BASE,
        "hello_ack.handle_count": 256, "hello_ack.ticket_timeout": 1000,
        "hello_ack.table.stag": TABLE_STAG, "hello_ack.table.count": 256,
        "hello_ack.table_base_handle": HANDLE_BASE, "hello_ack.pool.stag": POOL_STAG,
        "hello_ack.pool.count": 64, "hello_ack.partition.stag": PARTITION_STAG,
        "hello_ack.partition.offset": 40 * BLOCK, "hello_ack.partition.count": RING_N,
        "hello_ack.ring.stag": RING_STAG, "hello_ack.ring.count": RING_N,
        "hello_ack.head.stag": HEAD_STAG, "hello_ack.head.count": 1}))

    # ALLOC_STORE of the specification's example, then a LOAD of it (RDMA Write of the data).
    h = HANDLE_BASE + 1
    rid = s.request(opcode=Opcode.ALLOC_STORE, flags=_flags("INLINE", "SEAL"), handle=h,
                    inline_data=b"KVBLOCK!")
    s.complete(rid, h, generation=5, length=8, offset=42 * BLOCK)
    rid = s.request(opcode=Opcode.LOAD, handle=h, **{"dd.stag": BUF_STAG, "dd.offset": 0x7F0000,
                                                      "dd.length": BLOCK})
    s.rec.write(False, b"KVBLOCK!", BUF_STAG, 0x7F0000)
    s.complete(rid, h, generation=5, length=8, offset=42 * BLOCK)

    # A non-inline store: the target reads the data from the initiator's buffer, and
    # completes with Send with Invalidate of that buffer's STag.
    h2 = HANDLE_BASE + 2
    data = bytes(range(256)) * 12
    rid = s.request(opcode=Opcode.ALLOC_STORE, flags=_flags("INVALIDATE"), handle=h2,
                    **{"dd.stag": BUF_STAG + 1, "dd.offset": 0x10000, "dd.length": len(data)})
    s.rec.read(False, data, BUF_STAG + 1, 0x10000, POOL_STAG, 7 * BLOCK)
    s.complete(rid, h2, generation=1, length=len(data), offset=7 * BLOCK, invalidate=BUF_STAG + 1)
    rid = s.request(opcode=Opcode.STORE, flags=_flags("INLINE"), handle=h2, inline_data=b"more")
    s.complete(rid, h2, generation=1, length=4, offset=7 * BLOCK)

    # FREE, with a completion record where the binding offers RECORD_COMPLETION.
    if transport == "roce":
        rid = s.request(opcode=Opcode.FREE, handle=h2, **{"cd.stag": RECORD_STAG, "cd.offset": 0})
        s.record(rid, "OK", 2, 0, 7 * BLOCK)
    else:
        rid = s.request(opcode=Opcode.FREE, handle=h2)
        s.complete(rid, h2, generation=2, offset=7 * BLOCK)

    # DIRECT_ALLOC: FetchAdd on the Head, read the slot, write the data, BIND.
    masked = transport == "iwarp"
    ticket, slot_offset, _ = ring.fetch_add(0, RING_LOG2, masked=masked)
    add = T.RING_COUNTER.masked_add_data if masked else T.RING_COUNTER.unmasked_add_data
    s.rec.fetch_add(True, HEAD_STAG, 0, add, ring.add_mask(RING_LOG2) if masked else 0, original=0)
    block_offset = 40 * BLOCK
    slot = codec.encode_struct(T.RING_SLOT, {"slot.sequence": ticket,
                                             "slot.block_offset": block_offset}, addr_le)
    s.rec.read(True, slot, RING_STAG, slot_offset, BUF_STAG + 2, 0)
    s.rec.write(True, b"direct!!", PARTITION_STAG, block_offset)
    h3 = HANDLE_BASE + 3
    rid = s.request(opcode=Opcode.BIND, handle=h3, **{"bind.ticket": ticket, "bind.data_length": 8,
                                                      "bind.block_offset": block_offset})
    s.complete(rid, h3, generation=1, length=8, offset=block_offset)

    # DIRECT_LOAD: read the entry, the block, the entry again.
    entry = codec.encode_struct(T.TABLE_ENTRY, {"entry.flags": 3, "entry.generation": 5,
                                                "entry.data_length": 8,
                                                "entry.block_offset": 42 * BLOCK}, addr_le)
    for stag, offset, payload in ((TABLE_STAG, 16, entry), (POOL_STAG, 42 * BLOCK, b"KVBLOCK!"),
                                  (TABLE_STAG, 16, entry)):
        s.rec.read(True, payload, stag, offset, BUF_STAG + 3, 0)

    # Every failure status, each on the request that provokes it.
    failures: list[tuple[str, dict[str, Any]]] = [
        ("INVALID_HANDLE", dict(opcode=Opcode.FREE, handle=0x9999)),
        ("STALE_GENERATION", dict(opcode=Opcode.LOAD, handle=h, generation=4,
                                  **{"dd.stag": BUF_STAG, "dd.length": BLOCK})),
        ("NOT_VALID", dict(opcode=Opcode.LOAD, handle=h2, **{"dd.stag": BUF_STAG, "dd.length": BLOCK})),
        ("ALREADY_BOUND", dict(opcode=Opcode.ALLOC_STORE, handle=h, inline_data=b"x")),
        ("NO_SPACE", dict(opcode=Opcode.ALLOC_STORE, handle=h2 + 8, inline_data=b"y")),
        ("SEALED", dict(opcode=Opcode.STORE, handle=h, inline_data=b"z")),
        ("NOT_SEALED", dict(opcode=Opcode.LOAD, handle=h3, **{"dd.stag": BUF_STAG, "dd.length": 8})),
        ("TOO_LARGE", dict(opcode=Opcode.LOAD, handle=h, **{"dd.stag": BUF_STAG, "dd.length": 4})),
        ("MALFORMED", dict(opcode=Opcode.STORE, flags=_flags("INLINE"), handle=h2,
                           inline_data=b"abc", **{"dd.length": 9})),
        ("INTERNAL", dict(opcode=Opcode.LOAD, handle=h3, flags=_flags("ALLOW_UNSEALED"),
                          **{"dd.stag": BUF_STAG, "dd.length": BLOCK})),
        ("TICKET_ABANDONED", dict(opcode=Opcode.BIND, handle=h3 + 1,
                                  **{"bind.ticket": 1, "bind.block_offset": 41 * BLOCK})),
    ]
    generations = {h: 5, h3: 1}
    for status, req in failures:
        rid = s.request(**req)
        s.complete(rid, req["handle"], status, generations.get(req["handle"], 0))
    s.request(opcode=Opcode.GOODBYE, flags=GoodbyeFlag.RELEASE)
    s.rec.write_pcap(path)


def sample_paths(outdir: str | Path) -> dict[str, tuple[str, bool, bool]]:
    """File name -> (transport, addr_le, ipv6) of the committed sample captures."""
    out = {f"{t}_session.pcap": (t, False, False) for t in TRANSPORTS}
    out["roce_addr_le_ipv6_session.pcap"] = ("roce", True, True)
    out["iwarp_addr_le_ipv6_session.pcap"] = ("iwarp", True, True)
    return {str(Path(outdir) / name): spec for name, spec in out.items()}


def write_samples(outdir: str | Path) -> list[Path]:
    """Write every sample capture into ``outdir``."""
    Path(outdir).mkdir(parents=True, exist_ok=True)
    paths = []
    for path, (transport, addr_le, ipv6) in sample_paths(outdir).items():
        record_session(transport, path, addr_le=addr_le, ipv6=ipv6)
        paths.append(Path(path))
    return paths
