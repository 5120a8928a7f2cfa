"""``kbtp target`` and ``kbtp initiator`` as a user runs them: separate processes, real sockets."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from .kbtp_harness import fresh_hosts
from .live_capture import free_port

KBTP = [sys.executable, "-m", "kbtp_scapy"]


@pytest.fixture(params=["iwarp", "roce"])
def target(request, tmp_path):
    host, ini_host = fresh_hosts(2)
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
    yield dict(proc=proc, url=url, local=local, metrics=metrics, tmp=tmp_path)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def initiator(t, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [*KBTP, "initiator", t["url"], "--id-file", str(t["tmp"] / "id"), *t["local"], *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


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
    assert failed.returncode == 1
    assert failed.stderr.strip() == "kbtp: load: NOT_VALID"
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
