"""Sharp edges of the command line (issue 21): each one line naming what failed, never a
traceback, against real files, real processes and a real target on loopback."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from xml.etree import ElementTree

import pytest

from kbtp_scapy.target import TargetConfig

from .kbtp_harness import TargetThread, fresh_hosts
from .stops import STOPS, stop

KBTP = [sys.executable, "-m", "kbtp_scapy"]
#: ``kbtp: <what failed>: <why>; <what to do>`` with a non-empty why
ERROR = re.compile(r"^kbtp: (?P<what>.+?): (?P<why>[^;]*\S[^;]*); (?P<todo>.+)$")


def run(*args: str, home: Path, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*KBTP, *args], capture_output=True, text=True, timeout=timeout,
                          env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, **kw)


def one_error(proc: subprocess.CompletedProcess, code: int = 1) -> re.Match:
    assert proc.returncode == code, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    match = ERROR.match(proc.stderr.strip())
    assert match, proc.stderr
    return match


@pytest.fixture(scope="module")
def roce_target():
    # addresses of this module's own (127.45.R.*, R at random): other test runs on the
    # host count fresh_hosts() from the same start
    net = f"127.45.{secrets.randbelow(250) + 1}"
    t = TargetThread("roce", TargetConfig(blocks=64, block_size=256, max_initiators=16),
                     hosts=[f"{net}.{i}" for i in range(1, 9)])
    yield t
    t.stop()


def test_id_file_that_is_a_folder(tmp_path):
    m = one_error(run("initiator", "roce://127.0.0.1", "--id-file", str(tmp_path), "hello", home=tmp_path), 1)
    assert m["what"] == f"cannot keep the Initiator ID in {tmp_path} (--id-file)"
    assert m["why"] == "is a directory" and "not of a folder" in m["todo"]


def test_id_file_without_an_id(tmp_path):
    bad = tmp_path / "id"
    bad.write_text("not hex\n")
    proc = run("initiator", "roce://127.0.0.1", "--id-file", str(bad), "hello", home=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{bad} does not hold an Initiator ID" in proc.stderr


def test_target_pool_that_does_not_fit(tmp_path):
    """F x S beyond any machine's memory: the pool is named, and what to change."""
    m = one_error(run("target", "-F", "100000000", "-S", "1048576", "--duration", "1", home=tmp_path))
    assert m["what"].startswith("the pool of 100000000 blocks x 1048576 octets")
    assert m["why"].startswith("does not fit in memory") and "--blocks" in m["todo"]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_hello_into_a_closed_pipe(tmp_path, roce_target, json_flag):
    """``| head -2`` once head has gone: no "broken pipe", nothing on stderr. The pipe's
    reading end is closed before the run, so every write meets it (no race with head)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*KBTP, "initiator", roce_target.url, "--id-file", str(tmp_path / "id"),
                               "--local", roce_target.initiator_hosts[1], *json_flag, "hello"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                              env={"HOME": str(tmp_path)})
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 0, proc.stderr


def test_unknown_operation_after_options_is_blamed(tmp_path):
    proc = run("initiator", "roce://127.0.0.1", "--id-file", str(tmp_path / "id"), "--timeout", "3",
               "sendx", home=tmp_path)
    assert proc.returncode == 2 and "No such command 'sendx'" in proc.stderr, proc.stderr


def test_roce_source_taken_picks_a_free_one(tmp_path, roce_target, monkeypatch, caplog, capsys):
    """D16/D17: the default RoCEv2 source's UDP 4791 held by another program: kbtp initiator
    sends from a free loopback address and says which, instead of "Errno 98"."""
    from kbtp_scapy.cli import main
    from kbtp_scapy.rnic import roce
    held = roce_target.initiator_hosts[2]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other_program:
        other_program.bind((held, 4791))
        monkeypatch.setattr(roce, "default_local", lambda host: held)
        monkeypatch.setattr(roce, "_noted", set())
        code = main(["initiator", roce_target.url, "--id-file", str(tmp_path / "id"), "--json", "hello"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["op"] == "HELLO"
    note = next(r.getMessage() for r in caplog.records if r.name == "kbtp_scapy.rnic.roce")
    chosen = re.fullmatch(rf"note: {re.escape(held)} UDP port 4791 is taken; sending from (\S+) "
                          r"instead \(choose one with --local ADDR\)", note)
    assert chosen and ipaddress.ip_address(chosen[1]).is_loopback and chosen[1] != held


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="drops CAP_NET_RAW from root's bounding set with setpriv")
@pytest.mark.parametrize("role", ["target", "initiator"])
def test_raw_io_without_cap_net_raw_names_it(tmp_path, role):
    """D14: not a bare "Operation not permitted" but the capability and how to get it."""
    args = (["target", "--io", "raw", "--iface", "lo", "--addr", "10.99.0.1", "--duration", "1"]
            if role == "target" else
            ["initiator", "roce://10.99.0.1", "--io", "raw", "--iface", "lo", "--addr", "10.99.0.2",
             "--id-file", str(tmp_path / "id"), "hello"])
    proc = subprocess.run(["setpriv", "--bounding-set=-net_raw", *KBTP, *args], capture_output=True,
                          text=True, timeout=60, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    m = one_error(proc)
    assert "roce://10.99.0.1:4791" in m["what"]
    assert m["why"] == "a raw (AF_PACKET) socket needs the capability CAP_NET_RAW"
    assert "setcap cap_net_raw+ep" in m["todo"]


def test_one_octet_in_words(tmp_path, roce_target):
    """D22: "1 octet", not "1 octets"."""
    base = ["initiator", roce_target.url, "--id-file", str(tmp_path / "id"), "--local",
            roce_target.initiator_hosts[3]]
    handle = json.loads(run(*base, "--json", "hello", home=tmp_path).stdout)["handle_base"]
    proc = run(*base, "alloc-store", hex(handle), "--text", "k", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ", 1 octet at block offset" in proc.stdout, proc.stdout


def test_counters_table_keeps_its_columns_with_unknown_opcodes(roce_target):
    """D22: "Unknown (0x7e) MALFORMED" is wider than any opcode name; the columns widen."""
    import asyncio

    from kbtp_scapy import codec
    from kbtp_scapy.initiator import Initiator

    async def unknown_opcode() -> None:
        ini = await Initiator.connect(roce_target.url, **roce_target.connect_options(4))
        await ini.raw(codec.encode({"opcode": 0x7E, "request_id": 9}))
        await ini.goodbye()
    asyncio.run(unknown_opcode())
    rows = [r for r in roce_target.run(roce_target.target.metrics.table).splitlines()
            if not r.startswith(("connections", "liveness", "ring", "initiator"))
            and "KBTP Python per request" not in r]      # the per-opcode execution counts
    assert any(r.startswith("Unknown (0x7e)") for r in rows), rows
    at = rows[0].index("status")
    assert len({len(r) for r in rows}) == 1, rows
    assert all(r[at - 1] == " " and r[at] != " " for r in rows), rows


@pytest.mark.slow
def test_fuzz_with_nothing_listening_says_one_line(tmp_path):
    """D18: no empty tables, no error twice: one line, exit 2."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]        # closed again: nothing listens there
    proc = run("fuzz", "--target", f"iwarp://127.0.0.1:{port}", "--cases", "3", "--timeout", "2",
               "--out", str(tmp_path / "findings"), home=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.splitlines()) == 1 and "listening" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("done", "total", "elapsed", "limit", "shown"), [
    (10, 100, 2.0, None, ", 5.0 cases/s, ETA 0:18"),
    (10, 100_000, 1.0, None, ", 10.0 cases/s, ETA 2:46:39"),
    (10, 100_000, 1.0, 61.0, ", 10.0 cases/s, ETA 1:00"),
    (0, 100, 1.0, None, ""),
])
def test_fuzz_progress_has_rate_and_eta(done, total, elapsed, limit, shown):
    from kbtp_scapy.cli.fuzz import _pace
    assert _pace(done, total, elapsed, limit) == shown


@pytest.mark.slow
def test_craft_names_the_version_field_kbtp_version(tmp_path):
    """D22: the header's Version is --kbtp-version; --version is not a field option."""
    from kbtp_scapy import codec
    proc = run("craft", "FREE", "--kbtp-version", "2", "--handle", "7", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(codec.Malformed) as bad:
        codec.decode(bytes.fromhex(proc.stdout.strip()))
    assert str(bad.value) == "version 2 is not 1" and bad.value.fields["handle"] == 7
    proc = run("craft", "FREE", "--version", "2", home=tmp_path)
    assert proc.returncode == 2 and "--kbtp-version" in proc.stderr


@pytest.mark.slow
def test_replay_of_a_capture_just_made_matches(tmp_path, roce_target):
    """D10: a capture whose entry had been used before (Generation 3) replays to MATCH on a
    fresh range (Generation 1); --strict compares Generations as captured and differs."""
    base = ["initiator", roce_target.url, "--id-file", str(tmp_path / "id"), "--local",
            roce_target.initiator_hosts[4]]
    handle = hex(json.loads(run(*base, "--json", "hello", home=tmp_path).stdout)["handle_base"])
    for args in (["alloc-store", handle, "--text", "old"], ["free", handle]):
        assert run(*base, *args, home=tmp_path).returncode == 0
    pcap = tmp_path / "session.pcap"
    made = run(*base, "--pcap", str(pcap), "--json", "alloc-store", handle, "--text", "hi", "--seal",
               home=tmp_path)
    assert json.loads(made.stdout)["generation"] == 3
    replay = ["replay", str(pcap), "--target", roce_target.url, "--local", roce_target.initiator_hosts[5]]
    proc = run(*replay, home=tmp_path)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith("MATCH"), proc.stdout
    proc = run(*replay, "--strict", home=tmp_path)
    assert proc.returncode == 1 and "generation: captured 3, replayed 1" in proc.stdout, proc.stdout


def test_generations_that_move_differently_still_differ():
    """The offset is learnt once per session and handle: a second step off by one differs."""
    from types import SimpleNamespace as NS

    from kbtp_scapy.replay.compare import Generations
    g = Generations()
    step = lambda handle: NS(step=NS(handle=handle), session=NS(index=0))
    assert g.as_captured(step(0x10), 3, 1) == 3          # learnt: replay is 2 behind
    assert g.as_captured(step(0x10), 4, 2) == 4          # moved as captured
    assert g.as_captured(step(0x10), 5, 4) == 6          # bumped once too often: differs
    assert g.as_captured(step(0x11), 7, 7) == 7          # another handle, its own offset
    assert g.as_captured(step(0x10), 5, 0) != 5          # 0 after a bind: an entry never shows it again
    assert g.as_captured(step(0x12), 0, 372) == 0        # never bound (NOT_VALID): sets the offset
    assert g.as_captured(step(0x12), 1, 373) == 1        # then bound
    assert g.as_captured(step(0x13), 65535, 5) == 65535
    assert g.as_captured(step(0x13), 1, 6) == 1          # 65535 steps to 1, skipping 0


def test_replay_knows_a_liveness_probe():
    """D20: the rxe capture's zero-length RDMA Write to STag 0 (frame 94, as tshark shows it)
    is a liveness probe, not a Write that "no pending LOAD names"."""
    from kbtp_scapy.replay import sessions
    pcap = Path(__file__).resolve().parent.parent / "pcaps" / "rxe_kernel_session.pcap"
    probes = subprocess.run(["tshark", "-r", str(pcap), "-Y", "infiniband.reth.dmalen == 0",
                             "-T", "fields", "-e", "frame.number", "-e", "infiniband.reth.r_key"],
                            capture_output=True, text=True, timeout=60).stdout.split()
    assert probes == ["94", "0x00000000"]
    capture = sessions.load(str(pcap))
    notes = capture.notes + [n for s in capture.sessions for n in s.notes]
    assert not [n for n in notes if "frame 94" in n], notes


def _interrupt_after(proc: subprocess.Popen, lines: int, sigs: tuple[int, ...] = (signal.SIGINT,)) -> tuple[str, str]:
    """Read ``lines`` lines of stdout, then Ctrl-C (SIGINT) as a terminal or SIGTERM as a CI
    timeout would; the rest of stdout and stderr."""
    got = [proc.stdout.readline() for _ in range(lines)]
    assert all(got), got
    stop(proc, sigs)
    out, err = proc.communicate(timeout=60)
    return "".join(got) + out, err


@STOPS
def test_decode_interrupted_says_so_and_exits_130(tmp_path, sigs, code, name):
    """D11: Ctrl-C (or SIGTERM) while decode waits for more of a live capture on stdin."""
    pcap = (Path(__file__).resolve().parent.parent / "pcaps" / "roce_session.pcap").read_bytes()
    proc = subprocess.Popen([*KBTP, "decode", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=False, env={"HOME": str(tmp_path)})
    proc.stdin.write(pcap)                  # and the pipe stays open: more may come
    proc.stdin.flush()
    first = proc.stdout.readline()
    assert b"HELLO" in first, first
    stop(proc, sigs)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    text = err.decode()
    assert "KBTP message" in text and f"interrupted ({name})" in text and "Traceback" not in text, text


@pytest.mark.slow
@STOPS
def test_conform_interrupted_writes_the_partial_reports(tmp_path, sigs, code, name):
    """D12: Ctrl-C after the first verdicts: exit 130, said by the JSON too; JUnit and JSON
    with the cases judged, JUnit's counts those of its testcases; a result line that says
    how far the run got; --rerun-failed of the report runs the cases it did not reach."""
    t = TargetThread("roce", hosts=[f"127.45.{secrets.randbelow(250) + 1}.{i}" for i in (20, 21)])
    try:
        junit, report = tmp_path / "conform.xml", tmp_path / "conform.json"
        proc = subprocess.Popen([*KBTP, "conform", "--target", t.url, "--local", t.initiator_hosts[0],
                                 "--junit", str(junit), "--json-file", str(report)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={"HOME": str(tmp_path)})
        out, err = _interrupt_after(proc, 4, sigs)    # the header and a few verdicts
    finally:
        t.stop()
    assert proc.returncode == code, err
    assert f"interrupted ({name})" in err and "Traceback" not in err, err
    doc = json.loads(report.read_text())
    judged = [c["id"] for c in doc["cases"]]
    assert judged and doc["error"].startswith("interrupted") and doc["exit_code"] == code
    suite = ElementTree.parse(junit).getroot()
    names = [tc.get("name") for tc in suite.iter("testcase")]
    assert names[:-1] == judged and names[-1] == "harness", names
    assert int(suite.get("tests")) == len(names)
    assert int(suite.get("errors")) == len(suite.findall("testcase/error"))
    total = len(doc["selected"])
    assert f"result: interrupted ({name}) after {len(judged)} of {total} cases: " in out, out
    listed = run("conform", "--list", "--rerun-failed", str(report), home=tmp_path)
    again = [line.split()[0] for line in listed.stdout.splitlines() if not line.startswith(" ")]
    stood = {c["id"] for c in doc["cases"] if c["verdict"] in ("PASS", "SKIP")}   # the target's SKIPs
    assert again and set(again) == set(doc["selected"]) - stood, listed.stderr


def test_local_on_iwarp_is_a_usage_error_not_a_traceback():
    """Over iWARP the kernel's TCP picks the source: --local gets one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "initiator", "iwarp://127.0.0.1:9",
                           "--local", "127.0.0.2", "hello"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--local is for RoCEv2" in proc.stderr


def test_host_names_are_resolved_and_said(tmp_path):
    """``iwarp://localhost:PORT`` (perftest and rping take names): the name is resolved, the
    command says which address it used, and the session runs (it was "'localhost' is not
    an IP address"); a name that resolves to nothing is one line, exit 2."""
    wanted = socket.getaddrinfo("localhost", None, socket.AF_INET)[0][4][0]
    t = TargetThread("iwarp", TargetConfig(blocks=64, max_initiators=4),
                     hosts=[wanted, *fresh_hosts(2)], port=0)
    try:
        url = f"iwarp://localhost:{t.address.port}"
        hello = run("initiator", url, "--json", "hello", home=tmp_path)
        bench = run("bench", url, "-n", "20", "--json", home=tmp_path)
        replay = run("replay", str(Path(__file__).parents[1] / "pcaps" / "rxe_kernel_session.pcap"),
                     "--target", url, "--json", home=tmp_path)
    finally:
        t.stop()
    for proc in (hello, bench, replay):
        assert proc.returncode == 0, proc.stderr
        assert f"kbtp: localhost is {wanted}" in proc.stderr.splitlines()
    for report in (bench, replay):      # the reports name the address used
        assert json.loads(report.stdout)["target"] == f"iwarp://{wanted}:{t.address.port}"
    bad = run("initiator", "iwarp://no-such-host.invalid:5420", "hello", home=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
    assert "cannot resolve 'no-such-host.invalid'" in bad.stderr


@pytest.mark.parametrize("cut", [False, True])
def test_analyze_of_a_capture_without_kbtp_has_nothing_to_judge(tmp_path, cut):
    """A capture of the wrong interface (HTTP, DNS) or one cut by its snap length is not
    clean: nothing was judged, and --fail-on-hazard fails."""
    if cut:
        capture = tmp_path / "cut.pcap"
        subprocess.run(["editcap", "-s", "60", "pcaps/iwarp_session.pcap", str(capture)], check=True)
    else:
        from scapy.all import IP, TCP, UDP, Ether, Raw, wrpcap
        capture = tmp_path / "http.pcap"
        wrpcap(str(capture), [Ether() / IP(dst="127.0.0.1") / TCP(dport=80) / Raw(b"GET / HTTP/1.0\r\n\r\n"),
                              Ether() / IP(dst="127.0.0.1") / UDP(dport=53) / Raw(b"\0" * 12),
                              Ether() / IP(dst="127.0.0.1") / TCP(sport=80) / Raw(b"HTTP/1.0 200 OK\r\n")])
    proc = run("analyze", "--fail-on-hazard", str(capture), home=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "no hazard found" not in proc.stdout
    assert re.search(r"no KBTP message in [\d,]+ frames", proc.stderr), proc.stderr
    assert ("cut short by the capture's snap length" in proc.stderr) == cut, proc.stderr
    assert "nothing to judge" in proc.stderr.splitlines()[-1], proc.stderr


def test_a_tcp_listener_that_is_not_an_iwarp_target_is_named(tmp_path):
    """An HTTP server on the port answers the MPA Request with ``HTTP/1.0 400`` and closes:
    initiator, conform and fuzz say the peer is not an iWARP target, not "closed by the peer"."""
    server = socket.create_server((fresh_hosts(1)[0], 0))
    host, port = server.getsockname()[:2]

    def answer() -> None:
        for _ in range(3):
            conn, _ = server.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"HTTP/1.0 400 Bad request\r\nContent-Length: 0\r\n\r\n")
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    url = f"iwarp://{host}:{port}"
    try:
        procs = [run("initiator", url, "hello", home=tmp_path),
                 run("conform", "--target", url, "--only", "ops.load.canaries", home=tmp_path),
                 run("fuzz", "--target", url, "--cases", "1", "--out", str(tmp_path / "f"), home=tmp_path)]
    finally:
        server.close()
    for proc in procs:
        assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
        assert ("the peer answered with something that is not an MPA Reply (it starts with "
                "'HTTP/1.0 400 Bad'): not an iWARP target; give the address and port of a KBTP "
                "target") in proc.stderr, proc.stderr
        assert "harness error" not in proc.stderr and "--timeout" not in proc.stderr, proc.stderr


def test_bench_q_past_the_targets_initiators_names_the_session_refused(tmp_path):
    """-q 8 against a target admitting 4: which session was refused, and what to do."""
    t = TargetThread("iwarp", TargetConfig(blocks=64, max_initiators=4), hosts=fresh_hosts(2), port=0)
    try:
        proc = run("bench", t.url, "-q", "8", "-n", "10", home=tmp_path)
    finally:
        t.stop()
    match = one_error(proc, 1)
    assert match["why"] == "session 5 of 8: HELLO refused NO_SPACE", proc.stderr
    assert match["todo"] == "fewer -q, or a larger --max-initiators on the target", proc.stderr
