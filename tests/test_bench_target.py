"""tools/bench_target.py in its smallest configuration: it runs and its numbers are sane."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_one_iwarp_case_against_its_baseline(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_target.py"), "--seconds", "0.5",
         "--warmup", "0.2", "--transports", "iwarp", "--ops", "LOAD", "--sizes", "4096",
         "--window", "4", "--pool-mib", "16", "--json", str(out), "--readme"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    [case] = json.loads(out.read_text())["cases"]
    assert "error" not in case
    kbtp, base = case["kbtp"], case["baseline"]
    assert kbtp["ops"] > 0 and base["ops"] > 0 and case["ratio"] > 0
    assert kbtp["mb_per_s"] * 1e6 == pytest.approx(kbtp["ops_per_s"] * 4096)
    # a LOAD is one request out and at least the block back
    assert kbtp["wire"]["rx"] > 4096 and 0 < kbtp["wire"]["tx"] < 4096
    assert kbtp["per_op"]["fpdus_rx"] >= 2          # the block's Write and the COMPLETION
    assert case["pool"] == 16 << 20 and case["rss_start"] > 0 and case["rss_ok"]
    assert case["startup_s"] > 0
    assert "LOAD" in case["target_output"]       # the target's counters table on exit
    assert "| iwarp | LOAD | 4096 |" in proc.stdout
