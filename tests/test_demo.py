"""``kbtp demo``, the README's main job, as a newcomer runs it: every step succeeds, and
each step's result is shown once, in a pipe and on a terminal."""
from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .tshark import needs_tshark

pytestmark = pytest.mark.slow     # every test here runs for seconds

KBTP = [sys.executable, "-m", "kbtp_scapy"]
STEPS = ("workload", "decode", "replay", "fuzz", "conform")


@needs_tshark
def test_demo_runs_every_step_on_both_bindings():
    """``kbtp demo`` exactly as the README and ``kbtp --help`` give it."""
    proc = subprocess.run([*KBTP, "demo"], capture_output=True, text=True, timeout=300)
    summary = proc.stdout
    first = summary.splitlines()[0] if summary else ""
    assert first.startswith("KBTP demo: captures and reports go to "), proc.stderr
    out = Path(first.rsplit(" ", 1)[1])
    try:
        _check(proc, summary, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _check(proc: subprocess.CompletedProcess, summary: str, tmp_path: Path) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for transport in ("iwarp", "roce"):
        for step in STEPS:
            assert summary.count(f"  {transport:<6} {step:<9} ok") == 1, (transport, step, summary)
        assert (tmp_path / f"{transport}_session.pcap").stat().st_size > 1000
        assert (tmp_path / f"{transport}_conform.xml").exists()
        assert f"  {tmp_path / f'{transport}_conform.xml'}\n" in summary   # listed for the user
    workload = [line for line in summary.splitlines() if " workload " in line]
    assert workload and not [line for line in workload if " in 0.0 s" in line], workload
    assert "MATCH" in summary and "0 FAIL" in summary and "no findings" in summary
    assert len(list((tmp_path / "crafted").glob("*.pcap"))) == 4
    assert proc.stderr == ""                        # no progress when stderr is not a terminal


def screen(output: str) -> list[str]:
    """The lines a terminal shows after ``output``: a carriage return moves to column 0 and
    what follows overwrites what was there."""
    lines = []
    for raw in output.replace("\r\n", "\n").split("\n"):
        cells: list[str] = []
        col = 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            cells[col:col + 1] = [ch]
            col += 1
        lines.append("".join(cells).rstrip())
    return lines


@needs_tshark
def test_demo_on_a_terminal_shows_each_step_once(tmp_path):
    main, sub = pty.openpty()
    proc = subprocess.Popen([*KBTP, "demo", "--transport", "iwarp", "--fuzz-cases", "10",
                             "--out", str(tmp_path)], stdout=sub, stderr=sub,
                            stdin=subprocess.DEVNULL)
    os.close(sub)
    out = b""
    while chunk := _read(main):
        out += chunk
    os.close(main)
    assert proc.wait(timeout=300) == 0, out.decode()
    text = out.decode()
    assert "\r" in text.replace("\r\n", "")         # progress was shown, in place
    shown = screen(text)
    for step in STEPS:                               # one line names the step: its result
        named = [line for line in shown if step in line[:20]]
        assert len(named) == 1 and named[0].startswith(f"  iwarp  {step:<9} ok: "), shown
    assert not [line for line in shown if line.endswith("...")], shown   # progress cleared


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:                                  # EIO: the other side closed
        return b""
