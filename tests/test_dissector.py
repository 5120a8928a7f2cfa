"""The generated Lua dissector in real tshark 4.0, against the Scapy/codec decode.

Field names come from the tables, so a field added later cannot escape these tests.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy import codec, tables as T
from kbtp_scapy.builders.recorder import recorder, write_pcap
from kbtp_scapy.capture import kbtp_messages, rdma_messages, read_packets, to_json
from tests.tshark import TSHARK, needs_tshark

pytestmark = needs_tshark

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "dissector" / "kbtp.lua"
PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))
REAL = sorted((ROOT / "tests" / "data" / "captures").glob("*.pcap"))
PLUGIN = ("-X", f"lua_script:{LUA}", "-o", "tcp.try_heuristic_first:TRUE")
INDEX = T.wire_fields()
ALL_KEYS = sorted({k for k, (f, _) in INDEX.items()} | {
    bit for k, (f, _) in INDEX.items() for m in (*T.MESSAGES, None)
    for bit, _ in T.flag_bits(k, f, m)})
#: Frames with KBTP messages or fragments; RDMA transfers labelled by rdma.lua carry a
#: hidden kbtp_rdma item beside their kbtp subtree.
KBTP_FRAMES = "kbtp && !kbtp_rdma"
EXTRA = ("request_in", "response_in", "data_for", "fragment_in", "session.addr_le")


def tshark(pcap: Path, *args: str, plugin: bool = True) -> str:
    proc = subprocess.run([TSHARK, "-n", "-r", str(pcap), *(PLUGIN if plugin else ()), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Lua" not in proc.stderr, proc.stderr
    return proc.stdout


def fields(pcap: Path, keys: list[str], *args: str) -> dict[int, dict[str, str]]:
    """Per frame that has KBTP: filter name -> value as tshark prints it."""
    cols = [f"kbtp.{k}" for k in keys]
    out = tshark(pcap, "-T", "fields", "-E", "occurrence=l", "-e", "frame.number",
                 *(a for c in cols for a in ("-e", c)), "-Y", KBTP_FRAMES, *args)
    rows = {}
    for line in out.splitlines():
        number, *values = line.split("\t")
        rows[int(number)] = {c: v for c, v in zip(cols, values) if v != ""}
    return rows


def _number(text: str) -> int:
    return int(text, 0)


def expected(pcap: Path) -> dict[int, dict[str, str | int]]:
    addr_le = None
    out = {}
    for found in kbtp_messages(rdma_messages(read_packets(pcap)), addr_le):
        obj = to_json(found)
        out[found.frame] = {k: v for k, v in obj.items() if k.startswith("kbtp.")}
    return out


@pytest.mark.slow
def test_generated_files_are_fresh_and_check_catches_staleness(tmp_path):
    """The committed dissector and Python vocabulary match the tables; an edit to each is caught."""
    run = [sys.executable, "-m", "kbtp_scapy", "dissector", "generate"]
    assert subprocess.run([*run, "--check"], capture_output=True, timeout=120).returncode == 0
    to_tmp = ["--out", str(tmp_path), "--vocab", str(tmp_path / "vocab.py"), "--core", str(tmp_path / "_core_tables.h")]
    assert subprocess.run([*run, *to_tmp], capture_output=True, timeout=120).returncode == 0
    assert subprocess.run([*run, "--check", *to_tmp], capture_output=True, timeout=120).returncode == 0
    edits = {"kbtp.lua": ('"kbtp.dd.stag"', '"kbtp.dd.stag2"'),         # either form stale fails the check
             "packet-kbtp.c": ('"kbtp.dd.stag"', '"kbtp.dd.stag2"'),
             "plugin.c": ("plugin_version", "plugin_versio"),
             "vocab.py": ("    NOT_VALID = 3\n", "    NOT_VALID = 4\n"),
             "_core_tables.h": ('"\\"kbtp.dd.stag\\": "', '"\\"kbtp.dd.stag2\\": "')}
    for name, (old, new) in edits.items():
        path = tmp_path / name
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))
    proc = subprocess.run([*run, "--check", *to_tmp], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "stale" in proc.stderr
    assert all(str(tmp_path / name) in proc.stderr for name in edits), proc.stderr


@pytest.mark.slow
def test_installed_plugin_registers_every_table_field(tmp_path):
    """`kbtp dissector install` puts the plugin where tshark looks; tshark then knows a
    filter name for every field and flag bit of the tables."""
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "install", "--lua"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([TSHARK, "-G", "fields"], capture_output=True, text=True, timeout=120, env=env)
    names = {line.split("\t")[2] for line in proc.stdout.splitlines() if line.startswith("F\t")}
    missing = [k for k in ALL_KEYS if f"kbtp.{k}" not in names]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: p.name)
def test_every_field_of_every_frame_equals_the_scapy_decode(pcap, two_pass):
    want = expected(pcap)
    got = fields(pcap, ALL_KEYS, *(("-2",) if two_pass else ()))
    assert set(got) == set(want), "frames carrying KBTP differ"
    for frame, values in want.items():
        have = got[frame]
        assert set(have) == set(values), (frame, set(have) ^ set(values))
        for key, value in values.items():
            if isinstance(value, str):          # octet strings, hex in both
                assert have[key].replace(":", "") == value, (frame, key)
            else:
                assert _number(have[key]) == value, (frame, key, have[key], value)


@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: p.name)
def test_requests_and_answers_are_linked(pcap, two_pass):
    found = list(kbtp_messages(rdma_messages(read_packets(pcap))))
    pending, links = {}, {}
    for f in found:
        msg = T.BY_OPCODE[f.fields["opcode"]]
        if msg.answer:
            pending[(f.fields["request_id"], msg.answer)] = f.frame
        elif (f.fields["request_id"], msg.name) in pending:
            links[f.frame] = pending.pop((f.fields["request_id"], msg.name))
    answers = {m.answer for m in T.MESSAGES if m.answer}
    assert len(links) == sum(T.BY_OPCODE[f.fields["opcode"]].name in answers for f in found) > 10
    got = fields(pcap, ["request_in", "response_in", "time"], *(("-2",) if two_pass else ()))
    for answer, request in links.items():
        assert _number(got[answer]["kbtp.request_in"]) == request
        assert float(got[answer]["kbtp.time"]) >= 0
        if two_pass:
            assert _number(got[request]["kbtp.response_in"]) == answer
    unlinked = [n for n, v in got.items() if "kbtp.request_in" in v and n not in links]
    assert not unlinked


@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: p.name)
def test_kbtp_opcode_filters_the_messages_and_kbtp_adds_the_rdma_transfers(pcap):
    """What FIELDS.md and the README tell users to filter on: ``kbtp.opcode`` matches the
    frames of the messages the Scapy decode finds, no more; ``kbtp`` adds the RDMA
    transfers the dissector labels (``kbtp_rdma``)."""
    rows = [line.split("\t") for line in tshark(pcap, "-T", "fields", "-e", "frame.number", "-e",
                                                 "kbtp.opcode", "-e", "kbtp_rdma", "-Y", "kbtp").splitlines()]
    with_opcode = {int(n) for n, opcode, _ in rows if opcode}
    labelled = {int(n) for n, _, rdma in rows if rdma}
    assert with_opcode == set(expected(pcap))                     # what -Y kbtp.opcode shows
    assert labelled and {int(n) for n, *_ in rows} == with_opcode | labelled


def _expert(pcap: Path, *args: str) -> list[tuple[int, str, str]]:
    out = tshark(pcap, "-T", "fields", "-E", "occurrence=a", "-E", "aggregator=|",
                 "-e", "frame.number", "-e", "_ws.expert.severity", "-e", "_ws.expert.message",
                 "-Y", KBTP_FRAMES, *args)
    rows = []
    for line in out.splitlines():
        number, sev, msg = (line.split("\t") + ["", ""])[:3]
        for s, m in zip(sev.split("|"), msg.split("|")):
            if s:
                rows.append((int(number), s, m))
    return rows


@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: p.name)
def test_expert_info_flags_statuses_and_the_malformed_request(pcap):
    found = {f.frame: f for f in kbtp_messages(rdma_messages(read_packets(pcap)))}
    rows = _expert(pcap)
    warnings = {(n, m) for n, s, m in rows if s == str(0x00600000)}
    errors = {n for n, s, m in rows if s == str(0x00800000)}
    bad_status = {n: T.STATUS.describe(f.fields["status"]) for n, f in found.items()
                  if f.fields["opcode"] == T.BY_NAME["COMPLETION"].opcode and f.fields["status"]}
    assert {n for n, _ in warnings} == set(bad_status)
    assert all(name == msg for (n, msg) in warnings for name in [bad_status[n]])
    assert errors == {n for n, f in found.items() if f.error}


def _messages_capture(path: Path, transport: str, messages: list[tuple[str, dict]]) -> Path:
    write_pcap(path, transport, [(d, codec.encode(v)) for d, v in messages])
    return path


@pytest.mark.parametrize("transport", ["roce", "iwarp"])
def test_expert_notes_for_unanswered_credits_and_undefined_flags(tmp_path, transport):
    load = {"opcode": 0x10, "dd.stag": 1, "dd.length": 8}
    pcap = _messages_capture(tmp_path / "e.pcap", transport, [
        ("request", {"opcode": 0x01}),
        ("response", {"opcode": 0x02, "hello_ack.request_credits": 1, "hello_ack.block_size": 8}),
        ("request", {**load, "request_id": 1}),
        ("request", {**load, "request_id": 2, "flags": 0x0100}),   # over credits, undefined bit
        ("response", {"opcode": 0x20, "request_id": 99}),            # answers nothing
    ])
    messages = [m for _, _, m in _expert(pcap)]
    assert messages.count("2 requests outstanding, 1 credits") == 1
    assert messages.count("undefined flag bits 0x0100") == 1
    assert messages.count("Answer to a request not seen") == 1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["roce", "iwarp"])
def test_multi_packet_send_is_reassembled_and_every_fragment_claimed(tmp_path, transport):
    data = bytes(range(256)) * 12
    rec = recorder(transport)
    rec.send(True, codec.encode({"opcode": 0x01}))
    store = codec.encode({"opcode": 0x12, "request_id": 5, "handle": 0x4001, "inline_data": data})
    rec.send(True, store)
    rec.send(False, codec.encode({"opcode": 0x20, "request_id": 5, "completion.data_length": len(data)}))
    pcap = tmp_path / "big.pcap"
    rec.write_pcap(pcap)
    for args in ((), ("-2",)):
        text = tshark(pcap, *args)
        assert "Malformed" not in text and "RPCoRDMA" not in text, text
        rows = fields(pcap, ["opcode", "inline_data", "fragment_in", "dd.length"], *args)
        frame = [n for n, v in rows.items() if v.get("kbtp.opcode") == "0x12"]
        assert len(frame) == 1
        assert bytes.fromhex(rows[frame[0]]["kbtp.inline_data"].replace(":", "")) == data
        if transport == "roce":     # 1024-octet path MTU: every packet but the last is a fragment
            fragments = [n for n, v in rows.items() if "kbtp.opcode" not in v]   # matched by "kbtp"
            assert len(fragments) == -(-len(store) // 1024) - 1
            if args:                # one-pass: a fragment cannot know yet where its message ends
                assert all(_number(rows[n]["kbtp.fragment_in"]) == frame[0] for n in fragments)


def test_addr_le_preference_covers_a_capture_without_hello_ack(tmp_path):
    load = {"opcode": 0x10, "handle": 0x4001, "dd.stag": 0x1234, "dd.length": 8}
    path = tmp_path / "mid.pcap"
    rec = recorder("roce")          # starts mid-session, address fields little-endian
    rec.send(True, codec.encode(load, addr_le=True))
    rec.write_pcap(path)
    auto = fields(path, ["handle", "dd.stag"])
    on = fields(path, ["handle", "dd.stag", "session.addr_le"], "-o", "kbtp.addr_le:on")
    (a,), (b,) = auto.values(), on.values()
    assert _number(a["kbtp.handle"]) == 0x0140000000000000
    assert _number(b["kbtp.handle"]) == 0x4001 and _number(b["kbtp.dd.stag"]) == 0x1234
    assert b["kbtp.session.addr_le"] == "1"


INERT = """local p = Proto("inert", "inert")
local function no(tvb, pinfo, tree) return false end
p:register_heuristic("infiniband.payload", no)
p:register_heuristic("iwarp_ddp_rdmap", no)
"""


@pytest.mark.slow
@pytest.mark.parametrize("pcap", REAL, ids=lambda p: p.name)
def test_real_captures_decode_exactly_as_without_the_plugin(pcap, tmp_path):
    """The plugin claims nothing in other software's captures. tshark 4.0 itself changes
    one thing as soon as any Lua heuristic sits in these tables, even one that always
    declines: RPC-over-RDMA then appears in 'Protocols in frame' of a frame whose Send
    its heuristic examined. So: identical to tshark with such an inert heuristic, and
    identical to plain tshark but for that line."""
    inert = tmp_path / "inert.lua"
    inert.write_text(INERT)
    with_plugin = tshark(pcap, "-V")
    assert with_plugin == tshark(pcap, "-V", "-X", f"lua_script:{inert}", plugin=False)
    plain = tshark(pcap, "-V", plugin=False)

    def strip(text: str) -> list[str]:
        return [line for line in text.splitlines() if "[Protocols in frame:" not in line]
    assert strip(with_plugin) == strip(plain)
    assert "kbtp" not in with_plugin.lower()


@pytest.mark.parametrize("transport", ["roce", "iwarp"])
def test_64_bit_values_beyond_double_precision_in_info_and_links(tmp_path, transport):
    """The runtime keeps 64-bit values as octet strings, not numbers: Request IDs above
    2^53 still print exactly, in decimal, and still pair a request with its answer."""
    big = [2**64 - 1, 2**53 + 1, 0x123456789ABCDEF0]
    msgs = []
    for rid in big:
        msgs.append(("request", {"opcode": 0x10, "request_id": rid, "handle": rid, "dd.stag": 1, "dd.length": 8}))
        msgs.append(("response", {"opcode": 0x20, "request_id": rid, "handle": rid,
                                  "completion.block_offset": rid}))
    pcap = _messages_capture(tmp_path / "big_ids.pcap", transport, msgs)
    out = tshark(pcap, "-T", "fields", "-e", "frame.number", "-e", "_ws.col.Info",
                 "-e", "kbtp.request_in", "-Y", KBTP_FRAMES)
    rows = [line.split("\t") for line in out.splitlines()]
    assert len(rows) == 2 * len(big)
    for (req, res), rid in zip(zip(rows[::2], rows[1::2]), big):
        assert f"LOAD rid={rid} handle={rid:#x} len=8" in req[1], req
        assert f"COMPLETION rid={rid} OK gen=0 off={rid:#x}" in res[1], res
        assert int(res[2]) == int(req[0])


def test_response_in_is_a_second_pass_field_and_the_docs_say_so():
    """``kbtp.response_in`` (and ``kbtp.data_in``) are known only once the answer has been
    read: tshark matches them with ``-2`` alone, and the field reference says so beside
    each; ``kbtp.request_in`` needs no second pass."""
    pcap = ROOT / "pcaps" / "roce_session.pcap"
    count = lambda *args: len(tshark(pcap, "-T", "fields", "-e", "frame.number", *args).split())
    assert count("-Y", "kbtp.response_in") == 0 and count("-2", "-Y", "kbtp.response_in") > 10
    assert count("-Y", "kbtp.request_in") == count("-2", "-Y", "kbtp.response_in")
    fields = (ROOT / "dissector" / "FIELDS.md").read_text()
    for name in ("kbtp.response_in", "kbtp.data_in"):
        row = next(line for line in fields.splitlines() if line.startswith(f"| `{name}`"))
        assert "tshark -2" in row, row


def test_shipped_colouring_rules_are_filters_that_colour_the_samples():
    """docs/kbtp.colorfilters: every rule is a display filter tshark accepts, and each but
    the bad-ICRC one colours frames of the sample captures; the opcode rules together
    colour every KBTP message, each once."""
    rules = [line.split("@")[1:3] for line in (ROOT / "docs" / "kbtp.colorfilters").read_text().splitlines()
             if line.startswith("@")]
    assert len(rules) >= 6
    pcap = ROOT / "pcaps" / "roce_session.pcap"
    hits = {}
    for name, rule in rules:
        frames = tshark(pcap, "-T", "fields", "-e", "frame.number", "-Y", rule).split()
        hits[name] = {int(n) for n in frames}
        assert hits[name] or name == "KBTP bad ICRC", name
    messages = set(expected(pcap))
    by_opcode = [hits[n] for n in ("KBTP session", "KBTP completion", "KBTP request")]
    assert set().union(*by_opcode) == messages and sum(map(len, by_opcode)) == len(messages)
