"""``kbtp decode`` and the streaming decoder as users run them: real files, real pipes,
real tshark, compared with the Scapy path (``capture.rdma_messages`` over Scapy packets)."""
from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from kbtp_scapy import codec
from kbtp_scapy.builders.iwarp import IwarpConversation
from kbtp_scapy.builders.roce import RcConnection, RoceEndpoint
from kbtp_scapy.capture import kbtp_messages, rdma_messages, read_packets, to_json
from kbtp_scapy.decode import Reader, Stats, rdma_messages as stream_messages
from kbtp_scapy.vocab import REQUESTS, Feature, Opcode
from tests.test_dissector import EXTRA, fields as tshark_fields
from tests.tshark import needs_tshark

ROOT = Path(__file__).resolve().parent.parent
PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))
REAL = sorted((ROOT / "tests" / "data" / "captures").glob("*.pcap"))
WHERE = ("time", "conn", "src", "dst", "src_port", "dst_port", "dst_qp")


def kbtp(*args: str, stdin=None, input_: bytes | None = None, check: bool = True,
         cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", *args], stdin=stdin, input=input_,
                          capture_output=True, timeout=300, cwd=cwd)
    if check:
        assert proc.returncode == 0, proc.stderr.decode()
    return proc


def streamed(path: Path, addr_le: bool | None = None) -> list[dict]:
    with open(path, "rb") as f:
        return [to_json(x) for x in kbtp_messages(stream_messages(Reader(f)), addr_le)]


def scapy_path(packets) -> list[dict]:
    return [to_json(x) for x in kbtp_messages(rdma_messages(packets))]


def without_where(objs: list[dict]) -> list[dict]:
    return [{k: v for k, v in o.items() if k not in WHERE} for o in objs]


def write_pcap(path: Path, frames: list[tuple[float, bytes]], linktype: int = 1) -> Path:
    with open(path, "wb") as out:
        out.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, linktype))
        for ts, data in frames:
            sec, usec = divmod(round(ts * 1e6), 1_000_000)
            out.write(struct.pack("<IIII", sec, usec, len(data), len(data)))
            out.write(data)
    return path


def records(path: Path) -> list[tuple[float, bytes]]:
    """(time, octets) of every record of a little-endian microsecond pcap, read here
    apart from the decoder under test."""
    data = path.read_bytes()
    out, at = [], 24
    while at + 16 <= len(data):
        sec, usec, caplen, _ = struct.unpack_from("<IIII", data, at)
        if at + 16 + caplen > len(data):
            break
        out.append((sec + usec / 1e6, data[at + 16:at + 16 + caplen]))
        at += 16 + caplen
    return out


# ---- variants of the captures ------------------------------------------------------------

def _session(send, write, addr_le: bool, rid0: int, inline: bytes = b"KV" * 1800) -> None:
    """HELLO, HELLO_ACK, a LOAD answered by an RDMA Write and a COMPLETION, a STORE whose
    inline data spans several packets, its COMPLETION, and a malformed FREE."""
    feats = Feature.ADDR_LE if addr_le else 0
    send(True, codec.encode({"opcode": Opcode.HELLO, "hello.requested_features": feats}))
    send(False, codec.encode({"opcode": Opcode.HELLO_ACK, "hello_ack.features": feats,
                              "hello_ack.request_credits": 8, "hello_ack.block_size": 4096,
                              "hello_ack.handle_base": 0x4000, "hello_ack.handle_count": 64}))
    send(True, codec.encode({"opcode": Opcode.LOAD, "request_id": rid0, "handle": 0x4001,
                             "dd.stag": 0x77, "dd.offset": 0x1000, "dd.length": 3000}, addr_le))
    write(bytes(range(256)) * 11 + bytes(184), 0x77, 0x1000)
    send(False, codec.encode({"opcode": Opcode.COMPLETION, "request_id": rid0, "handle": 0x4001,
                              "completion.data_length": 3000}, addr_le))
    send(True, codec.encode({"opcode": Opcode.STORE, "request_id": rid0 + 1, "handle": 0x4002,
                             "inline_data": inline}, addr_le))
    send(False, codec.encode({"opcode": Opcode.COMPLETION, "request_id": rid0 + 1,
                              "handle": 0x4002, "status": 4}, addr_le))
    send(True, codec.encode({"opcode": Opcode.FREE, "request_id": rid0 + 2, "handle": 0x4003})
         + b"junk")


def multi_connection(path: Path) -> Path:
    """Two iWARP connections (one with markers and MPA revision 2, one without CRC, with
    Sends over several segments) and three RoCEv2 QPs (two between the same hosts, with
    the per-QP UDP source ports of Linux rxe, one ADDR_LE), interleaved by time, IPv4 and
    IPv6. Small Sends on the markers connection: tshark 4.0 leaves markers in FPDUs that
    hold more than one (the decoder does not: see the STORE's inline data)."""
    frames = []
    for i, (ends, kw) in enumerate([((("10.0.0.1", 40001), ("10.0.0.9", 5420)),
                                     {"markers": True}),
                                    ((("fd00::1", 40002), ("fd00::9", 5421)),
                                     {"crc": False, "revision": 1})]):
        conv = IwarpConversation(*ends, start=1_700_000_000.0 + 0.00003 * i, gap=0.0001, **kw)

        def send(ini, payload, conv=conv):
            conv.send_message("Send", payload, from_initiator=ini)

        def write(data, stag, to, conv=conv):
            conv.send_message("RDMA Write", data, from_initiator=False, stag=stag, to=to)
        _session(send, write, addr_le=False, rid0=100 * (i + 1),
                 inline=b"KV" * (150 if kw.get("markers") else 1800))
        conv.close()
        frames += [(float(p.time), bytes(p)) for p in conv.packets]
    for i, (a, b, sport, le) in enumerate([("10.1.0.1", "10.1.0.2", 0xC001, False),
                                           ("10.1.0.1", "10.1.0.2", 0xC0F3, False),
                                           ("fd01::1", "fd01::2", 0xD000, True)]):
        conn = RcConnection(RoceEndpoint(a, "02:00:00:00:01:01", qpn=0x100 + i, psn=7 * i,
                                         udp_sport=sport),
                            RoceEndpoint(b, "02:00:00:00:01:02", qpn=0x200 + i, psn=9000 + i,
                                         udp_sport=sport + 1),
                            mtu=1024, start=1_700_000_000.0 + 0.00001 * (1 + i), step=0.00007)

        def send(ini, payload, conn=conn):
            conn.send("a" if ini else "b", payload)

        def write(data, stag, to, conn=conn):
            conn.write("b", data, va=to, rkey=stag)
        _session(send, write, addr_le=le, rid0=1000 * (i + 1))
        frames += [(float(f.time), bytes(f.original)) for f in conn.frames]
    frames.sort(key=lambda f: f[0])
    return write_pcap(path, frames)


def interleaved(path: Path) -> Path:
    """All sample captures in one, frames interleaved by time."""
    frames = sorted((f for p in PCAPS for f in records(p)), key=lambda f: f[0])
    return write_pcap(path, frames)


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("variants")
    out = {"multi": multi_connection(tmp / "multi.pcap"), "interleaved": interleaved(tmp / "mixed.pcap")}
    return out


# ---- equal to the Scapy path and to the dissector ----------------------------------------

@pytest.mark.parametrize("pcap", PCAPS + REAL, ids=lambda p: p.name)
def test_stream_equals_the_scapy_path(pcap):
    assert without_where(streamed(pcap)) == without_where(scapy_path(read_packets(pcap)))


@pytest.mark.slow
def test_variants_equal_the_scapy_path_and_find_every_message(variants):
    multi = streamed(variants["multi"])
    assert without_where(multi) == without_where(scapy_path(read_packets(variants["multi"])))
    assert len(multi) == 5 * 7
    assert len({o["conn"] for o in multi}) == 5          # RoCE sessions: one per pair of QPs
    assert sum("malformed" in o for o in multi) == 5
    stores = [o for o in multi if o["kbtp.opcode"] == Opcode.STORE]
    assert sorted(o["kbtp.inline_data"] for o in stores) == sorted(
        (b"KV" * n).hex() for n in (150, 1800, 1800, 1800, 1800))
    le = [o for o in multi if o["src"].startswith("fd01") and o["kbtp.opcode"] == Opcode.LOAD]
    assert le[0]["kbtp.handle"] == 0x4001 and le[0]["kbtp.dd.stag"] == 0x77
    mixed = streamed(variants["interleaved"])
    assert without_where(mixed) == without_where(scapy_path(read_packets(variants["interleaved"])))
    assert len(mixed) == sum(len(streamed(p)) for p in PCAPS)


@pytest.mark.slow
def test_truncated_captures_equal_the_scapy_path_on_the_whole_frames(tmp_path):
    whole = (ROOT / "pcaps" / "iwarp_session.pcap").read_bytes()
    frames = records(ROOT / "pcaps" / "iwarp_session.pcap")
    for cut in (len(whole) // 3, len(whole) // 2 + 7, len(whole) - 5):
        path = tmp_path / f"cut{cut}.pcap"
        path.write_bytes(whole[:cut])
        kept = records(path)
        assert 0 < len(kept) < len(frames)
        from scapy.layers.l2 import Ether
        assert without_where(streamed(path)) == without_where(scapy_path([Ether(d) for _, d in kept]))
        proc = kbtp("decode", str(path), check=False)
        assert proc.returncode == 1
        last = proc.stderr.decode().splitlines()[-1]
        assert last == (f"kbtp: {path}: the capture ends in the middle of frame {len(kept) + 1}; "
                        "the frames before it were decoded")


def record_starts(data: bytes) -> list[int]:
    """Where each record header of a little-endian pcap starts, read here apart from the
    decoder under test."""
    out, at = [], 24
    while at + 16 <= len(data):
        out.append(at)
        at += 16 + struct.unpack_from("<I", data, at + 8)[0]
    return out


def _renumbered(objs: list[dict], lost: int) -> list[dict]:
    """The messages after record ``lost`` (1-based) numbered as if it were not there."""
    return [{**o, "frame": o["frame"] - (o["frame"] > lost)} for o in objs if o["frame"] != lost]


@pytest.mark.parametrize("damage", ["header", "inserted"])
def test_a_damaged_pcap_yields_every_message_before_and_after_the_damage(tmp_path, damage):
    """A record header whose length no capture has (its record lost), or 37 octets of
    garbage between two records (nothing lost): decode goes on at the next record, so every
    message before and after the damage comes out, the same as from the whole capture; the
    last line says what was skipped, exit 1."""
    original = ROOT / "pcaps" / "roce_session.pcap"
    whole = original.read_bytes()
    starts = record_starts(whole)
    objs = streamed(original)
    frames = {o["frame"] for o in objs}
    n = next(i for i in range(len(starts) // 2, len(starts)) if i + 1 not in frames)   # a frame, no message
    at = starts[n]
    if damage == "header":
        bad = bytearray(whole)
        bad[at + 8:at + 12] = (0xFFFFFFF0).to_bytes(4, "little")
        want, skipped = _renumbered(objs, n + 1), starts[n + 1] - at
    else:
        bad = bytearray(whole[:at] + bytes(range(200, 237)) + whole[at:])
        want, skipped = objs, 37
    path = tmp_path / "damaged.pcap"
    path.write_bytes(bytes(bad))
    assert streamed(path) == want and len(want) > 20
    proc = kbtp("decode", "--json", str(path), check=False)
    assert proc.returncode == 1 and [json.loads(line) for line in proc.stdout.splitlines()] == want
    claimed = 0xFFFFFFF0 if damage == "header" else int.from_bytes(bytes(range(208, 212)), "little")
    assert proc.stderr.decode().splitlines()[-1] == (
        f"kbtp: {path}: record {n + 1} claims {claimed} octets: the file is corrupt; {skipped:,} octets "
        f"skipped, reading went on at octet {at + skipped:,}; the frames before and after it were decoded")


def test_a_damaged_pcapng_block_is_skipped_to_the_next_block(tmp_path):
    """pcapng: a block whose length field is broken is skipped to the next block whose
    trailing length repeats its leading one; the messages of every other block come out."""
    from tests.tshark import TSHARK
    editcap = Path(TSHARK).with_name("editcap")
    if not editcap.exists():
        pytest.skip("editcap (Wireshark's) is not installed")
    original = tmp_path / "session.pcapng"
    subprocess.run([str(editcap), "-F", "pcapng", str(ROOT / "pcaps" / "roce_session.pcap"), str(original)],
                   check=True, timeout=60)
    data = bytearray(original.read_bytes())
    blocks, at = [], 0
    while at + 8 <= len(data):
        kind, length = struct.unpack_from("<II", data, at)
        blocks.append((at, kind))
        at += length
    objs = streamed(original)
    frames = {o["frame"] for o in objs}
    packets = [b for b in blocks if b[1] == 6]                     # Enhanced Packet Blocks
    n = next(i for i in range(len(packets) // 2, len(packets)) if i + 1 not in frames)
    data[packets[n][0] + 4:packets[n][0] + 8] = (7).to_bytes(4, "little")      # not a multiple of 4
    path = tmp_path / "damaged.pcapng"
    path.write_bytes(bytes(data))
    assert streamed(path) == _renumbered(objs, n + 1)
    proc = kbtp("decode", "--json", str(path), check=False)
    assert proc.returncode == 1 and "claims 7 octets: the file is corrupt;" in proc.stderr.decode()


def _compare_with_tshark(pcap: Path, objs: list[dict]) -> None:
    from tests.test_dissector import ALL_KEYS
    got = {n: v for n, v in tshark_fields(pcap, ALL_KEYS).items() if v}   # less fragments
    assert set(got) == {o["frame"] for o in objs}
    for o in objs:
        have = got[o["frame"]]
        values = {k: v for k, v in o.items() if k.startswith("kbtp.")}
        assert set(have) == set(values), (o["frame"], set(have) ^ set(values))
        for key, value in values.items():
            if isinstance(value, str):
                assert have[key].replace(":", "") == value, (o["frame"], key)
            else:
                assert int(have[key], 0) == value, (o["frame"], key, have[key], value)


@needs_tshark
@pytest.mark.parametrize("name", ["multi", "interleaved"])
def test_variants_equal_the_dissector(variants, name):
    assert EXTRA        # (the tracking fields are the dissector's own)
    _compare_with_tshark(variants[name], streamed(variants[name]))


# ---- as a user runs it ---------------------------------------------------------------------

def test_lines_carry_time_addresses_and_connection():
    lines = kbtp("decode", "pcaps/iwarp_session.pcap").stdout.decode().splitlines()
    first = lines[0].split()
    assert first[0] == "7" and float(first[1]) > 0 and first[2] == "iwarp" and first[3] == "#0"
    assert first[4:7] == ["192.0.2.1:49152", "->", "192.0.2.2:5420"] and first[7] == "HELLO"
    roce = kbtp("decode", "pcaps/roce_addr_le_ipv6_session.pcap").stdout.decode().splitlines()
    assert "2001:db8::2 -> 2001:db8::1 QP 0x000011  HELLO_ACK" in roce[1]
    obj = json.loads(kbtp("decode", "--json", "pcaps/roce_session.pcap").stdout.splitlines()[0])
    assert list(obj)[:7] == ["frame", "time", "transport", "conn", "src", "dst", "dst_qp"]
    assert obj["src"] == "192.0.2.1" and obj["dst_qp"] == 0x22 and obj["time"] > 1.6e9


def test_standard_input_file_and_pipe(tmp_path):
    pcap = ROOT / "pcaps" / "iwarp_session.pcap"
    want = kbtp("decode", "--json", str(pcap)).stdout
    with open(pcap, "rb") as f:
        assert kbtp("decode", "--json", "-", stdin=f).stdout == want
    cat = subprocess.Popen(["cat", str(pcap)], stdout=subprocess.PIPE)
    assert kbtp("decode", "--json", "-", stdin=cat.stdout).stdout == want
    cat.wait()


def test_pcapng_nanoseconds_and_big_endian_read_the_same(tmp_path):
    pcap = ROOT / "pcaps" / "roce_session.pcap"
    want = without_where(streamed(pcap))
    for fmt in ("pcapng", "nsecpcap"):
        other = tmp_path / f"x.{fmt}"
        subprocess.run(["editcap", "-F", fmt, str(pcap), str(other)], check=True, timeout=60)
        got = streamed(other)
        assert without_where(got) == want
        assert [o["time"] for o in got] == [o["time"] for o in streamed(pcap)]
    frames = records(pcap)
    big = tmp_path / "be.pcap"
    with open(big, "wb") as out:
        out.write(struct.pack(">IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for ts, data in frames:
            out.write(struct.pack(">IIII", int(ts), round(ts % 1 * 1e6), len(data), len(data)) + data)
    assert without_where(streamed(big)) == want


@pytest.mark.slow
def test_captures_without_kbtp_say_so_and_nothing_else():
    for pcap in REAL:
        proc = kbtp("decode", str(pcap))
        n = len(records(pcap))
        assert proc.stdout == b""
        assert proc.stderr.decode() == f"no KBTP message in {n:,} frames\n"


def test_summary_counts_messages_connections_and_malformed(variants):
    proc = kbtp("decode", str(variants["multi"]))
    lines = proc.stdout.decode().splitlines()
    frames = len(records(variants["multi"]))
    assert proc.stderr.decode() == f"35 KBTP messages in {frames:,} frames, 5 connections, 5 malformed\n"
    assert len(lines) == 35 and sum("[malformed:" in line for line in lines) == 5


@pytest.mark.slow
def test_count_and_filters(variants):
    path = str(variants["multi"])
    one = kbtp("decode", "-c", "1", "--opcode", "STORE", path)
    assert len(one.stdout.splitlines()) == 1 and b" STORE " in one.stdout
    assert b"(stopped after -c 1)" in one.stderr
    objs = [json.loads(x) for x in kbtp("decode", "--json", "--status", "ALREADY_BOUND",
                                        "--opcode", "COMPLETION", path).stdout.splitlines()]
    assert len(objs) == 5 and {o["kbtp.status"] for o in objs} == {4}
    handles = kbtp("decode", "--json", "--handle", "0x4003", "--handle", "16385", path)
    assert {json.loads(x)["kbtp.handle"] for x in handles.stdout.splitlines()} == {0x4001, 0x4003}
    assert b", 35 KBTP messages" not in handles.stderr and b"shown" in handles.stderr
    bad = kbtp("decode", "--opcode", "FETCH", path, check=False)
    assert bad.returncode == 2 and b"HELLO" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_closed_pipe_ends_quietly(tmp_path):
    """Megabytes of output, written after the reader went away whatever the decoder's
    speed: exit 0, nothing on stderr."""
    frames = records(ROOT / "pcaps" / "roce_session.pcap")
    many = write_pcap(tmp_path / "many.pcap", [(t + 0.01 * i, data) for i in range(200) for t, data in frames])
    proc = subprocess.run(f"{sys.executable} -m kbtp_scapy decode --json {many} | head -1; "
                          "echo ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash",
                          capture_output=True, timeout=60, cwd=ROOT)
    assert len(proc.stdout.splitlines()) == 1
    assert proc.stderr.decode().split() == ["0"]


def _pcapng(path: Path, blocks: list[tuple[int, bytes]]) -> Path:
    """A pcapng file with one interface per (link type, frame) and that frame."""
    def block(kind: int, body: bytes) -> bytes:
        body += bytes(-len(body) % 4)
        return struct.pack("<II", kind, 12 + len(body)) + body + struct.pack("<I", 12 + len(body))
    out = block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1))
    for linktype, _ in blocks:
        out += block(1, struct.pack("<HHI", linktype, 0, 65535))
    for iface, (_, data) in enumerate(blocks):
        out += block(6, struct.pack("<IIIII", iface, 0, 1000 + iface, len(data), len(data)) + data)
    path.write_bytes(out)
    return path


def test_link_types_it_cannot_read_get_one_line(tmp_path):
    erf = write_pcap(tmp_path / "ib.erf.pcap", [(1.0, bytes(80))] * 3, linktype=197)
    proc = kbtp("decode", str(erf), check=False)
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode() == (f"kbtp: {erf}: link type 197, ERF (Endace; native InfiniBand "
                                    "from DAG cards) cannot be decoded: kbtp decode reads Ethernet, "
                                    "Linux cooked, loopback and raw IP captures\n")
    frame = records(ROOT / "pcaps" / "roce_session.pcap")[0][1]
    mixed = _pcapng(tmp_path / "mixed.pcapng", [(197, bytes(80)), (1, frame), (247, bytes(40))])
    proc = kbtp("decode", str(mixed))
    err = proc.stderr.decode().splitlines()
    assert err == [f"kbtp: {mixed}: 1 frame of link type 197, ERF (Endace; native InfiniBand from "
                   "DAG cards) skipped: kbtp decode reads Ethernet, Linux cooked, loopback and raw IP frames",
                   f"kbtp: {mixed}: 1 frame of link type 247, native InfiniBand skipped: kbtp decode "
                   "reads Ethernet, Linux cooked, loopback and raw IP frames",
                   "1 KBTP message in 3 frames, 1 connection"]
    assert b" HELLO " in proc.stdout


def test_hex_takes_0x_spaces_and_names_odd_digits():
    spaced = "0x" + " ".join(["0112 0001", "0000000000000007", "0000000000004001", "0000 0000",
                              "00000000", "0000000000000000", "00000008", "4b56424c4f434b21"])
    assert kbtp("decode", "--hex", spaced).stdout == b"ALLOC_STORE rid=7 handle=0x4001 len=8 INLINE\n"
    odd = kbtp("decode", "--hex", "0x011", check=False)
    assert odd.returncode == 1
    assert odd.stderr == b"kbtp: --hex: odd number of hex digits (3); give two digits per octet\n"


@pytest.mark.slow
def test_every_help_example_runs_as_written(tmp_path):
    shim = tmp_path / "bin" / "kbtp"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m kbtp_scapy \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    text = kbtp("decode", "--help").stdout.decode()
    examples = [line.strip() for line in text.split("Examples:")[1].split("Options:")[0].splitlines()
                if line.strip()]
    assert len(examples) >= 6
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"}
    for example in examples:
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", example], capture_output=True,
                              timeout=120, cwd=ROOT, env=env)
        assert proc.returncode == 0, (example, proc.stderr)
        assert proc.stdout.strip() and b"Traceback" not in proc.stderr, example


# ---- bounded memory --------------------------------------------------------------------------

def _frames_for_memory():
    """Templates: a 4 KiB RoCEv2 RDMA Write, a LOAD and its COMPLETION as Sends, the same
    over iWARP with 8 KiB segments (sequence numbers patched per copy), and the first
    packet of a RoCEv2 Send that never ends."""
    rc = RcConnection(RoceEndpoint("10.9.0.1", "02:00:00:00:09:01", qpn=0x31),
                      RoceEndpoint("10.9.0.2", "02:00:00:00:09:02", qpn=0x32), mtu=4096)
    load = codec.encode({"opcode": Opcode.LOAD, "request_id": 1, "handle": 0x4001,
                         "dd.stag": 5, "dd.length": 4096})
    done = codec.encode({"opcode": Opcode.COMPLETION, "request_id": 1, "handle": 0x4001,
                         "completion.data_length": 4096})
    roce = [bytes(f.original) for f in (rc.send("a", load, ack=False)
                                        + rc.write("b", bytes(4096), va=0, rkey=5, ack=False)
                                        + rc.send("b", done, ack=False))]
    endless = rc.send("a", codec.encode({"opcode": Opcode.STORE, "request_id": 2,
                                         "dd.length": 1 << 30}) + bytes(8192), ack=False)
    first, middle = bytes(endless[0].original), bytes(endless[1].original)
    conv = IwarpConversation(("10.9.1.1", 41000), ("10.9.1.2", 5420), mss=8960)
    setup = [bytes(p) for p in conv.packets]
    start = len(conv.packets)
    conv.send_message("Send", load, from_initiator=True)
    conv.send_message("RDMA Write", bytes(8900), from_initiator=False, stag=5, to=0)
    conv.send_message("Send", done, from_initiator=False)
    iwarp = [bytes(p) for p in conv.packets[start:] if len(p) > 100]
    return roce, (first, middle), setup, iwarp


def _generate(out, size: int) -> None:
    """About ``size`` octets of capture: RoCEv2 and iWARP traffic, a RoCE Send that never
    ends, and an iWARP direction with a lost segment early (everything after it waits)."""
    roce, (first, middle), setup, iwarp = _frames_for_memory()
    rec = struct.Struct("<IIII")
    out.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1))
    t = [1_700_000_000, 0]

    def put(data: bytes) -> int:
        t[1] += 3
        out.write(rec.pack(t[0] + t[1] // 1_000_000, t[1] % 1_000_000, len(data), len(data)))
        out.write(data)
        return 16 + len(data)

    written = sum(put(d) for d in setup) + put(first)
    seq = {}
    for d in iwarp:            # next sequence number per direction, from the templates
        key = d[26:38]
        seq.setdefault(key, int.from_bytes(d[38:42], "big"))
    lost = True
    while written < size:
        for d in roce:
            written += put(d)
        written += put(middle)
        for d in iwarp:
            key = d[26:38]
            frame = bytearray(d)
            frame[38:42] = (seq[key] & 0xFFFFFFFF).to_bytes(4, "big")
            seq[key] += len(d) - 54
            if lost and key == iwarp[0][26:38]:
                lost = False       # the capture missed this segment
                continue
            written += put(bytes(frame))


def _memory(pid: int) -> tuple[int, int]:
    """(resident now, peak resident since exec) of a process, in octets. The peak from
    wait4 would count the pages the child shared with this process between fork and exec."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def decoded_flat(args: list[str], feed=None) -> None:
    """Run ``kbtp decode ARGS`` (``feed(stdin)`` writing its input, if given), its memory
    sampled every 20 ms: over 40,000 messages, peak resident memory under 100 MB, not
    growing after the first quarter of the run."""
    proc = subprocess.Popen([sys.executable, "-m", "kbtp_scapy", "decode", *args],
                            stdin=subprocess.PIPE if feed else subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=ROOT)
    samples: list[tuple[int, int]] = []

    def sample() -> None:
        while proc.poll() is None:
            try:
                samples.append(_memory(proc.pid))
            except (OSError, ValueError):
                return
            time.sleep(0.02)
    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        if feed:
            feed(proc.stdin)
    finally:
        if proc.stdin:
            proc.stdin.close()
    proc.wait(120)
    watcher.join()
    err = proc.stderr.read().decode()
    assert proc.returncode == 0, err
    messages = int(err.split()[0].replace(",", ""))
    assert messages > 40_000, err
    assert len(samples) >= 10
    peak = max(hwm for _, hwm in samples)
    assert peak < 100 << 20, (peak, err)
    resident = [rss for rss, _ in samples]
    quarter = max(resident[: len(resident) // 4])
    assert max(resident) - quarter < 24 << 20, (quarter, max(resident))


@pytest.mark.slow
def test_memory_stays_flat_on_a_large_capture_from_a_pipe():
    """A capture of over 200 MB generated on the fly into `kbtp decode --json -`: peak
    resident memory stays under 100 MB and does not grow with the input."""
    decoded_flat(["--json", "-"], lambda stdin: _generate(stdin, 210 << 20))


# ---- garbage ---------------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

_ETH_IP = bytes.fromhex("020000000002020000000001" "0800")


def _ipv4(proto: int, body: bytes, extra: int) -> bytes:
    length = (20 + len(body) + extra) & 0xFFFF
    return (bytes([0x45, 0]) + length.to_bytes(2, "big") + bytes(4) + bytes([64, proto, 0, 0])
            + bytes([10, 0, 0, 1, 10, 0, 0, 2]) + body)


_frames = st.one_of(
    st.binary(max_size=120),                                            # anything at all
    st.builds(lambda b, e: _ETH_IP + _ipv4(17, b"\xc0\x01\x12\xb7" + b, e),   # UDP to 4791
              st.binary(max_size=200), st.integers(-30, 30)),
    st.builds(lambda b, e: _ETH_IP + _ipv4(6, b"\x9c\x41\x15\x2c" + b, e),    # TCP 40001 -> 5420
              st.binary(max_size=200), st.integers(-30, 30)))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 101, 113, 276, 0, 197]), _frames), max_size=12))
def test_decoder_survives_any_frames(frames):
    """Frames of any content and link type: the decoder reads what it can, never raises."""
    import io
    out = io.BytesIO()
    out.write(b"\x0a\x0d\x0d\x0a" + struct.pack("<IIHHq", 28, 0x1A2B3C4D, 1, 0, -1) + struct.pack("<I", 28))
    for linktype, _ in frames:
        out.write(struct.pack("<IIHHII", 1, 20, linktype, 0, 0, 20))
    for iface, (_, data) in enumerate(frames):
        body = struct.pack("<IIIII", iface, 0, iface, len(data), len(data)) + data + bytes(-len(data) % 4)
        out.write(struct.pack("<II", 6, 12 + len(body)) + body + struct.pack("<I", 12 + len(body)))
    out.seek(0)
    stats = Stats()
    for found in kbtp_messages(stream_messages(Reader(out), stats)):
        to_json(found)
    assert stats.frames == len(frames)


def _lua_srt(pcap: Path) -> dict[str, dict[str, tuple[int, float, float]]]:
    """The Lua dissector's SRT tables in real tshark (-o kbtp.srt:TRUE): column -> row ->
    (calls, min, max)."""
    from tests.tshark import TSHARK
    lua = Path(__file__).resolve().parent.parent / "dissector" / "kbtp.lua"
    out = subprocess.run([TSHARK, "-q", "-n", "-X", f"lua_script:{lua}", "-o", "kbtp.srt:TRUE",
                          "-o", "tcp.try_heuristic_first:TRUE", "-r", str(pcap)],
                         capture_output=True, text=True, timeout=300).stdout
    tables: dict[str, dict[str, tuple[int, float, float]]] = {}
    current: dict[str, tuple[int, float, float]] = {}
    for line in out.splitlines():
        if line.startswith("Index  "):
            current = tables.setdefault(line[7:29].strip(), {})
        elif line[:5].strip().isdigit():
            calls, lo, hi = line[30:].split()[:3]
            current[line[7:29].strip()] = (int(calls), float(lo), float(hi))
    return tables


@needs_tshark
@pytest.mark.parametrize("name", ["roce_session.pcap", "iwarp_session.pcap", "rxe_kernel_session.pcap"])
def test_stats_are_the_dissectors_response_times(name):
    """--stats: per request opcode and per opcode and status, the calls, min and max that the
    dissector's SRT tables give in tshark, without a C plugin (or root) to load; and the
    requests answered by a completion record besides, which the dissector's SRT leaves out
    (docs/dissector.md): those of each opcode that ask for a record (RECORD, not BIND)."""
    pcap = Path(__file__).resolve().parent.parent / "pcaps" / name
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--stats", "--json", str(pcap)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    ours = {"Opcode": doc["by_opcode"],
            **{f"{op} status": rows for op, rows in doc["by_opcode_status"].items()}}
    listed = [json.loads(line) for line in kbtp("decode", "--json", str(pcap)).stdout.splitlines()]
    recorded = Counter(Opcode(o["kbtp.opcode"]).name for o in listed
                       if o.get("kbtp.flags.record") and o["kbtp.opcode"] != Opcode.BIND)
    theirs = _lua_srt(pcap)
    assert set(ours) == set(theirs) and len(theirs) > 2
    assert doc["unanswered"] == 0
    for column, rows in theirs.items():
        op = column.removesuffix(" status")
        if column != "Opcode" and recorded[op]:        # a record's status row too
            assert set(ours[column]) >= set(rows), column
            assert sum(s["calls"] for s in ours[column].values()) == sum(c for c, _, _ in rows.values()) + recorded[op]
            continue
        assert set(ours[column]) == set(rows), column
        for row, (calls, lo, hi) in rows.items():
            got = ours[column][row]
            assert got["calls"] == calls + (recorded[row] if column == "Opcode" else 0), (column, row)
            if column != "Opcode" or not recorded[row]:
                assert abs(got["min"] - lo) < 2e-6 and abs(got["max"] - hi) < 2e-6, (column, row, got, (calls, lo, hi))
    text = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--stats", str(pcap)],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and text.stdout.splitlines()[0].split()[:2] == ["Opcode", "Calls"]
    mixed = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--stats", "--opcode", "LOAD", str(pcap)],
                           capture_output=True, text=True, timeout=120)
    assert mixed.returncode == 2 and len(mixed.stderr.splitlines()) == 1, mixed.stderr


def test_response_times_keep_a_bounded_number_of_requests_waiting(monkeypatch):
    """A capture whose requests are never answered (here: every answer left out of a real
    capture) keeps at most MAX_PENDING requests waiting; the ones given up still count as
    unanswered."""
    import kbtp_scapy.capture as capture
    pcap = ROOT / "pcaps" / "roce_session.pcap"
    found = [f for f in kbtp_messages(stream_messages(Reader(pcap.open("rb"), str(pcap))))
             if f.fields.get("opcode") != Opcode.COMPLETION]
    requests = sum(1 for f in found if f.fields.get("opcode") in REQUESTS)
    assert requests > 4
    monkeypatch.setattr(capture, "MAX_PENDING", 3)
    times = capture.ResponseTimes()
    for f in found:
        times.add(f)
    assert len(times.pending) == 3 and times.as_json()["unanswered"] == requests
    assert times.text()[-1] == f"1 request answered, {requests} unanswered"      # the HELLO


@pytest.mark.parametrize("name", ["roce_session.pcap", "iwarp_session.pcap"])
def test_where_filters_pick_connections_endpoints_and_a_time_window(name):
    """--conn, --addr, --qp, --from and --to (a -Y for the questions a capture raises) show
    exactly the messages the whole JSON output says are there, and the summary counts them."""
    pcap = Path(__file__).resolve().parent.parent / "pcaps" / name

    def frames(*args: str) -> list[int]:
        proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--json", *args, str(pcap)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line)["frame"] for line in proc.stdout.splitlines()]

    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--json", str(pcap)],
                          capture_output=True, text=True, timeout=120)
    every = [json.loads(line) for line in proc.stdout.splitlines()]
    origin = float(read_packets(pcap)[0].time)          # the capture's first frame, any kind
    times = sorted(m["time"] for m in every)
    start, end = times[len(times) // 4] - origin, times[3 * len(times) // 4] - origin
    src = every[0]["src"]
    assert frames("--addr", src) == [m["frame"] for m in every if src in (m["src"], m["dst"])]
    assert frames("--conn", "0") == [m["frame"] for m in every if m["conn"] == 0]
    window = frames("--from", f"{start:.6f}", "--to", f"{end:.6f}")
    at = {m["frame"]: m["time"] - origin for m in every}
    assert 0 < len(window) < len(every)
    assert all(start - 2e-6 <= at[f] <= end + 2e-6 for f in window)
    assert all(f in window for f, t in at.items() if start + 2e-6 <= t <= end - 2e-6)
    if name.startswith("roce"):
        qp = every[0]["dst_qp"]                         # the connection with it at either end
        assert frames("--qp", hex(qp)) == [m["frame"] for m in every if m["conn"] == every[0]["conn"]] != []
    else:
        assert frames("--qp", "1") == []                 # iWARP names no QP
    assert frames("--conn", "7") == []
