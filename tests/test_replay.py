"""``kbtp replay``: sessions recorded with the reference initiator and target replay against
a fresh reference target, on the same and on the other binding, and match; a capture
edited to carry another outcome is reported as a difference."""
from __future__ import annotations

import asyncio
import itertools
import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import PcapReader, wrpcap

from kbtp_scapy.capture import kbtp_messages, rdma_messages, read_packets
from kbtp_scapy.cli import main
from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.layers.iwarp import crc32c
from kbtp_scapy.layers.roce import BTH, icrc_ok
from kbtp_scapy.rnic.pcap import PcapSink
from kbtp_scapy.target import TargetConfig

from .kbtp_harness import TargetThread
from .stops import STOPS, stop

CONFIG = {"blocks": 64, "max_initiators": 4}
_hosts = itertools.count(1)


def hosts(count: int = 3) -> list[str]:
    """Loopback addresses of their own for each target (127.52.x.y)."""
    return [f"127.52.{(n := next(_hosts)) // 250}.{n % 250 + 1}" for _ in range(count)]


async def _session(t: TargetThread, sink: PcapSink) -> None:
    ini = await Initiator.connect(t.url, frame_listeners=[sink], **t.connect_options(0))
    h = ini.target.handle_base
    await ini.alloc_store(h, b"inline block", seal=True)
    await ini.alloc_store(h + 1, bytes(range(200)) * 20, seal=True, inline=False)   # RDMA Read
    await asyncio.gather(ini.load(h + 1), ini.load(h, record=t.transport == "roce"))
    with pytest.raises(KbtpError):
        await ini.load(h + 2)
    await ini.direct_load(h)
    await ini.direct_alloc(h + 3, b"direct")
    await ini.free(h)
    await ini.goodbye()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, str]:
    """One session per binding, as the initiator's --pcap writes it."""
    out = {}
    for transport in ("iwarp", "roce"):
        path = tmp_path_factory.mktemp("rec") / f"{transport}.pcap"
        sink = PcapSink(path)
        t = TargetThread(transport, TargetConfig(**CONFIG), hosts=hosts())
        try:
            asyncio.run(asyncio.wait_for(_session(t, sink), 30))
        finally:
            t.stop()
            sink.close()
        out[transport] = str(path)
    return out


def replay(capsys, transport: str, capture: str, *args: str) -> tuple[int, str, str]:
    """Run ``kbtp replay`` against a fresh reference target; (exit status, stdout, stderr)."""
    t = TargetThread(transport, TargetConfig(**CONFIG), hosts=hosts())
    local = ["--local", t.initiator_hosts[0]] if transport == "roce" else []
    try:
        rc = main(["replay", capture, "--target", t.url, *local, "--timeout", "3", *args])
    finally:
        t.stop()
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("captured,target", [("iwarp", "iwarp"), ("roce", "roce"),
                                             ("iwarp", "roce"), ("roce", "iwarp")])
def test_reference_capture_matches(recorded, capsys, captured, target):
    rc, out, err = replay(capsys, target, recorded[captured], "--json")
    doc = json.loads(out)
    assert rc == 0, out + err
    assert doc["result"] == "match" and doc["summary"]["differ"] == 0
    ops = {v["operation"] for v in doc["loops"][0]}
    assert {"LOAD", "ALLOC_STORE", "BIND", "FREE", "READ table", "READ pool", "FETCH_ADD head",
            "WRITE partition"} <= ops
    loads = [v for v in doc["loops"][0] if v["operation"] == "LOAD" and v["captured"]["status"] == 0]
    assert loads and all(v["captured"]["data"] == v["replayed"]["data"] for v in loads)


def _edit(src: str, dst: str, frame: int, payload: bytes, at: int, value: int) -> None:
    """Change octet ``at`` of the RDMA payload ``payload`` carried in ``frame``, then
    recompute the RoCEv2 ICRC or the MPA CRC and the TCP checksum."""
    with PcapReader(src) as reader:
        packets = list(reader)
    raw = bytearray(bytes(packets[frame - 1]))
    start = raw.find(payload)
    assert start > 0
    raw[start + at] = value
    pkt = Ether(bytes(raw))
    if pkt.haslayer(BTH):
        ip = pkt[IP]
        end = 14 + ip.len
        fresh = IP(bytes(raw[14:end]), stop_dissection_after=BTH)[BTH]
        raw[end - 4:end] = fresh.compute_icrc(b"")
        new = Ether(bytes(raw))
        assert icrc_ok(new)
    else:
        tcp = bytearray(bytes(pkt[TCP].payload))
        tcp[-4:] = crc32c(bytes(tcp[:-4])).to_bytes(4, "little")   # one FPDU per segment
        pkt[TCP].remove_payload()
        pkt[TCP].add_payload(bytes(tcp))
        del pkt[IP].chksum, pkt[TCP].chksum
        new = Ether(bytes(pkt))
    new.time = packets[frame - 1].time
    packets[frame - 1] = new
    wrpcap(dst, packets)


def test_edited_completion_status_differs(recorded, capsys, tmp_path):
    src = recorded["iwarp"]
    msgs = rdma_messages(read_packets(src))
    found = [f for f in kbtp_messages(msgs) if f.fields["opcode"] == 0x20 and f.fields["request_id"] == 1]
    payload = next(m.payload for m in msgs if found[0].frame in m.frames and m.kind.startswith("send"))
    edited = str(tmp_path / "edited.pcap")
    _edit(src, edited, found[0].frame, payload, 23, 6)              # Status OK -> SEALED
    assert [f.fields["status"] for f in kbtp_messages(rdma_messages(read_packets(edited)))
            if f.fields["opcode"] == 0x20 and f.fields["request_id"] == 1] == [6]
    rc, out, err = replay(capsys, "iwarp", edited)
    assert rc == 1
    assert "DIFFER" in out and "rid=1: status: captured SEALED, replayed OK" in out
    assert err.count("\n") == 1 and "differ" in err


def test_edited_loaded_block_differs(recorded, capsys, tmp_path):
    src = recorded["roce"]
    msgs = rdma_messages(read_packets(src))
    write = next(m for m in msgs if m.kind == "write" and len(m.payload) == 4000)
    edited = str(tmp_path / "edited.pcap")
    _edit(src, edited, write.frames[0], write.payload[:64], 10, 0xEE)
    rc, out, _ = replay(capsys, "iwarp", edited, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["result"] == "differ"
    bad = [v for v in doc["loops"][0] if v["state"] == "differ"]
    assert len(bad) == 1 and bad[0]["operation"] == "LOAD"
    assert [d["field"] for d in bad[0]["differences"]] == ["data"]


def test_loop_and_pace(recorded, capsys):
    rc, out, _ = replay(capsys, "roce", recorded["roce"], "--loop", "2", "--json")
    doc = json.loads(out)
    assert rc == 0 and len(doc["loops"]) == 2 and doc["summary"]["match"] == 2 * len(doc["loops"][0])
    packets = read_packets(recorded["iwarp"])
    span = float(packets[-1].time - packets[0].time)
    began = time.monotonic()
    rc, out, _ = replay(capsys, "iwarp", recorded["iwarp"], "--pace")
    assert rc == 0 and out.splitlines()[-1].startswith("MATCH")
    assert time.monotonic() - began >= span * 0.8


def test_not_a_capture_is_a_harness_error(capsys, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a capture\n")
    rc = main(["replay", str(bad), "--target", "roce://127.52.250.1"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "not a pcap" in err
    rc = main(["replay", str(bad), "--target", "tcp://x"])
    assert rc == 2 and "--target" in capsys.readouterr().err
    # a header cut short is said in kbtp decode's words, not Scapy's
    cut = tmp_path / "cut.pcap"
    cut.write_bytes((Path(__file__).parents[1] / "pcaps" / "rxe_kernel_session.pcap").read_bytes()[:20])
    assert main(["replay", str(cut), "--target", "roce://127.52.250.1"]) == 2
    assert capsys.readouterr().err == f"kbtp: {cut}: the pcap header is cut short\n"
    assert main(["replay", "--help"]) == 0 and "Examples" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["iwarp_session.pcap", "roce_addr_le_ipv6_session.pcap"])
def test_synthetic_captures_never_crash(capsys, name):
    """The sample captures are crafted (error statuses a live target does not produce):
    the replay reports differences and never crashes."""
    rc, out, err = replay(capsys, "roce", f"pcaps/{name}", "--json", "--timeout", "1")
    doc = json.loads(out)
    assert rc == 1 and "Traceback" not in err
    assert doc["summary"]["match"] > 0 and doc["summary"]["differ"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rxe_kernel_session.pcap", "siw_kernel_session.pcap"])
def test_kernel_capture_replays_to_match_on_a_used_target(capsys, tmp_path, name):
    """The kernel's captures read table entries by RDMA Read: their Generations move per
    handle too, so the second and third replay on one target match as the first did."""
    t = TargetThread("iwarp", TargetConfig(**CONFIG), hosts=hosts())
    reports = [tmp_path / f"run{n}.json" for n in range(3)]
    try:
        runs = [main(["replay", f"pcaps/{name}", "--target", t.url, "--timeout", "3",
                      "--json-file", str(report)]) for report in reports]
    finally:
        t.stop()
    out = capsys.readouterr().out
    assert runs == [0, 0, 0], out
    last = json.loads(reports[2].read_text())["loops"][0]
    reads = [v for v in last if v["operation"] == "READ table"]
    assert reads and all(v["state"] == "match" for v in reads)
    assert reads[0]["replayed"]["generation"] > reads[0]["captured"]["generation"]   # a used entry


def test_truncated_capture_says_where_it_ends(capsys, tmp_path):
    """A capture cut in the middle of a frame replays what it holds, then says where it
    ends and exits 1, as ``kbtp decode`` does: never a MATCH of a capture read in part."""
    whole = Path("pcaps/rxe_kernel_session.pcap").read_bytes()
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(whole[:20000])
    assert main(["decode", str(cut)]) == 1
    decoded = capsys.readouterr().err.strip().splitlines()[-1]
    ends = decoded.split(": ", 2)[2].split(";")[0]         # the capture ends in the middle of frame N
    rc, out, err = replay(capsys, "iwarp", str(cut))
    assert rc == 1, out + err
    assert f"note: {ends}" in out and not out.splitlines()[-1].startswith("MATCH")
    assert err.strip().splitlines()[-1] == f"kbtp: {cut}: {ends}; the steps before it were replayed"
    rc, out, _ = replay(capsys, "iwarp", str(cut), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["result"] == "incomplete" and doc["capture_ends"] == ends


@pytest.mark.slow
@STOPS
def test_ctrl_c_in_a_loop_keeps_the_steps_replayed(tmp_path, sigs, code, name):
    """A SIGINT (or a CI timeout's SIGTERM) during ``--loop 1000``: the loops replayed until
    then are judged and written (text and --json-file), marked interrupted, then exit 130
    (143)."""
    t = TargetThread("iwarp", TargetConfig(**CONFIG), hosts=hosts())
    report = tmp_path / "report.json"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kbtp_scapy", "replay",
                                 "pcaps/rxe_kernel_session.pcap", "--target", t.url, "--loop", "1000",
                                 "--json-file", str(report)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(t.target.metrics.hellos.values()) < 3 \
                and proc.poll() is None:
            time.sleep(0.05)
        stop(proc, sigs)
        out, err = proc.communicate(timeout=60)
    finally:
        t.stop()
    assert proc.returncode == code, err
    assert err.splitlines()[-1].startswith(f"kbtp: replay: interrupted ({name}) after ")
    assert out.splitlines()[-1].startswith("INTERRUPTED: ")
    doc = json.loads(report.read_text())
    assert doc["result"] == "interrupted" and doc["interrupted"].startswith(f"interrupted ({name})")
    assert doc["summary"]["match"] > 0 and doc["summary"]["differ"] == 0


@pytest.mark.slow
def test_target_gone_in_a_loop_keeps_the_loops_replayed(tmp_path):
    """A target that stops during ``--loop 1000``: the loops replayed until then are judged
    and written (text and --json-file), marked partial, then exit 1 (the target failed)."""
    t = TargetThread("iwarp", TargetConfig(**CONFIG), hosts=hosts())
    report = tmp_path / "report.json"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kbtp_scapy", "replay",
                                 "pcaps/rxe_kernel_session.pcap", "--target", t.url, "--loop", "1000",
                                 "--timeout", "3", "--json-file", str(report)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(t.target.metrics.hellos.values()) < 3 \
                and proc.poll() is None:
            time.sleep(0.05)
    finally:
        t.stop()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "the target went away during loop " in err.splitlines()[-1]
    assert "note: the target went away during loop " in out and "loop 1: " in out
    doc = json.loads(report.read_text())
    assert doc["interrupted"].startswith("the target went away during loop ")
    assert doc["summary"]["match"] > 0 and len(doc["loops"]) >= 2


@pytest.mark.slow
def test_unbound_handle_on_a_used_target_matches(capsys):
    """A LOAD of a handle never bound in the capture (NOT_VALID, Generation 0) replayed where
    the entry was bound and freed before answers with that entry's Generation: the handle's
    first Generation, which sets its offset as any other does (DECISIONS D10)."""
    t = TargetThread("iwarp", TargetConfig(**CONFIG), hosts=hosts())
    try:
        used = main(["replay", "pcaps/iwarp_session.pcap", "--target", t.url, "--timeout", "1"])
        rc = main(["replay", "pcaps/rxe_kernel_session.pcap", "--target", t.url, "--timeout", "3"])
    finally:
        t.stop()
    out = capsys.readouterr().out
    assert used == 1 and rc == 0, out


def test_frame_the_capture_cut_is_unchecked(capsys, tmp_path):
    """A Read Response the capture ends inside is not compared (UNCHECKED, as an answer the
    capture lacks), and Scapy's own warning of the cut frame is not printed."""
    whole = Path("pcaps/rxe_kernel_session.pcap").read_bytes()
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(whole[:len(whole) * 2 // 3])
    rc, out, err = replay(capsys, "iwarp", str(cut))
    assert rc == 1 and "DIFFER" not in out, out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("UNCHECKED")] == \
        ["UNCHECKED session 0 frame 60 READ pool"]
    assert "WARNING" not in err and err.count("\n") == 1


def test_frame_cut_by_the_snapshot_length_is_unchecked(capsys, tmp_path):
    """One RDMA Write of a LOAD's data captured with 300 of its octets (caplen < wire
    length): that LOAD is UNCHECKED, the rest of the capture matches."""
    whole, out, at = Path("pcaps/rxe_kernel_session.pcap").read_bytes(), bytearray(), 24
    out += whole[:24]
    for number in itertools.count(1):
        if at >= len(whole):
            break
        sec, usec, caplen, wire = struct.unpack("<IIII", whole[at:at + 16])
        data = whole[at + 16:at + 16 + caplen][:300 if number == 28 else caplen]
        out += struct.pack("<IIII", sec, usec, len(data), wire) + data
        at += 16 + caplen
    cut = tmp_path / "snap.pcap"
    cut.write_bytes(out)
    rc, text, _ = replay(capsys, "iwarp", str(cut))
    assert rc == 0 and "DIFFER" not in text, text
    assert "UNCHECKED session 0 frame 26 LOAD rid=4: the capture holds 300 of the 1098 octets of frame 28" in text


def test_standard_input_and_quiet(capsys):
    assert main(["replay", "-", "--target", "iwarp://127.52.250.1:5420"]) == 2
    assert capsys.readouterr().err == "kbtp: replay reads a capture file, not standard input; " \
                                      "save it first (tcpdump -w FILE)\n"
    rc, out, _ = replay(capsys, "iwarp", "pcaps/rxe_kernel_session.pcap", "--loop", "2", "-q")
    assert rc == 0 and out.splitlines() == [out.splitlines()[-1]] and out.startswith("MATCH: ")


@pytest.mark.slow
def test_samples_the_help_says_match_do(capsys):
    """The samples ``kbtp replay --help`` names as replaying to MATCH do, each on a fresh
    target; the synthetic one it says differs by design does not."""
    assert main(["replay", "--help"]) == 0
    words = " ".join(capsys.readouterr().out.split())
    claim = words.split(" replay to MATCH")[0].rsplit("(pcaps/),", 1)[1]
    paths = [p for name in re.findall(r"[\w/*]+\.pcap", claim) for p in sorted(Path("pcaps").glob(name))]
    assert len(paths) >= 3, claim
    for path in paths:
        rc, out, _ = replay(capsys, "iwarp", str(path), "-q")
        assert rc == 0 and out.startswith("MATCH: "), (path, out)
    assert "iwarp" in words.split(" differ by design")[0].rsplit("MATCH.", 1)[1]
    rc, out, _ = replay(capsys, "iwarp", "pcaps/iwarp_session.pcap", "-q", "--timeout", "1")
    assert rc == 1 and out.splitlines()[-1].startswith("DIFFERENT: ")
