"""``kbtp target`` and ``kbtp initiator`` as a user runs them: separate processes, real sockets."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from kbtp_scapy.initiator import Initiator

from .kbtp_harness import fresh_hosts
from .live_capture import free_port

KBTP = [sys.executable, "-m", "kbtp_scapy"]


@pytest.fixture(params=["iwarp", "roce"])
def target(request, tmp_path):
    host, ini_host, other_host = fresh_hosts(3)
    port = free_port(host) if request.param == "iwarp" else 4791
    metrics = free_port("127.0.0.1")
    proc = subprocess.Popen([*KBTP, "target", "--transport", request.param, "--listen",
                             f"{host}:{port}", "--blocks", "32", "--block-size", "1024",
                             "--max-initiators", "2", "--metrics", str(metrics),
                             "--pcap", str(tmp_path / "target.pcap"), "--duration", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, proc.stderr.read()
    url = line.split("listening on ", 1)[1].split(":", 2)
    url = f"{request.param}://{host}:{port}"
    local = ["--local", ini_host] if request.param == "roce" else []
    yield dict(proc=proc, url=url, local=local, metrics=metrics, tmp=tmp_path, banner=line,
               transport=request.param, other_host=other_host)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def initiator(t, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [*KBTP, "initiator", t["url"], "--id-file", str(t["tmp"] / "id"), *t["local"], *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_a_session_from_the_command_line(target):
    t = target
    base = int(json.loads(initiator(t, "--json", "hello").stdout)["handle_base"])
    data = t["tmp"] / "kv.bin"
    data.write_bytes(bytes(range(256)) * 3)
    out = initiator(t, "--json", "alloc-store", hex(base), "--data-file", str(data), "--seal")
    stored = json.loads(out.stdout)
    assert (stored["status"], stored["generation"], stored["data_length"]) == ("OK", 1, 768)
    # a second run (same --id-file) finds the binding, as the reconnect rules promise
    initiator(t, "load", hex(base), "-o", str(t["tmp"] / "out.bin"))
    assert (t["tmp"] / "out.bin").read_bytes() == data.read_bytes()
    initiator(t, "alloc-store", hex(base + 2), "--text", "to stdout", "--seal")
    piped = initiator(t, "load", hex(base + 2), "-o", "-")
    assert piped.stdout == "to stdout" and piped.stderr.startswith(f"LOAD 0x{base + 2:x}: OK")
    text = initiator(t, "direct-load", hex(base)).stdout
    assert text.startswith(f"DIRECT_LOAD 0x{base:x}: OK, generation 1, 768 octets")
    failed = initiator(t, "load", hex(base + 1), ok=False)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.startswith(f"kbtp: load 0x{base + 1:x}: NOT_VALID (")
    assert len(failed.stderr.splitlines()) == 1
    assert json.loads(initiator(t, "--json", "free", hex(base)).stdout)["generation"] == 2
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{t['metrics']}/metrics", timeout=5).read().decode()
    assert 'kbtp_operations_total{opcode="ALLOC_STORE",status="OK"} 2.0' in metrics
    assert 'kbtp_operations_total{opcode="LOAD",status="NOT_VALID"} 1.0' in metrics
    assert "kbtp_ring_blocks" in metrics and "kbtp_quota_used" in metrics
    initiator(t, "goodbye", "--release")
    t["proc"].send_signal(signal.SIGINT)
    out, err = t["proc"].communicate(timeout=20)
    assert t["proc"].returncode == 0, err
    assert "ALLOC_STORE  OK" in out and "ring shared" in out       # the counters on exit
    assert "session" in err                                         # sessions logged
    assert (t["tmp"] / "target.pcap").stat().st_size > 1000


@pytest.mark.slow
def test_command_line_errors_are_one_line(target):
    t = target
    bad = subprocess.run([*KBTP, "initiator", "tcp://1.2.3.4", "hello"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    missing = initiator(t, "alloc-store", "0x4000", ok=False)
    assert missing.returncode == 2 and "exactly one of" in missing.stderr
    wrong = subprocess.run([*KBTP, "target", "--blocks", "4", "--max-initiators", "8"],
                           capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "quota" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_failed_requests_say_why_and_what_to_do(target):
    t = target
    hello = initiator(t, "hello").stdout
    shown = dict(line.split(": ", 1) for line in hello.strip().splitlines())
    shown = {k.strip(): v for k, v in shown.items()}
    for key, value in shown.items():       # handles, STags and offsets in hex; counts in decimal
        hexed = key.endswith(("stag", "offset", "handle", "handle_base", "reserved"))
        assert value.startswith("0x") == hexed, (key, value)
    base = int(shown["handle_base"], 16)
    too_big = t["tmp"] / "big.bin"
    too_big.write_bytes(bytes(1025))                           # the fixture's Block Size is 1024
    failed = initiator(t, "--json", "alloc-store", hex(base), "--data-file", str(too_big), ok=False)
    assert failed.returncode == 1
    record = json.loads(failed.stdout)                         # --json: the failure as JSON too
    assert (record["op"], record["handle"], record["status"]) == ("ALLOC_STORE", base, "TOO_LARGE")
    assert "1025 octets" in record["error"] and "1024" in record["error"]
    assert failed.stderr.strip() == f"kbtp: {record['error']}"
    initiator(t, "alloc-store", hex(base), "--text", "unsealed")
    unsealed = initiator(t, "load", hex(base), ok=False)
    assert "NOT_SEALED" in unsealed.stderr and "--seal" in unsealed.stderr
    assert "--allow-unsealed" in unsealed.stderr
    assert initiator(t, "load", hex(base), "--allow-unsealed").returncode == 0
    outside = initiator(t, "--json", "free", hex(base + 10_000), ok=False)
    assert json.loads(outside.stdout)["status"] == "INVALID_HANDLE"
    assert f"{base:#x} to" in outside.stderr


def test_record_needs_record_completion(target):
    t = target
    if t["transport"] == "iwarp":
        refused = initiator(t, "load", "0x4000", "--record", ok=False)
        assert refused.returncode == 2 and "RECORD_COMPLETION" in refused.stderr
        assert "RECORD_COMPLETION" not in t["banner"].split("features ", 1)[1].split(" (")[0]
        assert "RECORD_COMPLETION not offered over iWARP" in t["banner"]
        return
    assert "features DIRECT_LOAD,DIRECT_ALLOC,RECORD_COMPLETION" in t["banner"]
    refused = initiator(t, "--features", "DIRECT_LOAD", "--json", "free", "0x4000", "--record", ok=False)
    assert refused.returncode == 1 and json.loads(refused.stdout)["status"] is None
    assert "did not grant RECORD_COMPLETION" in refused.stderr and "--features" in refused.stderr


def test_a_second_session_with_the_same_id_is_told_about_id_file(target):
    """Two runs at once with one --id-file: the second's HELLO gets ALREADY_BOUND."""
    t = target
    initiator(t, "hello")                                    # creates the ID file
    ident = bytes.fromhex((t["tmp"] / "id").read_text())

    async def second_while_first_is_up() -> tuple[int, bytes, bytes]:
        first = await Initiator.connect(t["url"], initiator_id=ident,
                                        **({"local": t["other_host"]} if t["local"] else {}))
        try:
            proc = await asyncio.create_subprocess_exec(
                *KBTP, "initiator", t["url"], "--id-file", str(t["tmp"] / "id"), *t["local"],
                "--json", "hello", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            await first.goodbye()
        return proc.returncode, out, err

    code, out, err = asyncio.run(second_while_first_is_up())
    assert code == 1 and json.loads(out)["status"] == "ALREADY_BOUND"
    assert "--id-file" in err.decode() and str(t["tmp"] / "id") in err.decode()


@pytest.mark.slow
def test_replay_json_file_keeps_the_text_on_stdout(target):
    t = target
    cap = t["tmp"] / "session.pcap"
    initiator(t, "--pcap", str(cap), "goodbye", "--release")    # a session that leaves nothing
    report = t["tmp"] / "report.json"
    run = [*KBTP, "replay", str(cap), "--target", t["url"], *t["local"], "-q"]
    text = subprocess.run([*run, "--json-file", str(report)], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[-1].startswith("MATCH") and text.stderr == ""
    assert json.loads(report.read_text())["target"] == t["url"]
    dash = subprocess.run([*run, "--json-file", "-"], capture_output=True, text=True, timeout=60)
    assert dash.returncode == 0 and json.loads(dash.stdout)["target"] == t["url"]


def test_metrics_on_an_address_of_its_own():
    """--metrics HOST:PORT serves where a Prometheus on another host can reach it (there,
    and not on 127.0.0.1); the banner names the address. A bad value is one line, exit 2."""
    host, metrics_host = fresh_hosts(2)
    port = free_port(metrics_host)
    proc = subprocess.Popen([*KBTP, "target", "--transport", "iwarp", "--listen", f"{host}:0",
                             "--metrics", f"{metrics_host}:{port}", "--duration", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert f"metrics on http://{metrics_host}:{port}/metrics" in banner, proc.stderr.read()
        page = urllib.request.urlopen(f"http://{metrics_host}:{port}/metrics", timeout=5).read().decode()
        assert "kbtp_ring_blocks" in page
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    bad = subprocess.run([*KBTP, "target", "--metrics", "somewhere:port"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
