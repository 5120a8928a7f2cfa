"""Connection failures as `kbtp initiator` and `kbtp replay` report them: one line that names
the address that failed, a reason that is never empty, and what to do."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .kbtp_harness import deaf_roce, fresh_hosts
from .live_capture import free_port

pytestmark = pytest.mark.slow     # every test here runs for seconds

KBTP = [sys.executable, "-m", "kbtp_scapy"]
SAMPLE = Path(__file__).resolve().parent.parent / "pcaps" / "roce_session.pcap"
#: ``kbtp: <what failed>: <why>; <what to do>`` with a non-empty why
ERROR = re.compile(r"^kbtp: (?P<what>.+?): (?P<why>[^;]*\S[^;]*); (?P<todo>.+)$")


def run(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*KBTP, *args], capture_output=True, text=True, timeout=60,
                          env={"HOME": str(home), "PATH": "/usr/bin:/bin"})


def one_error(proc: subprocess.CompletedProcess, code: int) -> re.Match:
    assert proc.returncode == code, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    match = ERROR.match(proc.stderr.strip())
    assert match, proc.stderr
    return match


@pytest.fixture
def silent_iwarp():
    """A TCP listener that accepts and never says a word: no MPA Reply, no HELLO_ACK."""
    host = fresh_hosts(1)[0]
    port = free_port(host)
    with socket.create_server((host, port)):
        yield f"iwarp://{host}:{port}"


def test_a_target_that_never_answers(tmp_path, silent_iwarp):
    url = silent_iwarp
    m = one_error(run("initiator", url, "--timeout", "1", "hello", home=tmp_path), 1)
    assert m["what"] == f"cannot connect to {url}" and "1 s" in m["why"] and "--timeout" in m["todo"]
    m = one_error(run("replay", str(SAMPLE), "--target", url, "--timeout", "1", home=tmp_path), 2)
    assert m["what"] == f"cannot connect to {url}" and "1 s" in m["why"] and "--timeout" in m["todo"]


def test_a_bench_that_cannot_start(tmp_path, silent_iwarp):
    """Nobody at URL, or a listener that never says HELLO_ACK: the run could not start,
    exit 2 as conform's, fuzz's and replay's (it was 1, which bench's help keeps for a
    target that failed)."""
    host = fresh_hosts(1)[0]
    url = f"iwarp://{host}:{free_port(host)}"
    m = one_error(run("bench", url, "-n", "1", home=tmp_path), 2)
    assert m["what"] == f"cannot benchmark {url}" and m["why"].startswith("connection refused")
    m = one_error(run("bench", silent_iwarp, "--timeout", "1", "-n", "1", home=tmp_path), 2)
    assert m["what"] == f"cannot benchmark {silent_iwarp}" and "1 s" in m["why"] and "--timeout" in m["todo"]


@pytest.mark.parametrize("transport", ["roce", "iwarp"])
def test_nobody_there(tmp_path, transport):
    host, local = fresh_hosts(2)
    url = f"{transport}://{host}:{free_port(host) if transport == 'iwarp' else 4791}"
    local_args = ["--local", local] if transport == "roce" else []
    proc = run("initiator", url, *local_args, "--timeout", "1", "--json", "hello", home=tmp_path)
    m = one_error(proc, 1)
    assert m["what"] == f"cannot connect to {url}" and "listening" in m["todo"]
    assert json.loads(proc.stdout) == {"op": "HELLO", "status": None,
                                       "error": proc.stderr.strip().removeprefix("kbtp: ")}
    m = one_error(run("replay", str(SAMPLE), "--target", url, *local_args, "--timeout", "1",
                      home=tmp_path), 2)
    assert m["what"] == f"cannot connect to {url}"


@pytest.fixture
def silent_roce():
    with deaf_roce(fresh_hosts(1)[0]) as url:
        yield f"{url}:4791"


def test_nobody_at_a_roce_address_is_said_at_once(tmp_path):
    """Nothing owns UDP 4791 there: the kernel's ICMP port unreachable says so, and each tool
    ends with that reason at once, as a refused TCP connect does on iWARP. They waited out
    --timeout (here 300 s, past run's 60-s limit) and then said "no CM REP"."""
    host, local = fresh_hosts(2)
    url = f"roce://{host}:4791"
    for args, code in ((["initiator", url, "--local", local, "--timeout", "300", "hello"], 1),
                       (["replay", str(SAMPLE), "--target", url, "--local", local, "--timeout", "300"], 2),
                       (["bench", url, "--local", local, "--timeout", "300", "-n", "1"], 2)):
        m = one_error(run(*args, home=tmp_path), code)
        assert m["why"] == (f"nothing owns UDP port 4791 at {host} (ICMP port unreachable), so no "
                            "RoCEv2 target is there"), m["why"]
        assert "listening" in m["todo"]


def test_a_roce_target_that_never_answers(tmp_path, silent_roce):
    """Someone owns UDP 4791 and answers nothing: that still takes the whole --timeout."""
    m = one_error(run("initiator", silent_roce, "--timeout", "1", "hello", home=tmp_path), 1)
    assert m["what"] == f"cannot connect to {silent_roce}" and "no CM REP" in m["why"] \
        and "1 s" in m["why"] and "--timeout" in m["todo"]


def test_the_initiators_own_address_is_taken(tmp_path):
    """RoCEv2 sends from LOCAL:4791; when something holds it, that address is what failed."""
    host, local = fresh_hosts(2)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind((local, 4791))
        for args, code in ((("initiator", f"roce://{host}", "--local", local, "hello"), 1),
                           (("replay", str(SAMPLE), "--target", f"roce://{host}", "--local", local), 2)):
            m = one_error(run(*args, home=tmp_path), code)
            assert m["what"] == f"cannot send from {local} (UDP port 4791) to roce://{host}:4791"
            assert m["why"] == "address already in use" and "--local ADDR" in m["todo"]


@pytest.mark.parametrize(("args", "code", "said"), [
    (["initiator", "iwarp://::1:20408", "hello"], 2, "write an IPv6 address in brackets: iwarp://[::1]:PORT"),
    (["target", "--listen", "192.0.2.77", "--duration", "1"], 1, "192.0.2.77 is not an address of this host"),
    (["conform", "--only", "hello."], 2, "--exclude; --list shows the cases (see 'kbtp conform --help')"),
    (["decode", "--opcode", "foo", str(Path(__file__).parents[1] / "pcaps" / "roce_session.pcap")], 2,
     "'foo' is not an opcode;"),
])
def test_small_messages_say_what_to_write(tmp_path, args, code, said):
    """Messages a first afternoon meets: an unbracketed IPv6 URL, an address not of this
    host, one "see" per line, "an opcode"."""
    proc = run(*args, home=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and said in proc.stderr, proc.stderr
    assert proc.stderr.count("see ") <= 1, proc.stderr
