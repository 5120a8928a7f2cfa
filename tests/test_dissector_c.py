"""The generated C dissector against the Lua one, in real tshark 4.0: the same kbtp fields,
tree and expert infos, frame for frame, in tshark's JSON and Elasticsearch (ek) output,
over every capture in pcaps/, captures the suite builds and the dissector fuzz corpus.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import test_dissector_fuzz as fuzz, test_dissector_rdma as rdma
from tests.cplugin import ROOT, c_plugin, needs_toolchain, run_form  # noqa: F401 (fixture)
from tests.tshark import TSHARK, folders, needs_tshark, private_home

pytestmark = [needs_tshark, needs_toolchain]

PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))


class Obj(list):
    """A JSON object as its (key, value) pairs: tshark repeats a key for a field added
    more than once (kbtp.data_in), which a dict would keep only the last of."""


def kbtp_json(node, out: list) -> None:
    """The kbtp and kbtp_rdma items of a frame's JSON tree, in tree order, whole."""
    if isinstance(node, Obj):
        for key, value in node:
            if key.split(".")[0] in ("kbtp", "kbtp_rdma"):
                out.append((key, value))
            else:
                kbtp_json(value, out)
    elif isinstance(node, list):
        for item in node:
            kbtp_json(item, out)


def frames_json(form: str, plugin: Path, pcap: Path, *args: str) -> list[list]:
    out = []
    for frame in json.loads(run_form(form, plugin, pcap, "-T", "json", *args).stdout or "[]", object_pairs_hook=Obj):
        items: list = []
        kbtp_json(frame, items)
        out.append(items)
    return out


def frames_ek(form: str, plugin: Path, pcap: Path, *args: str) -> list[dict]:
    out = []
    for line in run_form(form, plugin, pcap, "-T", "ek", *args).stdout.splitlines():
        doc = json.loads(line)
        if "layers" in doc:
            out.append({k: v for k, v in doc["layers"].items() if k.split("_")[0] == "kbtp"})
    return out


def same(plugin: Path, pcap: Path, *args: str) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        lua, c = pool.map(lambda form: frames_json(form, plugin, pcap, *args), ("lua", "c"))
    assert len(lua) == len(c)
    differ = [n for n, (a, b) in enumerate(zip(lua, c), 1) if a != b]
    assert not differ, (pcap.name, args, differ[:10], lua[differ[0] - 1], c[differ[0] - 1])
    assert any(lua), "no KBTP in the capture"
    if "-2" not in args:
        with ThreadPoolExecutor(max_workers=2) as pool:
            lua_ek, c_ek = pool.map(lambda form: frames_ek(form, plugin, pcap, *args), ("lua", "c"))
        differ = [n for n, (a, b) in enumerate(zip(lua_ek, c_ek), 1) if a != b]
        assert len(lua_ek) == len(c_ek) and not differ, (pcap.name, differ[:10])


def same_text(plugin: Path, pcap: Path) -> None:
    """The whole -V text, every protocol's: the same tree with the same labels. Only the
    'Protocols in frame' line may differ: with any Lua heuristic in the tables, tshark 4.0
    lists rpcordma for frames whose Send its heuristic examined (test_dissector.py)."""
    def text(form: str) -> list[str]:
        out = run_form(form, plugin, pcap, "-V").stdout
        return [line for line in out.splitlines() if "[Protocols in frame:" not in line]
    with ThreadPoolExecutor(max_workers=2) as pool:
        lua, c = pool.map(text, ("lua", "c"))
    assert lua == c, next(f"line {i}: {a!r} / {b!r}" for i, (a, b) in enumerate(zip(lua, c)) if a != b)


@pytest.mark.slow
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: p.name)
def test_committed_captures_decode_the_same_in_both_forms(c_plugin, pcap, two_pass):  # noqa: F811
    same(c_plugin, pcap, *(("-2",) if two_pass else ()))
    if not two_pass:
        same_text(c_plugin, pcap)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Captures the suite builds: the RDMA-transfer and ring-counter sessions on both
    bindings (ADDR_LE too), and the fuzz corpus."""
    out = {}
    directory = tmp_path_factory.mktemp("both_forms")
    for transport, addr_le in rdma.CASES:
        path = directory / f"rdma_{transport}{'_le' if addr_le else ''}.pcap"
        rdma.build(transport, path, addr_le)
        out[path.stem] = path
    for name in fuzz.build(directory / "fuzz"):
        out[f"fuzz_{name}"] = directory / "fuzz" / f"{name}.pcap"
    return out


SUITE = [f"rdma_{t}{'_le' if le else ''}" for t, le in rdma.CASES]
FUZZ = ["fuzz_raw_roce", "fuzz_raw_iwarp", "fuzz_reframed_roce", "fuzz_reframed_iwarp"]
#: tshark -2 on the fuzzed iWARP TCP streams: without a tree in the first pass the Lua form
#: reads MPA FPDUs from the segment's octets itself, also in segments that tshark's TCP
#: never hands to MPA (retransmissions, segments of a PDU reassembled later); the C form
#: asks for the RDMA fields (set_postdissector_wanted_hfids) and sees only what tshark
#: dissects. A dozen of 13,000 frames differ. Strict: if they agree one day, this says so.
LUA_TREELESS = pytest.mark.xfail(strict=True, reason="Lua's tree-less first pass reads FPDUs tshark skips")


@pytest.mark.slow
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("name", SUITE)
def test_suite_captures_decode_the_same_in_both_forms(c_plugin, built, name, two_pass):  # noqa: F811
    same(c_plugin, built[name], *(("-2",) if two_pass else ()))
    if not two_pass:
        same_text(c_plugin, built[name])


@pytest.mark.slow
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("name", FUZZ)
def test_fuzz_corpus_decodes_the_same_in_both_forms(c_plugin, built, name, two_pass, request):  # noqa: F811
    if two_pass and "iwarp" in name:
        request.applymarker(LUA_TREELESS)
    same(c_plugin, built[name], *(("-2",) if two_pass else ()))


@pytest.mark.slow
def test_plugin_builds_at_wall_wextra_without_a_warning(c_plugin, tmp_path):  # noqa: F811
    """The build treats warnings as errors; the installable plugin builds too, and the
    generated sources are what `kbtp dissector generate --check` expects."""
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "build", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and (tmp_path / "kbtp.so").exists(), proc.stderr
    assert c_plugin.exists()


@pytest.mark.slow
def test_install_chooses_a_form_and_says_why(tmp_path):
    """The C plugin when it builds and Wireshark will load it; as root (Wireshark then reads
    no personal plugin folder) kbtp.lua, unless --c says otherwise."""
    env = private_home(tmp_path)
    kbtp = [sys.executable, "-m", "kbtp_scapy", "dissector"]
    proc = subprocess.run([*kbtp, "install"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    if os.geteuid() == 0:
        assert proc.stdout.startswith("installing the Lua plugin: Wireshark 4.0 reads no personal plugin folder "
                                      "when run as root"), proc.stdout
        proc = subprocess.run([*kbtp, "install", "--c"], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0 and "registers first and kbtp.lua steps aside" in proc.stdout, proc.stdout
    else:
        assert proc.stdout.startswith("installing the C plugin: gcc and the Wireshark headers are here")
    installed = [Path(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("installed ")]
    assert len(installed) == 1 and installed[0].name == "kbtp.so" and installed[0].parent.name == "epan"
    proc = subprocess.run([*kbtp, "install", "--lua"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "registers first and kbtp.lua steps aside" in proc.stdout, proc.stdout
    proc = subprocess.run([*kbtp, "uninstall"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("removed ") == 2 and not installed[0].exists()


def test_install_without_a_compiler_falls_back_to_lua(tmp_path):
    env = private_home(tmp_path)
    tshark_dir = tmp_path / "bin"
    tshark_dir.mkdir()
    (tshark_dir / "tshark").symlink_to(TSHARK)
    env["PATH"] = str(tshark_dir)
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "install"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("installing the Lua plugin: the C plugin cannot be built here: gcc is not installed")
    assert (Path(env["HOME"]) / ".local/lib/wireshark/plugins/kbtp.lua").exists()
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "install", "--c"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("kbtp: cannot build the C plugin: gcc is not installed")


@pytest.mark.slow
def test_both_forms_loaded_register_once(c_plugin, tmp_path):  # noqa: F811
    """The C plugin and kbtp.lua at once: the C plugin registers, kbtp.lua steps aside;
    one kbtp.opcode field, no error, and the output of the C plugin alone."""
    env = private_home(tmp_path)
    pcap = ROOT / "pcaps" / "roce_session.pcap"
    fields = subprocess.run([TSHARK, "-G", "fields", "-X", f"lua_script:{ROOT / 'dissector' / 'kbtp.lua'}"],
                            capture_output=True, text=True, timeout=120, env={**env, "LD_PRELOAD": str(c_plugin)})
    assert fields.returncode == 0 and "Lua" not in fields.stderr, fields.stderr
    assert [line.split("\t")[2] for line in fields.stdout.splitlines()
            if line.startswith("F\t")].count("kbtp.opcode") == 1
    both = subprocess.run([TSHARK, "-n", "-r", str(pcap), "-V", "-X", f"lua_script:{ROOT / 'dissector' / 'kbtp.lua'}"],
                          capture_output=True, text=True, timeout=120, env={**env, "LD_PRELOAD": str(c_plugin)})
    assert both.returncode == 0 and "Lua" not in both.stderr
    alone = subprocess.run([TSHARK, "-n", "-r", str(pcap), "-V"], capture_output=True, text=True, timeout=120,
                           env={**env, "LD_PRELOAD": str(c_plugin)})
    assert both.stdout == alone.stdout


FORMS = ["lua", "c"]


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_names_of_opcodes_and_statuses_work_in_display_filters(c_plugin, form, tmp_path):  # noqa: F811
    """`kbtp.opcode == LOAD` and `kbtp.status == NOT_VALID` select what the numbers select
    (the names come from the tables); a Private Use code keeps a readable label."""
    from kbtp_scapy import codec, tables as T
    from kbtp_scapy.builders.recorder import write_pcap
    from kbtp_scapy.vocab import Opcode, Status
    lo, _ = T.OPCODES.private_range
    pcap = tmp_path / "names.pcap"
    write_pcap(pcap, "roce", [(d, codec.encode(v)) for d, v in [
        ("request", {"opcode": Opcode.LOAD, "request_id": 1, "dd.stag": 1, "dd.length": 8}),
        ("response", {"opcode": Opcode.COMPLETION, "request_id": 1, "status": Status.NOT_VALID}),
        ("request", {"opcode": lo + 5, "request_id": 2}),
    ]])

    def frames(display_filter: str) -> list[str]:
        out = run_form(form, c_plugin, pcap, "-Y", display_filter, "-T", "fields", "-e", "kbtp.opcode").stdout
        return out.split()
    assert frames("kbtp.opcode == LOAD") == frames(f"kbtp.opcode == {int(Opcode.LOAD)}") == ["0x10"]
    assert frames("kbtp.status == NOT_VALID") == frames(f"kbtp.status == {int(Status.NOT_VALID)}") == ["0x20"]
    assert frames('kbtp.opcode == "COMPLETION"') == ["0x20"]
    tree = run_form(form, c_plugin, pcap, "-V").stdout
    assert f"    Opcode: Private Use ({lo + 5:#04x})\n" in tree and "    Opcode: LOAD (0x10)\n" in tree
    assert "    Status: NOT_VALID (3)\n" in tree


def _decoded(pcap: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--json", str(pcap)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _srt_rows(text: str) -> dict[str, dict[str, tuple[int, float, float]]]:
    """tshark -z kbtp,srt: "Opcode" -> opcode -> (calls, min, max), and "status" ->
    "OPCODE STATUS" -> the same, from the tables of each opcode by status. Every table
    names its filter, and every row's name fits tshark's 22-column field."""
    tables: dict[str, dict[str, tuple[int, float, float]]] = {}
    current, prefix = None, ""
    for line in text.splitlines():
        if line.startswith("Filter:"):
            assert line.split(":", 1)[1].strip() in ("kbtp.opcode", "kbtp.status"), line
        elif line.startswith("Index  "):
            column = line[7:29].strip()
            current = tables.setdefault("Opcode" if column == "Opcode" else "status", {})
            prefix = "" if column == "Opcode" else column.removesuffix(" status") + " "
        elif current is not None and line[:5].strip().isdigit():
            assert line[29] == " ", f"a row name wider than its column: {line!r}"
            parts = line[30:].split()
            current[prefix + line[7:29].strip()] = (int(parts[0]), float(parts[1]), float(parts[2]))
    return tables


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pcap", [p for p in PCAPS if "session" in p.name], ids=lambda p: p.name)
def test_service_response_time_per_opcode_and_status(c_plugin, pcap, form):  # noqa: F811
    """-z kbtp,srt (the C form; the Lua form prints the same tables with -o kbtp.srt:TRUE):
    count, min and max per request opcode, and per opcode and status of the answer,
    against the pairs `kbtp decode` finds and their frame times."""
    from kbtp_scapy import tables as T
    pending, pairs = {}, []
    for m in _decoded(pcap):
        msg = T.BY_OPCODE.get(m["kbtp.opcode"])
        if msg is None:
            continue
        key = (m["conn"], m["kbtp.request_id"])
        if msg.answer:
            pending[key + (msg.answer,)] = m
        elif (req := pending.pop(key + (msg.name,), None)) is not None:
            pairs.append((T.BY_OPCODE[req["kbtp.opcode"]].name, T.STATUS.describe(m["kbtp.status"]),
                          m["time"] - req["time"]))
    assert len(pairs) > 10
    want_ops: dict[str, list[float]] = {}
    want_status: dict[str, list[float]] = {}
    for op, status, dt in pairs:
        want_ops.setdefault(op, []).append(dt)
        want_status.setdefault(f"{op} {status}", []).append(dt)
    stats = ("-z", "kbtp,srt") if form == "c" else ("-o", "kbtp.srt:TRUE")
    got = _srt_rows(run_form(form, c_plugin, pcap, "-q", *stats).stdout)
    for table, want in (("Opcode", want_ops), ("status", want_status)):
        assert set(got[table]) == set(want), table
        for name, times in want.items():
            calls, lo, hi = got[table][name]
            assert calls == len(times) and abs(lo - min(times)) < 2e-6 and abs(hi - max(times)) < 2e-6, name


def _roce_v1(frame: bytes) -> bytes:
    """The RoCEv1 frame carrying the same BTH and payload as a RoCEv2-over-IPv6 ``frame``:
    EtherType 0x8915, a GRH (the IPv6 header with Next Header 0x1B and no UDP), and the
    ICRC computed by the Scapy layers' RoCEv1 rule."""
    from kbtp_scapy.layers.roce import _roce_v1_icrc
    ip = frame[14:54]
    body = frame[62:-4]                              # BTH ... payload, pad
    grh = ip[:4] + (len(body) + 4).to_bytes(2, "big") + b"\x1b" + ip[7:]
    packet = grh + body + b"\0\0\0\0"
    return frame[:12] + b"\x89\x15" + packet[:-4] + _roce_v1_icrc(packet)


def _corrupted(tmp_path: Path) -> tuple[Path, set[int], set[int]]:
    """RoCEv2 (IPv4, IPv6) and RoCEv1 frames from the committed captures, some with one
    ICRC octet flipped and some with a field the ICRC does not cover (TTL, Hop Limit,
    the UDP checksum) changed. Returns the capture, the KBTP frames whose ICRC is wrong,
    and those changed only where the ICRC does not look."""
    from scapy.utils import rdpcap, wrpcap
    v4 = [bytes(p) for p in rdpcap(str(ROOT / "pcaps" / "roce_session.pcap"))]
    v6 = [bytes(p) for p in rdpcap(str(ROOT / "pcaps" / "roce_addr_le_ipv6_session.pcap"))]
    frames = v4[:12] + v6[:12] + [_roce_v1(f) for f in v6[:12]]
    bad, masked = set(), set()
    for i in range(len(frames)):
        f = bytearray(frames[i])
        if i % 12 in (0, 4):                             # HELLO, ALLOC_STORE: ICRC octet flipped
            f[-2] ^= 0x40
            bad.add(i + 1)
        elif i % 12 == 2:                                # HELLO_ACK: TTL / Hop Limit, UDP checksum
            ttl = 22 if f[12:14] == b"\x08\x00" else 21
            f[ttl] ^= 0x3F
            if f[12:14] != b"\x89\x15":
                udp = 14 + (20 if f[12:14] == b"\x08\x00" else 40)
                f[udp + 6:udp + 8] = b"\x12\x34"
            masked.add(i + 1)
        frames[i] = bytes(f)
    pcap = tmp_path / "icrc.pcap"
    wrpcap(str(pcap), [__import__("scapy.layers.l2", fromlist=["Ether"]).Ether(f) for f in frames])
    return pcap, bad, masked


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_a_wrong_icrc_is_an_expert_info_on_rocev2_and_rocev1(c_plugin, form, tmp_path):  # noqa: F811
    pcap, bad, masked = _corrupted(tmp_path)
    for args in ((), ("-2",)):
        out = run_form(form, c_plugin, pcap, *args, "-T", "fields", "-e", "frame.number", "-e", "kbtp.opcode",
                       "-e", "_ws.expert.message", "-E", "occurrence=a", "-E", "aggregator=|").stdout
        rows = {int(n): (op, msg) for n, op, msg in (line.split("\t") for line in out.splitlines())}
        flagged = {n for n, (_, msg) in rows.items() if "ICRC" in msg}
        assert flagged == bad, (args, flagged ^ bad)
        assert all(rows[n][0] for n in bad | masked)     # still decoded as KBTP messages
        assert all("the receiving NIC drops this packet" in rows[n][1] for n in bad)
    off = run_form(form, c_plugin, pcap, "-o", "kbtp.check_icrc:FALSE", "-Y", "kbtp.expert.icrc").stdout
    assert off == ""                                     # the preference turns the check off


def test_kbtp_decode_says_which_frames_have_a_wrong_icrc(tmp_path):
    pcap, bad, masked = _corrupted(tmp_path)
    found = {m["frame"]: m for m in _decoded(pcap)}
    assert {n for n, m in found.items() if m.get("icrc_bad")} == bad
    assert all(found[n]["icrc_bad"] == [n] for n in bad) and set(masked) <= set(found)
    text = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", str(pcap)], capture_output=True,
                          text=True, timeout=120).stdout
    lines = [line for line in text.splitlines() if "bad ICRC" in line]
    assert sorted(int(line.split()[0]) for line in lines) == sorted(bad)


#: Sanitizer reports end up on stderr with these words; tshark's own leaks at exit are
#: not the plugin's (LeakSanitizer off).
SANITIZER = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: UndefinedBehaviorSanitizer")


@pytest.fixture(scope="module")
def asan_plugin(tmp_path_factory) -> str:
    from kbtp_scapy.dissector.build import build, sanitizer_preload
    return sanitizer_preload(build(tmp_path_factory.mktemp("asan"), sanitize=True, preload=True))


@pytest.mark.slow
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("name", FUZZ)
def test_fuzz_corpus_under_address_and_undefined_behaviour_sanitizers(asan_plugin, built, name, two_pass):
    """The C plugin built with -fsanitize=address,undefined, in Debian's tshark with the
    sanitizer runtimes preloaded, over the dissector fuzz corpus (tens of thousands of
    mutated frames; KBTP_FUZZ_SCALE makes it larger): no report, no dissector bug."""
    env = dict(os.environ, LD_PRELOAD=asan_plugin, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1")
    proc = subprocess.run([TSHARK, "-n", "-r", str(built[name]), "-V", "-o", "tcp.try_heuristic_first:TRUE",
                           *(["-2"] if two_pass else [])], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [line for line in proc.stderr.splitlines() if any(s in line for s in SANITIZER)]
    assert not reports, reports[:5]
    assert "KV Cache Block Transfer Protocol" in proc.stdout
    bugs = [line for line in proc.stdout.splitlines() if "Dissector bug, protocol KBTP" in line]
    assert not bugs, bugs[:5]


@pytest.mark.slow
def test_install_global_loads_the_c_plugin_as_root(tmp_path):
    """--global: the system's plugin folders, as tshark reports them, which Wireshark 4.0
    reads as root too; the C plugin is chosen there and the command says tshark loads it.
    The folders are a tmpfs of a mount namespace of the test's own: the host's stay as they are."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a mount namespace over the system's plugin folder)")
    env = private_home(tmp_path)
    found = folders(env)
    lua_dir, c_dir = found["Global Lua Plugins"], found["Global Plugins"]
    kbtp = f"{shlex.quote(sys.executable)} -m kbtp_scapy dissector"
    script = (f"mount -t tmpfs kbtp-test {shlex.quote(lua_dir)} && mkdir -p {shlex.quote(c_dir)} && "
              f"{kbtp} install --global && {kbtp} install --global --lua && {kbtp} uninstall --global --c")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    so, lua = f"{c_dir}/epan/kbtp.so", f"{lua_dir}/kbtp.lua"
    assert proc.stdout.splitlines()[:3] == [
        "installing the C plugin: gcc and the Wireshark headers are here, so the C plugin (native speed)",
        f"installed {so}", f"tshark loads the C plugin {so}"], proc.stdout
    assert f"tshark loads the C plugin {so} (kbtp.lua is loaded too and steps aside)" in proc.stdout
    assert f"removed {so}" in proc.stdout
    assert not Path(so).exists() and not Path(lua).exists()          # the host's folders
