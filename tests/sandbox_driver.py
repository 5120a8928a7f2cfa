"""Runs inside the network and mount namespaces ``tests/sandbox.py`` makes (``unshare``):
brings up loopback, gives ``ip netns`` a private /run/netns, starts the targets asked for,
then runs each step as a shell line and writes what happened as JSON.

Usage: python sandbox_driver.py SPEC.json RESULT.json (the spec says what to run, see
``Sandbox.run``). Only the standard library: it runs as a user's commands would.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

KEEP = 16000         # characters of each output kept (the README test compares shown output)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=20)


class Server:
    """A line that serves until interrupted, its output in files (a pipe nobody reads
    would fill up and stall it)."""

    count = 0

    def __init__(self, line: str, cwd: str, env: dict) -> None:
        Server.count += 1
        self.line = line
        self.out = Path(cwd).parent / f"server{Server.count}.out"
        self.err = Path(cwd).parent / f"server{Server.count}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdout=out,
                                         stderr=err, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if "listening" in self.out.read_text():
                return True
            time.sleep(0.05)
        return "listening" in self.out.read_text()

    def stop(self) -> dict:
        """Ctrl-C, as a user stops it; what it printed and how it ended."""
        note = ""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            note = "\n(did not stop within 30 s of Ctrl-C)"
        return {"rc": self.proc.returncode, "stdout": self.out.read_text()[-KEEP:],
                "stderr": self.err.read_text()[-KEEP:] + note}


def run(line: str, cwd: str, env: dict, timeout: float, interrupt: float | None) -> dict:
    """One line to its end, or to the time limit (then it and what it started are ended).
    ``interrupt``: a long run that is fine so far gets Ctrl-C after that many seconds."""
    began = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    interrupted = False
    try:
        out, err = proc.communicate(timeout=interrupt or timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        if interrupt:
            interrupted = True
            os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30 if interrupt else 0.01)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc, err = None, err + f"\n(did not finish within {timeout:g} s)"
    return {"rc": rc, "stdout": out[-KEEP:], "stderr": err[-KEEP:], "interrupted": interrupted,
            "seconds": round(time.monotonic() - began, 1)}


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    env, cwd = spec["env"], spec["cwd"]
    sh("ip", "link", "set", "lo", "up")
    Path("/run/netns").mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "kbtp-sandbox", "/run/netns")      # ip netns names stay ours
    for addr in spec["addresses"]:
        sh("ip", "addr", "add", f"{addr}/32", "dev", "lo")
    results, servers = [], []
    try:
        for line in spec["targets"]:
            server = Server(line, cwd, env)
            servers.append(server)
            if not server.wait_listening(30):
                results.append({"line": line, "target": True, "started": False, **server.stop()})
                servers.remove(server)
                return
        for step in spec["steps"]:
            line = step["line"]
            if not step["serve"]:
                results.append({"line": line, **run(line, cwd, env, step["timeout"],
                                                    step.get("interrupt"))})
                continue
            server = Server(line, cwd, env)
            up = server.wait_listening(step["timeout"])
            if up and step["keep"]:
                servers.append(server)
            else:
                results.append({"line": line, "started": up, **server.stop()})
    finally:
        for server in servers:
            results.append({"line": server.line, "target": True, **server.stop()})
        Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
