"""``kbtp fuzz --restart-cmd``: a target SIGKILLed mid-run (a real ``kbtp target`` process on
loopback) is started again by the user's command and the run goes on with the next case;
the restarted one, ended by its own --duration, does not come back (the command fails the
second time) and the run ends as without the option: the summary, exit 1."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time

import pytest

from .hostile import KBTP, TargetProc
from .kbtp_harness import fresh_hosts

TARGET_ARGS = ["--blocks", "256", "--max-initiators", "8", "--ticket-timeout", "300"]


def _operations(target: TargetProc) -> float:
    return sum(v for k, v in target.metrics().items() if k.startswith("kbtp_operations"))


def _script(path, target: TargetProc, pids) -> None:
    """Starts a target on the same address the first time (its own process: its pid kept),
    fails the second time, so the test ends by itself."""
    host, port = target.url.split("://")[1].rsplit(":", 1)
    cmd = shlex.join([*KBTP, "target", "--transport", "iwarp", "--listen", f"{host}:{port}",
                      *TARGET_ARGS, "--duration", "40"])
    path.write_text(f"#!/bin/sh\n[ -s {pids} ] && exit 3\necho $$ > {pids}\nexec {cmd}\n")
    path.chmod(0o755)


@pytest.mark.slow
def test_a_killed_target_is_restarted_and_the_run_goes_on(tmp_path):
    [host] = fresh_hosts(1)
    target = TargetProc("iwarp", host, *TARGET_ARGS)
    pids, script = tmp_path / "pids", tmp_path / "restart.sh"
    _script(script, target, pids)
    found, summary = tmp_path / "found", tmp_path / "s.json"
    proc = subprocess.Popen([*KBTP, "fuzz", "--target", target.url, "--cases", "100000", "-q",
                             "--timeout", "2", "--out", str(found), "--json-file", str(summary),
                             "--restart-cmd", str(script), "--restart-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _operations(target) < 300:          # well under way, however loaded the machine
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
            time.sleep(0.1)
        target.proc.kill()
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        target.stop()
        if pids.exists() and pids.read_text().strip():
            try:
                os.kill(int(pids.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "harness error" not in stdout + stderr
    doc = json.loads(summary.read_text())
    assert doc["restarts"] == 1 and doc["error"] is None, doc["stopped"]
    gone = [f for f in doc["findings"] if "gone" in {k["kind"] for k in f["findings"]}]
    assert len(gone) == 2, [f["case"] for f in doc["findings"]]
    first, second = (f["index"] for f in gone)
    assert second > first                               # the run went on after the restart
    assert doc["gone_at"] == gone[1]["case"]
    assert all((found / f"{f['case']}.json").exists() for f in gone)
    assert re.search(r"did not come back: the restart command exited with status 3", doc["stopped"])
    assert ", the target restarted 1 time, stopped: the target went away at case " in stdout
    assert "restarted 1 time" in stderr
