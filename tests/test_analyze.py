"""``kbtp analyze``: hazards found in real captures of a fleet (a reference target and four
initiators on loopback, each host its own capture) and in sessions crafted with one
target bug each, nothing in clean ones; the Parquet dataset's columns come from the tables."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kbtp_scapy import codec, tables as T
from kbtp_scapy.builders.recorder import recorder
from kbtp_scapy.capture import read_packets
from kbtp_scapy.layers.roce import AETH, BTH, RETH
from kbtp_scapy.tables import memory as M
from kbtp_scapy.vocab import Opcode, RequestFlag, Status

from .kbtp_harness import fresh_hosts

ROOT = Path(__file__).resolve().parent.parent
H = 0x4000


def kbtp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kbtp_scapy", "analyze", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def analysis(*args: str) -> tuple[int, dict[str, Any]]:
    proc = kbtp("--json", "--fail-on-hazard", *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def hello(credits: int = 16, initiator: int = 0) -> list[tuple[bool, dict]]:
    return [(True, {"opcode": Opcode.HELLO, "hello.completion_credits": 16,
                    "hello.initiator_id": initiator.to_bytes(16, "big")}),
            (False, {"opcode": Opcode.HELLO_ACK, "hello_ack.request_credits": credits,
                     "hello_ack.block_size": 4096, "hello_ack.allocation_quota": 8,
                     "hello_ack.handle_base": H, "hello_ack.handle_count": 64,
                     "hello_ack.ticket_timeout": 1000})]


def request(rid: int, opcode: Opcode, handle: int = H, generation: int = 0, flags: int = 0) -> tuple[bool, dict]:
    msg: dict[str, Any] = {"opcode": opcode, "request_id": rid, "handle": handle, "generation": generation,
                           "flags": flags, "dd.length": 8 if opcode != Opcode.FREE else 0}
    if opcode in (Opcode.ALLOC_STORE, Opcode.STORE):
        msg["flags"] |= RequestFlag.INLINE
        msg["inline_data"] = b"KVBLOCK!"
    if opcode == Opcode.FREE:
        del msg["dd.length"]
    return True, msg


def answer(rid: int, status: Status = Status.OK, generation: int = 0, handle: int = H) -> tuple[bool, dict]:
    return False, {"opcode": Opcode.COMPLETION, "request_id": rid, "handle": handle, "status": status,
                   "generation": generation, "completion.data_length": 8, "completion.block_offset": 0x8000}


def capture(path: Path, steps: list[tuple[bool, dict]], credits: int = 16, initiator: int = 0) -> Path:
    """A RoCEv2 capture of a session; initiator N's handles are N * 64 above the others'."""
    rec = recorder("roce")
    for by_initiator, msg in hello(credits, initiator) + steps:
        if "handle" in msg and msg["opcode"] not in (Opcode.HELLO, Opcode.HELLO_ACK):
            msg = {**msg, "handle": msg["handle"] + 64 * initiator}
        rec.send(by_initiator, codec.encode(msg))      # type: ignore[arg-type]
    rec.write_pcap(path)
    return path


def kinds(result: dict[str, Any]) -> dict[str, int]:
    return result["counts"]


# --- crafted sessions: one target (or initiator) bug each, and its clean twin ---------------

def stored(generation: int = 5) -> list[tuple[bool, dict]]:
    return [request(1, Opcode.ALLOC_STORE), answer(1, generation=generation)]


CASES = {
    # a LOAD served with another Generation than the last store completed with
    "stale-generation": (stored() + [request(2, Opcode.LOAD), answer(2, generation=4)],
                         stored() + [request(2, Opcode.LOAD), answer(2, generation=5)]),
    # a LOAD served OK from a freed handle
    "freed-block-served": (stored() + [request(2, Opcode.FREE), answer(2, generation=6),
                                       request(3, Opcode.LOAD), answer(3, generation=6)],
                           stored() + [request(2, Opcode.FREE), answer(2, generation=6),
                                       request(3, Opcode.LOAD), answer(3, Status.NOT_VALID, 6)]),
    # a pinned LOAD answered OK with another Generation (STALE_GENERATION is required)
    "wrong-generation": (stored() + [request(2, Opcode.LOAD, generation=7), answer(2, generation=5)],
                         stored() + [request(2, Opcode.LOAD, generation=7),
                                     answer(2, Status.STALE_GENERATION, 5)]),
    # a LOAD of "any" Generation after the handle was freed and bound again
    "unpinned-reused-load": (stored() + [request(2, Opcode.FREE), answer(2, generation=6),
                                         request(3, Opcode.ALLOC_STORE), answer(3, generation=7),
                                         request(4, Opcode.LOAD), answer(4, generation=7)],
                             stored() + [request(2, Opcode.FREE), answer(2, generation=6),
                                         request(3, Opcode.ALLOC_STORE), answer(3, generation=7),
                                         request(4, Opcode.LOAD, generation=7), answer(4, generation=7)]),
    # three requests in flight where two credits were granted
    "over-credits": ([request(1, Opcode.LOAD), request(2, Opcode.LOAD), request(3, Opcode.LOAD),
                      answer(1, Status.NOT_VALID), answer(2, Status.NOT_VALID), answer(3, Status.NOT_VALID)],
                     [request(1, Opcode.LOAD), request(2, Opcode.LOAD), answer(1, Status.NOT_VALID),
                      request(3, Opcode.LOAD), answer(2, Status.NOT_VALID), answer(3, Status.NOT_VALID)]),
    # a COMPLETION that answers nothing
    "unsolicited-completion": ([request(1, Opcode.LOAD), answer(1, Status.NOT_VALID), answer(9, Status.OK)],
                               [request(1, Opcode.LOAD), answer(1, Status.NOT_VALID)]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_planted_hazard_is_found_and_its_clean_twin_is_clean(kind, tmp_path):
    bad, clean = CASES[kind]
    credits = 2 if kind == "over-credits" else 16
    code, result = analysis(str(capture(tmp_path / "bad.pcap", bad, credits)))
    assert code == 1 and kinds(result) == {kind: 1}, result
    finding = result["findings"][0]
    assert all(e["capture"] == "bad" and e["frame"] > 0 for e in finding["evidence"])
    code, result = analysis(str(capture(tmp_path / "clean.pcap", clean, credits)))
    assert code == 0 and kinds(result) == {}, result


def test_an_unanswered_request_against_a_bound_of_the_capture_itself(tmp_path):
    """25 LOADs answered in one step each give the bound; one never answered while 25
    more exchanges follow is found, one in flight at the capture's very end is not."""
    answered = [step for rid in range(10, 35) for step in (request(rid, Opcode.LOAD), answer(rid, Status.NOT_VALID))]
    steps = stored() + [request(2, Opcode.LOAD)] + answered + [request(3, Opcode.LOAD)]
    code, result = analysis(str(capture(tmp_path / "hang.pcap", steps)))
    assert code == 1 and kinds(result) == {"unanswered": 1}, result
    assert "rid=2 " in result["findings"][0]["message"]


# --- a real fleet: the reference target, two producers and two consumers -------------------

def _bth(packet: Any) -> Any:
    return packet[BTH]


def fleet(out: Path, clean: bool) -> Path:
    hosts = fresh_hosts(5)
    proc = subprocess.run([sys.executable, "tools/make_fleet_pcaps.py", "--out", str(out),
                           "--addresses", ",".join(hosts), *(["--clean"] if clean else [])],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["consumer1.pcap", "consumer2.pcap",
                                                     "producer1.pcap", "producer2.pcap"]
    return out


@pytest.mark.slow
def test_the_buggy_consumers_stale_reads_are_found_across_the_hosts_captures(tmp_path):
    out = fleet(tmp_path / "fleet", clean=False)
    code, result = analysis(str(out))
    assert code == 1
    stale = [f for f in result["findings"] if f["kind"] == "unpinned-reused-load"]
    # each producer reuses 4 handles, and the buggy consumer loads each 3 times afterwards
    assert result["counts"]["unpinned-reused-load"] == 24 and len(stale) == 8
    for f in stale:
        captures = [e["capture"] for e in f["evidence"]]
        assert captures[:2] == ["consumer2", "consumer2"] and captures[2] in ("producer1", "producer2")
    # the buggy consumer's one Direct Load on the word of an entry read before the re-bind:
    # that entry read (consumer2), the re-bind's COMPLETION (producer2), the block read
    direct = [f for f in result["findings"] if "Direct Load" in f["message"]]
    assert [(f["kind"], f["severity"]) for f in direct] == [("stale-generation", "initiator")]
    assert [e["capture"] for e in direct[0]["evidence"]] == ["consumer2", "producer2", "consumer2"]
    used, change, block = (e["frame"] for e in direct[0]["evidence"])
    packets = {name: read_packets(out / f"{name}.pcap") for name in ("consumer2", "producer2")}
    assert used < block and _bth(packets["consumer2"][used - 1]).opcode == 0x10      # RC READ RESPONSE ONLY
    assert _bth(packets["consumer2"][block - 1]).opcode == 0x0C                       # RC READ REQUEST
    entry = codec.decode_struct(M.TABLE_ENTRY, bytes(packets["consumer2"][used - 1][AETH].payload)[:16])
    assert packets["consumer2"][block - 1][RETH].va == entry["entry.block_offset"]
    rebound = codec.decode(bytes(_bth(packets["producer2"][change - 1]).payload))
    assert rebound["opcode"] == Opcode.COMPLETION and rebound["generation"] != entry["entry.generation"]
    assert packets["consumer2"][used - 1].time < packets["producer2"][change - 1].time
    assert packets["producer2"][change - 1].time < packets["consumer2"][block - 1].time
    # the first producer's BIND 0.8 of the Ticket Timeout after the FetchAdd took its ticket
    late = [f for f in result["findings"] if f["kind"].startswith("ticket")]
    assert [f["kind"] for f in late] == ["ticket-near-timeout"]
    taken, bound = (e["frame"] for e in late[0]["evidence"])
    p1 = read_packets(out / "producer1.pcap")
    assert _bth(p1[taken - 1]).opcode == 0x12 and _bth(p1[bound - 1]).opcode == 0x04   # ATOMIC ACK, SEND ONLY
    assert 0.75 * 2 < float(p1[bound - 1].time - p1[taken - 1].time) < 2
    # the careful consumer's loads of an old Generation were refused: no finding of it but
    # slow answers (this machine's own load makes real ones)
    assert not any("consumer1" in e["capture"] for f in result["findings"] if f["kind"] != "slow"
                   for e in f["evidence"])
    # each capture alone holds one side only: the consumer's capture shows no reuse
    code, alone = analysis(str(out / "consumer2.pcap"))
    assert "unpinned-reused-load" not in alone["counts"]
    # a careful fleet: none of the checkers of correctness fires (slow answers may: this
    # machine's own load makes real ones)
    code, result = analysis(str(fleet(tmp_path / "clean", clean=True)))
    assert set(result["counts"]) <= {"slow"}, result


@pytest.mark.slow
def test_the_parquet_dataset_has_the_tables_columns_and_answers_the_same(tmp_path):
    import pyarrow.parquet as pq
    out = fleet(tmp_path / "fleet", clean=False)
    code, direct = analysis("--parquet", str(tmp_path / "ds"), str(out))
    files = sorted((tmp_path / "ds").glob("*/*.parquet"))
    assert [f.parent.name for f in files] == ["consumer1", "consumer2", "producer1", "producer2"]
    schema = pq.read_schema(files[0])
    widths = {1: 8, 2: 16, 4: 32, 8: 64}
    for key, (f, _) in T.wire_fields().items():
        if f.size in widths:
            assert str(schema.field(key.replace(".", "_")).type) == f"uint{widths[f.size]}", key
    code2, again = analysis(str(tmp_path / "ds"))
    assert (code2, again) == (code, direct)
    # the dataset is plain Parquet: DuckDB reads it without kbtp
    import duckdb
    loads = duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{tmp_path}/ds/*/*.parquet') "
                                     "WHERE opcode_name = 'LOAD'").fetchone()
    assert loads is not None and loads[0] == sum(s["count"] for s in direct["stats"] if s["opcode"] == "LOAD")


def test_hazards_fail_only_when_asked(tmp_path):
    pcap = str(capture(tmp_path / "bad.pcap", CASES["stale-generation"][0]))
    assert kbtp(pcap).returncode == 0
    proc = kbtp("--fail-on-hazard", pcap)
    assert proc.returncode == 1 and proc.stderr.strip() == "kbtp: 1 hazard(s) found"


def test_what_cannot_be_read_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.pcap"
    bad.write_bytes(b"not a capture at all")
    for args in ([str(bad)], [str(tmp_path / "missing.pcap")], [str(tmp_path)]):
        proc = kbtp(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_hundred_captures_on_a_dask_cluster_as_on_duckdb(tmp_path):
    """100 sessions' captures, two of each planted kind among them, and one cut short,
    decoded and judged on a real local Dask cluster (a scheduler and two worker processes):
    the same analysis as DuckDB's in this process, only the planted hazards, and the cut
    capture reported in the same one line."""
    kinds_ = sorted(CASES)
    folder = tmp_path / "captures"
    folder.mkdir()
    for i in range(100):
        kind = kinds_[i % len(kinds_)]
        bad, clean = CASES[kind]
        credits = 2 if kind == "over-credits" else 16
        capture(folder / f"host{i:03d}.pcap", bad if i < 2 * len(kinds_) else clean, credits, initiator=i)
    # and one more, cut short in the middle of its last frame
    whole = capture(tmp_path / "whole.pcap", CASES[kinds_[0]][1], initiator=100)
    last = len(read_packets(whole))
    (folder / "host100.pcap").write_bytes(whole.read_bytes()[:-10])
    proc = kbtp("--json", "--fail-on-hazard", "--dask", "local", "--workers", "2", "--parquet",
                str(tmp_path / "ds"), str(folder))
    assert proc.returncode == 1, proc.stderr
    on_dask = json.loads(proc.stdout)
    assert on_dask["counts"] == {kind: 2 for kind in kinds_}, on_dask["counts"]
    assert on_dask["captures"] == 101 and on_dask["sessions"] == 101
    said = [line for line in proc.stderr.splitlines() if "host100" in line]
    assert said == [f"kbtp analyze: {folder / 'host100.pcap'}: the capture ends in the middle of frame "
                    f"{last}; its messages before that are analysed"], proc.stderr
    proc = kbtp("--json", "--fail-on-hazard", str(folder))
    assert json.loads(proc.stdout) == on_dask and said[0] in proc.stderr.splitlines()


def test_decode_parquet_and_the_html_report(tmp_path):
    """``kbtp decode --parquet`` writes the dataset ``analyze`` reads; ``--report`` writes a
    page naming the hazard and the frames, with the two plots as real PNGs."""
    pcap = capture(tmp_path / "bad.pcap", CASES["stale-generation"][0])
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--parquet", str(tmp_path / "ds"),
                           str(pcap)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "6 KBTP messages" in proc.stdout, proc.stderr
    code, result = analysis("--report", str(tmp_path / "report"), str(tmp_path / "ds"))
    assert code == 1 and result["counts"] == {"stale-generation": 1}
    page = (tmp_path / "report" / "report.html").read_text()
    assert "stale-generation" in page and "bad frame" in page
    for name in ("latency.png", "throughput.png"):
        assert f'src="{name}"' in page
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_damaged_capture_says_where_it_ends_and_keeps_what_came_before(tmp_path):
    whole = capture(tmp_path / "whole.pcap", CASES["stale-generation"][0])
    data = whole.read_bytes()
    cut = tmp_path / "cut.pcap"
    # 12 frames, a Send and its ACK each: cut inside frame 11, the LOAD's COMPLETION
    cut.write_bytes(data[:len(data) - 62 - 16 - 20])
    proc = kbtp("--json", str(cut))
    assert proc.returncode == 0, proc.stderr
    assert "ends in the middle of frame 11" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    result = json.loads(proc.stdout)
    assert result["messages"] == 5 and result["counts"] == {}       # the LOAD in flight at the end
