"""``kbtp analyze`` follows the one-sided RDMA traffic: the Writes and Reads that carried
each request's data, the table entries a Direct Load read, the tickets a FetchAdd took.

Real sessions with the reference target over both bindings are checked against the Scapy
layers' own reading of the same capture; crafted sessions plant one Direct Load or ticket
hazard each beside a clean twin."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kbtp_scapy import codec
from kbtp_scapy.analyze import dataset, queries
from kbtp_scapy.analyze.rows import capture_rows
from kbtp_scapy.builders.recorder import Recorder, recorder
from kbtp_scapy.capture import rdma_messages, read_packets
from kbtp_scapy.decode import Reader, rdma_operations
from kbtp_scapy.tables import memory as M
from kbtp_scapy.vocab import EntryFlag, Feature, Opcode

from .kbtp_harness import fresh_hosts
from .test_analyze import ROOT, analysis, answer, request

H = 0x4000
TABLE, POOL, PARTITION, RING, HEAD = 0x7001, 0x7002, 0x7003, 0x7004, 0x7005
B1, B2 = 0x8000, 0x9000
ONE_SIDED = {"write", "write_imm", "read_request", "read_response", "atomic_request", "atomic_response"}


# --- real sessions: the reference target and initiator over both bindings --------------------

async def _session(binding: str, out: Path) -> dict[str, Any]:
    from kbtp_scapy.initiator import Initiator
    from kbtp_scapy.rnic.pcap import PcapSink
    from kbtp_scapy.target import Target, TargetConfig
    target_host, host = fresh_hosts(2)
    target = Target(TargetConfig(blocks=64, block_size=4096), binding)
    address = await target.start(f"{binding}://{target_host}:{4791 if binding == 'roce' else 0}")
    sink = PcapSink(out)
    ini = await Initiator.connect(str(address), frame_listeners=[sink],
                                  **({"local": host} if binding == "roce" else {}))
    try:
        h = ini.target.handle_base
        stored = await ini.alloc_store(h, b"s" * 3000, seal=True, inline=False)   # the target Reads it
        loaded = await ini.load(h)                                                # the target Writes it
        direct = await ini.direct_load(h)
        allocated = await ini.direct_alloc(h + 1, b"d" * 100)
        recorded = await ini.load(h, record=True)                                  # a completion record
        await ini.goodbye()
    finally:
        await ini.close()
        await target.close()
        sink.close()
    return {"handle": h, "stored": stored, "loaded": loaded, "direct": direct, "allocated": allocated,
            "recorded": recorded}


@pytest.mark.slow
@pytest.mark.parametrize("binding", ["roce", "iwarp"])
def test_the_rdma_that_carried_each_request_on_a_real_session(binding, tmp_path):
    pcap = tmp_path / f"{binding}.pcap"
    done = asyncio.run(_session(binding, pcap))
    # the streaming decoder's one-sided messages are the Scapy layers' own, frame for frame
    with open(pcap, "rb") as stream:
        ours = [(m.kind, m.frames) for m in rdma_operations(Reader(stream, str(pcap))) if m.kind in ONE_SIDED]
    scapy = [m for m in rdma_messages(read_packets(pcap)) if m.kind in ONE_SIDED]
    assert sorted(ours) == sorted((m.kind, m.frames) for m in scapy) and len(ours) >= 12
    rows = list(capture_rows(pcap))
    requests = {r["opcode_name"]: r for r in rows
                if r.get("opcode_name") in ("ALLOC_STORE", "LOAD", "BIND") and not r.get("recorded")}

    def stag(m: Any) -> int:
        return m.info["rkey"] if binding == "roce" else m.info.get("src_stag", m.info.get("stag"))
    # the LOAD's data: the one Write into its Data Descriptor, as Scapy reads it
    load = requests["LOAD"]
    writes = [m for m in scapy if m.kind == "write" and stag(m) == load["dd_stag"]]
    assert len(writes) == 1 and load["data_frames"] == writes[0].frames
    assert load["data_octets"] == len(done["loaded"].data) == 3000
    # the ALLOC_STORE's data: the target's Read of the initiator's buffer, request and response
    store = requests["ALLOC_STORE"]
    reads = [m for m in scapy if m.kind == "read_request" and stag(m) == store["dd_stag"]]
    assert len(reads) == 1 and store["data_frames"][0] == reads[0].frames[0]
    assert store["data_octets"] == 3000 and len(store["data_frames"]) == 2
    assert max(store["data_frames"]) < store["answer_frame"]
    # the Direct Load: two entry reads of the handle, showing the Generation the initiator got
    entries = [r for r in rows if r.get("rdma_region") == "table"]
    assert [(r["handle"], r["entry_generation"]) for r in entries] == [(done["handle"], done["direct"].generation)] * 2
    assert all(r["entry_flags"] & EntryFlag.VALID and r["entry_flags"] & EntryFlag.SEALED for r in entries)
    blocks = [r for r in rows if r.get("rdma_region") == "pool"]
    assert len(blocks) == 1
    assert blocks[0]["rdma_offset"] == entries[0]["entry_block_offset"] == done["direct"].block_offset
    # the DIRECT_ALLOC: the ticket its FetchAdd on the Head took is the one its BIND names
    tickets = [r for r in rows if r.get("rdma_op") == "FETCH_ADD"]
    assert len(tickets) == 1 and tickets[0]["rdma_region"] == "head"
    assert tickets[0]["ticket"] == requests["BIND"]["bind_ticket"]
    assert tickets[0]["answer_frame"] < requests["BIND"]["frame"]
    # the LOAD with RECORD (granted over RoCEv2 only): answered by the RDMA Write with
    # Immediate of its record into its Completion Descriptor, as Scapy reads it, after the
    # Write of its data
    records = [r for r in rows if r.get("recorded")]
    assert len(records) == (binding == "roce")
    for record in records:
        into = [m for m in scapy if m.kind == "write_imm" and stag(m) == record["cd_stag"]]
        assert len(into) == 1 and record["answer_frame"] == into[0].frames[-1]
        assert record["data_frames"][-1] < record["answer_frame"] and record["answer_status_name"] == "OK"
        assert record["answer_generation"] == done["recorded"].generation == done["stored"].generation
        assert record["latency_s"] > 0
    # and a real session is clean
    code, result = analysis(str(pcap))
    assert code == 0 and result["counts"] == {} and result["messages"] == sum(1 for r in rows if "rdma_op" not in r)


# --- crafted sessions: a target that grants the direct modes ---------------------------------

def direct_hello(timeout_ms: int = 1000) -> list[tuple[bool, dict]]:
    ack: dict[str, Any] = {"opcode": Opcode.HELLO_ACK, "hello_ack.features": Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC,
                           "hello_ack.request_credits": 16, "hello_ack.block_size": 4096,
                           "hello_ack.allocation_quota": 8, "hello_ack.handle_base": H,
                           "hello_ack.handle_count": 64, "hello_ack.ticket_timeout": timeout_ms,
                           "hello_ack.table_base_handle": H, "hello_ack.reserved": 0}
    for name, stag, count in (("table", TABLE, 64), ("pool", POOL, 64), ("partition", PARTITION, 8),
                              ("ring", RING, 8), ("head", HEAD, 1)):
        ack.update({f"hello_ack.{name}.stag": stag, f"hello_ack.{name}.offset": 0, f"hello_ack.{name}.count": count})
    return [(True, {"opcode": Opcode.HELLO, "hello.completion_credits": 16,
                    "hello.initiator_id": bytes(16)}), (False, ack)]


def entry(generation: int, block: int, flags: int = EntryFlag.VALID | EntryFlag.SEALED) -> tuple[str, bytes]:
    raw = codec.encode_struct(M.TABLE_ENTRY, {"entry.flags": flags, "entry.generation": generation,
                                              "entry.data_length": 8, "entry.block_offset": block})
    return "entry", raw


def block(offset: int) -> tuple[str, int]:
    return "block", offset


def later(seconds: float) -> tuple[str, float]:
    return "later", seconds


def fetch_add(ticket: int) -> tuple[str, int]:
    return "fetch_add", ticket


def bind(rid: int, ticket: int) -> tuple[bool, dict]:
    return True, {"opcode": Opcode.BIND, "request_id": rid, "handle": H, "generation": 0, "flags": 0,
                  "bind.ticket": ticket, "bind.data_length": 8, "bind.block_offset": B1}


def crafted(path: Path, steps: list, transport: str = "roce", timeout_ms: int = 1000) -> Path:
    """A session of KBTP messages and one-sided operations; ``later`` moves the clock on."""
    rec: Recorder = recorder(transport)
    for step in direct_hello(timeout_ms) + steps:
        what, value = step
        if what == "entry":
            rec.read(True, value, TABLE, 0, 0x100, 0)
        elif what == "block":
            rec.read(True, b"KVBLOCK!", POOL, value, 0x200, 0)
        elif what == "fetch_add":
            rec.fetch_add(True, HEAD, 0, 1 << 32, 0, value << 32)
        elif what == "later":
            if transport == "roce":
                rec.conn.start += value            # type: ignore[attr-defined]
            else:
                rec.conv._time += value            # type: ignore[attr-defined]
        else:
            rec.send(what, codec.encode(value))
    rec.write_pcap(path)
    return path


def judged(pcap: Path, out: Path) -> queries.Analysis:
    """The analysis of one capture, in this process: its dataset, then DuckDB's queries."""
    dataset.write([pcap], out)
    return queries.analyze(out)


def stored(rid: int, generation: int) -> list:
    return [request(rid, Opcode.ALLOC_STORE), answer(rid, generation=generation)]


def freed(rid: int, generation: int) -> list:
    return [request(rid, Opcode.FREE), answer(rid, generation=generation)]


CASES = {
    # the entry was read, the handle freed and bound again, the old block read, no second read
    ("stale-generation", "initiator"): (
        stored(1, 5) + [entry(5, B1)] + freed(2, 6) + stored(3, 7) + [block(B1)],
        stored(1, 5) + [entry(5, B1)] + freed(2, 6) + stored(3, 7) + [block(B1), entry(7, B2)]),
    # the same, the handle only freed
    ("freed-block-served", "initiator"): (
        stored(1, 5) + [entry(5, B1)] + freed(2, 6) + [block(B1)],
        stored(1, 5) + [entry(5, B1)] + freed(2, 6) + [block(B1), entry(6, B1, flags=0)]),
    # both entry reads agree, with a Generation older than the last store's: the table is stale
    ("stale-generation", "target"): (
        stored(1, 5) + freed(2, 6) + stored(3, 7) + [entry(5, B1), block(B1), entry(5, B1)],
        stored(1, 5) + freed(2, 6) + stored(3, 7) + [entry(7, B2), block(B2), entry(7, B2)]),
    # the table shows the entry VALID after the handle was freed
    ("freed-block-served", "target"): (
        stored(1, 5) + freed(2, 6) + [entry(5, B1), block(B1), entry(5, B1)],
        stored(1, 5) + freed(2, 6) + [entry(6, B1, flags=0)]),
    # a BIND 0.8 s after its FetchAdd with a Ticket Timeout of 1 s (answered OK)
    ("ticket-near-timeout", "initiator"): (
        [fetch_add(3), later(0.8), bind(1, 3), answer(1)],
        [fetch_add(3), later(0.5), bind(1, 3), answer(1)]),
    # a BIND 1.2 s after it: past the Timeout, though this target still took it
    ("ticket-timeout", "initiator"): (
        [fetch_add(3), later(1.2), bind(1, 3), answer(1)],
        [fetch_add(3), later(0.7), bind(1, 3), answer(1)]),
}


@pytest.mark.parametrize("transport", ["roce", "iwarp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_planted_direct_mode_hazard_and_its_clean_twin(case, transport, tmp_path):
    kind, whose = case
    bad, clean = CASES[case]
    pcap = crafted(tmp_path / "bad.pcap", bad, transport)
    result = judged(pcap, tmp_path / "bad")
    assert result.counts == {kind: 1}, result.findings
    finding = result.findings[0]
    assert finding.severity == whose and {c for c, _ in finding.evidence} == {"bad"}
    frames = [n for _, n in finding.evidence]
    rows = list(capture_rows(pcap))
    by_frame = {r["frame"]: r for r in rows}
    answers = {r["answer_frame"]: r for r in rows if r.get("answer_frame")}
    if kind.startswith("ticket"):
        # the FetchAdd's answer, the BIND
        assert answers[frames[0]]["rdma_op"] == "FETCH_ADD" and by_frame[frames[1]]["opcode_name"] == "BIND"
        return
    # the entry read the data was taken on, the change it missed, the block read
    used, change = answers[frames[0]], answers[frames[1] if whose == "initiator" else frames[3]]
    assert used["rdma_region"] == "table" and used["entry_generation"] == 5
    assert change["opcode_name"] == ("FREE" if kind == "freed-block-served" else "ALLOC_STORE")
    block_read = by_frame[frames[2] if whose == "initiator" else frames[1]]
    assert block_read["rdma_region"] == "pool" and block_read["rdma_offset"] == B1
    result = judged(crafted(tmp_path / "clean.pcap", clean, transport), tmp_path / "clean")
    assert result.counts == {}, result.findings


def test_the_committed_sessions_give_no_direct_mode_finding(tmp_path):
    """The sample sessions (both bindings, the lab's kernel stacks) hold a Direct Load
    each, and all but siw a DIRECT_ALLOC, done right: none of these checkers speaks."""
    samples = sorted((ROOT / "pcaps").glob("*.pcap"))
    dataset.write(samples, tmp_path / "ds")
    result = queries.analyze(tmp_path / "ds")
    assert "ticket-near-timeout" not in result.counts
    assert not [f for f in result.findings if "Direct Load" in f.message or "FetchAdd" in f.message]
    # silent because each Direct Load was seen and is right, not because none was seen
    con = queries.connect(tmp_path / "ds")
    loads = queries.direct_loads(con)
    assert sorted(d["capture"] for d in loads) == [p.stem for p in samples]
    assert all(d["used"] == d["confirmed"] and d["entry_frame"] < d["block_frame"] < d["confirm_frame"]
               for d in loads)
    assert con.execute("SELECT count(ticket) FROM m").fetchone()[0] == len(samples) - 1


def test_decode_is_untouched_by_the_rdma_rows(tmp_path):
    """``kbtp decode --parquet`` counts KBTP messages, not the RDMA operations beside them."""
    pcap = crafted(tmp_path / "s.pcap", stored(1, 5) + [entry(5, B1), block(B1), entry(5, B1)])
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--parquet", str(tmp_path / "ds"),
                           str(pcap)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("4 KBTP messages"), proc.stdout + proc.stderr


def test_the_sends_of_rdma_operations_are_kbtp_decodes():
    """Beside the one-sided traffic, ``rdma_operations`` yields the KBTP Sends exactly as
    ``rdma_messages`` (what ``kbtp decode`` reads) does, on every sample capture."""
    from kbtp_scapy.codec import looks_like_kbtp
    from kbtp_scapy.decode import rdma_messages as decoded

    def sends(path: Path, reader: Any) -> list[tuple]:
        with open(path, "rb") as stream:
            return [(m.transport, m.kind, m.frames, m.conn, m.payload, m.time, m.info.get("icrc_bad"))
                    for m in reader(Reader(stream, str(path)))
                    if m.kind in ("send", "send_inv") and looks_like_kbtp(m.payload)]
    for path in sorted((ROOT / "pcaps").glob("*.pcap")):
        assert sends(path, rdma_operations) == sends(path, decoded) != [], path


def test_reads_never_answered_are_given_up_in_bounded_memory():
    """A peer that never answers its Reads: the oldest waiting one is given up, unanswered,
    once ``MAX_WAITING`` wait."""
    from kbtp_scapy.analyze.operations import MAX_WAITING, Pairing
    from kbtp_scapy.wire.message import RdmaMessage
    pairing = Pairing()
    given_up = []
    for psn in range(MAX_WAITING + 100):
        given_up += pairing.feed(RdmaMessage("roce", "read_request", [psn + 1], ("10.0.0.1", "10.0.0.2", 7),
                                             info={"psn": psn, "va": 0, "rkey": 9, "dma_length": 16}))
    assert [op.frames for op in given_up] == [[n + 1] for n in range(100)]
    assert all(not op.answer_frames for op in given_up)
    answered = pairing.feed(RdmaMessage("roce", "read_response", [99999], ("10.0.0.2", "10.0.0.1", 8),
                                        payload=b"x" * 16, info={"psn": MAX_WAITING + 99}))
    assert len(answered) == 1 and answered[0].data == b"x" * 16 and answered[0].answer_frames == [99999]
    assert len(pairing.flush()) == MAX_WAITING - 1
