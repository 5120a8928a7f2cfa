"""``kbtp demo``, the README's main job, as a newcomer runs it: every step succeeds."""
from __future__ import annotations

import subprocess
import sys

from .tshark import needs_tshark


@needs_tshark
def test_demo_runs_every_step_on_both_bindings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "demo", "--out", str(tmp_path),
                           "--fuzz-cases", "40"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout
    for transport in ("iwarp", "roce"):
        for step in ("workload", "decode", "replay", "fuzz", "conform"):
            assert f"{transport:<6} {step:<9} ok" in summary, (transport, step, summary)
        assert (tmp_path / f"{transport}_session.pcap").stat().st_size > 1000
        assert (tmp_path / f"{transport}_conform.xml").exists()
    assert "MATCH" in summary and "0 FAIL" in summary and "no findings" in summary
    assert len(list((tmp_path / "crafted").glob("*.pcap"))) == 4
