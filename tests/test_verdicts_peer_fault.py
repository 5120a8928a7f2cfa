"""A peer's misbehaviour is a verdict, never the checker's failure (issue 31).

A target that breaks a rule in a step that only prepares a case (here: it does not post a
receive buffer again after a failed request, so a request within the credits finds none)
FAILs that case naming the rule, where it used to be an ERROR ("set-up step failed") and
exit 2. A ``kbtp target`` process SIGKILLed in the middle of a run: ``kbtp conform`` FAILs
the case where it went and says in one line how many could not run (exit 1, never "please
report it"); ``kbtp fuzz`` saves a finding with the last cases' capture and prints its
summary (exit 1, never "harness error").
"""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time

import pytest

from kbtp_scapy.cli import main

from .hostile import TargetProc
from .planted_bugs import Bug, plant_failure_buffer_not_reposted, start

KBTP = [sys.executable, "-m", "kbtp_scapy"]
#: what each binding shows of the request that finds no buffer: iWARP Terminates it, RoCEv2
#: answers it with RNR NAKs, which the initiator's RNIC retries (the COMPLETION never comes)
SEEN = {"iwarp": "no buffer available", "roce": "RNR NAK(s): the request found no receive buffer"}
_hosts = itertools.count(1)


def fresh_hosts(count: int) -> list[str]:
    """Loopback addresses of this file's own, 127.31.x.y: RoCEv2's port 4791 free on each."""
    return [f"127.31.{n // 250}.{n % 250 + 1}" for n in itertools.islice(_hosts, count)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_a_missing_receive_buffer_in_a_set_up_step_fails_naming_the_rule(transport, monkeypatch, tmp_path):
    """Two credits: the TOO_LARGE answers of ops.store.too_large use both buffers up, and
    the ALLOC_STORE that prepares the case's next check finds none."""
    t = start(transport, fresh_hosts(2), Bug("failure_buffer_not_reposted", "", "",
                                             plant_failure_buffer_not_reposted,
                                             config={"request_credits": 2}))
    out = tmp_path / "r.json"
    try:
        plant_failure_buffer_not_reposted(t, monkeypatch)
        code = main(["conform", "--target", t.url, "--timeout", "2", "-q", "--json-file", str(out),
                     "--only", "ops.store.too_large", "--only", "ops.free.",
                     *(["--local", t.initiator_hosts[0]] if transport == "roce" else [])])
    finally:
        t.stop()
    doc = json.loads(out.read_text())
    verdicts = {c["id"]: c for c in doc["cases"]}
    too_large = verdicts["ops.store.too_large"]
    assert code == 1 and doc["exit_code"] == 1 and doc["summary"]["ERROR"] == 0, doc["summary"]
    assert too_large["verdict"] == "FAIL" and too_large["broke"] == "session.credits.request", too_large
    assert "set-up step ALLOC_STORE to 0x" in too_large["detail"] and SEEN[transport] in too_large["seen"]


@pytest.mark.slow
@pytest.mark.parametrize("status,rule,seen", [
    ("NO_SPACE", "session.quota.sum", "NO_SPACE with 0 of the quota of "),
    ("INTERNAL", "ops.no_side_effect", "INTERNAL"),
])
def test_an_unexpected_status_in_a_set_up_step_fails_naming_the_rule(status, rule, seen, tmp_path):
    """An ALLOC_STORE of a fresh handle of the session's own range, well within its quota,
    refused: NO_SPACE breaks the quota's promise, another status names no failed check."""
    from kbtp_scapy.target.operations import Failed

    from .planted_bugs import set_handler
    t = start("iwarp", fresh_hosts(2))
    out = tmp_path / "r.json"
    try:
        async def refuse(self, conn, req, fetch=None):
            raise Failed(status)
        set_handler(t, "ALLOC_STORE", lambda original: refuse)
        code = main(["conform", "--target", t.url, "--timeout", "5", "-q", "--json-file", str(out),
                     "--only", "ops.store.sealed"])
    finally:
        t.stop()
    [sealed] = json.loads(out.read_text())["cases"]
    assert code == 1 and sealed["verdict"] == "FAIL" and sealed["broke"] == rule, sealed
    assert sealed["seen"].startswith(seen) and "ALLOC_STORE to 0x" in sealed["detail"]


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def _kill_when_busy(target: TargetProc, proc: subprocess.Popen, operations: int) -> None:
    """SIGKILL the target once it completed ``operations`` requests (its own count), so the
    run is well under way however loaded the machine is."""
    deadline = time.monotonic() + 120
    while _sum(target.metrics(), "kbtp_operations") < operations:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.1)
    target.proc.kill()
    target.proc.wait()


def _target(transport: str) -> tuple[TargetProc, list[str]]:
    host, initiator = fresh_hosts(2)
    target = TargetProc(transport, host, "--blocks", "256", "--max-initiators", "8",
                        "--ticket-timeout", "300")
    return target, ["--local", initiator] if transport == "roce" else []


def _killed_under(target, served: int, *args: str) -> tuple[subprocess.Popen, str, str]:
    """Run ``kbtp ARGS`` against ``target`` and SIGKILL the target once it has served
    ``served`` operations; the finished process and its output."""
    proc = subprocess.Popen([*KBTP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _kill_when_busy(target, proc, served)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        target.stop()
    return proc, stdout, stderr


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_conform_against_a_target_that_dies(transport, tmp_path):
    target, local = _target(transport)
    out = tmp_path / "r.json"
    proc, stdout, stderr = _killed_under(target, 100, "conform", "--target", target.url, *local, "--quick",
                                         "--timeout", "2", "--json-file", str(out))
    assert proc.returncode == 1, stderr
    assert "please report" not in stdout + stderr and "Traceback" not in stderr
    [line] = [x for x in stdout.splitlines() if "could not run" in x]
    where = re.fullmatch(r"(\d+) cases? could not run: the target went away at case (\S+)", line)
    assert where, line
    doc = json.loads(out.read_text())
    [at] = [c for c in doc["cases"] if c["id"] == where[2]]
    assert at["verdict"] == "FAIL" and "the target went away / stopped answering" in at["seen"], at
    not_run = [c for c in doc["cases"] if c["detail"] == f"not run: the target went away at {where[2]}"]
    assert len(not_run) == int(where[1]) > 0 and {c["verdict"] for c in not_run} == {"SKIP"}
    assert doc["gone_at"] == where[2] and doc["summary"]["ERROR"] == 0 and doc["exit_code"] == 1
    assert "result: " in stdout and f"could not run: the target went away at case {where[2]}" in stderr
    _rerun_runs_what_could_not_run(transport, out, where[2], [c["id"] for c in not_run])


def _rerun_runs_what_could_not_run(transport: str, report, gone_at: str, not_run: list[str]) -> None:
    """--rerun-failed of a run cut short by its target: the case where it went and every
    case it could not run (it reran the one FAIL, and CI went green on the rest)."""
    listed = subprocess.run([*KBTP, "conform", "--list", "--rerun-failed", str(report)], capture_output=True,
                            text=True, timeout=60).stdout
    assert [line.split()[0] for line in listed.splitlines() if not line.startswith(" ")] == [gone_at, *not_run]
    target, local = _target(transport)           # restarted: a few of them run, and pass
    few = [gone_at, *not_run[:2]]
    try:
        again = subprocess.run([*KBTP, "conform", "--target", target.url, *local, "--rerun-failed", str(report),
                                "--json", *(f"--only={i}" for i in few)], capture_output=True, text=True, timeout=300)
    finally:
        target.stop()
    assert again.returncode == 0, again.stderr
    ran = [c["id"] for c in json.loads(again.stdout)["cases"]]
    assert ran == [i for i in [gone_at, *not_run] if i.startswith(tuple(few))]      # --only: prefixes


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_fuzz_against_a_target_that_dies(transport, tmp_path):
    target, local = _target(transport)
    found, summary = tmp_path / "found", tmp_path / "s.json"
    proc, stdout, stderr = _killed_under(target, 300, "fuzz", "--target", target.url, *local, "--cases", "100000",
                                         "-q", "--timeout", "2", "--out", str(found), "--json-file", str(summary))
    assert proc.returncode == 1, stderr
    assert "harness error" not in stdout + stderr and "Traceback" not in stderr
    doc = json.loads(summary.read_text())
    assert doc["error"] is None and doc["gone_at"] and doc["cases"] > 0
    [finding] = [f for f in doc["findings"] if f["case"] == doc["gone_at"]]
    assert "gone" in {f["kind"] for f in finding["findings"]}
    assert doc["gone_at"] in finding["cases_in_pcap"] and finding["replay"].endswith(doc["gone_at"])
    pcap = found / f"{doc['gone_at']}.pcap"
    assert finding["pcap"] == str(pcap) and pcap.stat().st_size > 1000     # frames, not a bare header
    assert (found / f"{doc['gone_at']}.json").exists()
    assert stdout.startswith(f"kbtp fuzz {target.url}") and f"the target went away at case {doc['gone_at']}" in stderr
