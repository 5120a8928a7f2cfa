"""The fuzzer's model as a complete oracle: each field oracle shown by a bug planted for it.

Every bug breaks one sentence (or one field layout) of the specification in the reference
target running in its thread: the Block Handle echoed at 32 bits, a COMPLETION's reserved
octets set, a LOAD that writes past Data Length or answers a refusal after writing, a
completion record longer than 24 octets, HELLO_ACK promises broken (reserved octets,
Partition Count, features never asked for, Request Credits beyond the receive buffers
posted), a ring slot with its reserved octets set. The
fuzzer must find each on the bindings where it shows, naming the oracle's kind; the clean
target passes 300 cases on both bindings, and the report counts every field of every
answer as judged or not predicted.
"""
from __future__ import annotations

import asyncio

import pytest

from kbtp_scapy import codec
from kbtp_scapy.fuzz.cases import make_case
from kbtp_scapy.tables import memory as M
from kbtp_scapy.target import connection
from kbtp_scapy.target.connection import Connection
from kbtp_scapy.target.operations import Failed
from kbtp_scapy.target.ring import FreeRing
from kbtp_scapy.vocab import Feature, Opcode

from .kbtp_harness import TargetThread, fresh_hosts
from .test_fuzz_oracles import LOAD, config, first_case, fuzz, handler

pytestmark = pytest.mark.slow


class _Codec:
    """The target connection's codec, with one encoder replaced (the fuzzer's stays real)."""

    def __init__(self, **over) -> None:
        self.over = over

    def __getattr__(self, name: str):
        return self.over.get(name, getattr(codec, name))


def _hello_ack(mp, change) -> None:
    original = Connection._hello_ack

    async def hello_ack(self, status, body):
        await original(self, status, change(dict(body)) if not status else body)
    mp.setattr(Connection, "_hello_ack", hello_ack)


# -- the bugs ------------------------------------------------------------------------------

def handle_echo_32(t, mp):
    """The COMPLETION echoes the Block Handle's low 32 bits only."""
    original = Connection._complete
    mp.setattr(Connection, "_complete", lambda self, req, outcome, why="": original(
        self, {**req, "handle": req.get("handle", 0) & 0xFFFFFFFF}, outcome, why))


def completion_reserved(t, mp):
    """The COMPLETION's reserved octets carry a value (the layout: Reserved, zero)."""
    def encode(values, addr_le=False):
        if values.get("opcode") == Opcode.COMPLETION:
            values = {**values, "completion.reserved": 0x5A5A}
        return codec.encode(values, addr_le)
    mp.setattr(connection, "codec", _Codec(encode=encode))


def load_pads_buffer(t, mp):
    """An OK LOAD writes zeros after Data Length up to the descriptor's Length."""
    async def wrap(original, self, conn, req, fetch):
        out = await original(self, conn, req, fetch)
        if req["dd.length"] > out.data_length:
            conn.qp.write(req["dd.stag"], req["dd.offset"] + out.data_length,
                          bytes(req["dd.length"] - out.data_length), signaled=False)
        return out
    t.run(lambda: handler(t.target.executor, LOAD, wrap))


def refused_load_writes(t, mp):
    """A LOAD refused TOO_LARGE has already written what fits (the text: no other effect)."""
    async def wrap(original, self, conn, req, fetch):
        try:
            return await original(self, conn, req, fetch)
        except Failed as failure:
            if failure.status == Failed("TOO_LARGE").status:
                entry = self.table.read(req["handle"])
                conn.qp.write(req["dd.stag"], req["dd.offset"],
                              bytes(self.memory.block(entry.block_offset, req["dd.length"])), signaled=False)
            raise
    t.run(lambda: handler(t.target.executor, LOAD, wrap))


def record_too_long(t, mp):
    """Completion records are written as 32 octets (the text: a 24-octet record)."""
    def encode_struct(struct, values, addr_le=False):
        raw = codec.encode_struct(struct, values, addr_le)
        return raw + bytes(8) if struct is M.COMPLETION_RECORD else raw
    mp.setattr(connection, "codec", _Codec(encode_struct=encode_struct))


def hello_ack_reserved(t, mp):
    """The 8 reserved octets after the Table Base Handle carry a value."""
    _hello_ack(mp, lambda body: {**body, "hello_ack.reserved": 1} if "hello_ack.table.stag" in body else body)


def partition_beyond_quota(t, mp):
    """The Partition descriptor's Count is one more than the quota (the text: Count = its quota)."""
    _hello_ack(mp, lambda body: {**body, "hello_ack.partition.count": body["hello_ack.partition.count"] + 1}
               if "hello_ack.partition.count" in body else body)


def grants_unasked(t, mp):
    """RECORD_COMPLETION granted to a HELLO that asked for no feature."""
    _hello_ack(mp, lambda body: {**body, "hello_ack.features": body["hello_ack.features"]
                                 | Feature.RECORD_COMPLETION})


def credits_overstated(t, mp):
    """The HELLO_ACK announces four more Request Credits than the receive buffers posted;
    a LOAD takes 5 ms (a busy target, no bug), so a full window of credits meets the shortage."""
    _hello_ack(mp, lambda body: {**body, "hello_ack.request_credits": body["hello_ack.request_credits"] + 4})

    async def slow(original, self, conn, req, fetch):
        await asyncio.sleep(0.005)
        return await original(self, conn, req, fetch)
    t.run(lambda: handler(t.target.executor, LOAD, slow))


def slot_reserved(t, mp):
    """A freed block's ring slot is written with its reserved octets set."""
    def write_slot(self, offset, sequence, block):
        raw = codec.encode_struct(M.RING_SLOT, {"slot.sequence": sequence, "slot.reserved": 7,
                                                "slot.block_offset": block}, self.addr_le)
        self.slots[offset:offset + M.SLOT_SIZE] = raw
    mp.setattr(FreeRing, "_write_slot", write_slot)


def first_edge(*edges: str) -> int:
    """The first case of seed 1 with a mutated request at one of ``edges``."""
    for index in range(20000):
        if any(s["kind"] == "mutate" and s["handle"] in [["edge", e] for e in edges]
               for s in make_case("roce", 1, index).steps):
            return index
    raise AssertionError("no such case in 20,000")


# bug, the bindings where it shows, the kinds that name it, first case, cases to run
BUGS = [
    (handle_echo_32, ("iwarp", "roce"), {"echo"}, first_edge("max", "random"), 40),
    (completion_reserved, ("iwarp", "roce"), {"reserved"}, 0, 3),
    (load_pads_buffer, ("iwarp", "roce"), {"canary"}, 0, 3),
    (refused_load_writes, ("iwarp", "roce"), {"canary"}, 0, 30),
    (record_too_long, ("roce",), {"canary"}, first_case("valid", record=True), 40),
    (hello_ack_reserved, ("iwarp", "roce"), {"hello-ack"}, 0, 2),
    (partition_beyond_quota, ("iwarp", "roce"), {"hello-ack"}, 0, 2),
    (grants_unasked, ("roce",), {"hello-ack"}, 0, 2),
    (slot_reserved, ("iwarp", "roce"), {"invariant"}, 0, 40),
    # iWARP only: RoCEv2's requester meets the shortage with RNR NAKs and retries until served
    (credits_overstated, ("iwarp",), {"credits"}, first_case("burst"), 3),
]
RUNS = [(b, tr, kinds, start, cases) for b, trs, kinds, start, cases in BUGS for tr in trs]


@pytest.mark.parametrize("bug,transport,kinds,start,cases", RUNS,
                         ids=[f"{r[0].__name__}-{r[1]}" for r in RUNS])
def test_planted_field_bug_is_found(bug, transport, kinds, start, cases, tmp_path, monkeypatch):
    t = TargetThread(transport, config(), hosts=fresh_hosts())
    try:
        bug(t, monkeypatch)
        code, doc = fuzz(t, tmp_path, "--start", str(start), "--cases", str(cases), "--max-findings", "1",
                         "--minimize-budget", "0")
    finally:
        t.stop()
    found = set(doc["finding_kinds"])
    assert code == 1 and found & kinds, (found, [f["detail"] for d in doc["findings"] for f in d["findings"]])


@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_clean_target_passes_300_cases_with_every_field_counted(transport, tmp_path):
    """No finding in 300 cases; every COMPLETION read has each of its fields counted,
    judged or not predicted, and so has every completion record and HELLO_ACK."""
    t = TargetThread(transport, config(), hosts=fresh_hosts())
    try:
        code, doc = fuzz(t, tmp_path, "--cases", "300")
    finally:
        t.stop()
    assert code == 0 and not doc["findings"], doc["finding_kinds"]
    oracle, answers = doc["oracle"], doc["answers"]

    def seen(field: str) -> int:
        return oracle[field]["judged"] + sum(oracle[field]["not_predicted"].values())
    sends = answers.get("send", 0) + answers.get("send with invalidate", 0)
    assert sends > 1000
    fields = [f for f in oracle if f.startswith("completion.")]
    assert {f.split(".")[1] for f in fields} == {"version", "opcode", "flags", "request_id", "handle",
                                                 "generation", "status", "data_length", "reserved",
                                                 "block_offset"}
    assert all(seen(f) == sends for f in fields), {f: seen(f) for f in fields}
    records = answers.get("record", 0)
    assert all(seen(f) == records for f in oracle if f.startswith("record.") and f != "record.slot")
    assert (records > 0) == (transport == "roce")
    assert seen("hello_ack.status") == seen("hello_ack.handle") > 300
    assert oracle["load.buffer"]["judged"] > 300 and oracle["ring.slot"]["judged"] > 0
