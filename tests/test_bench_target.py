"""tools/bench_target.py in its smallest configuration: it runs and its numbers are sane."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_one_iwarp_case_against_its_baseline(tmp_path):
    out = tmp_path / "bench.json"
    page = tmp_path / "PERFORMANCE.md"
    page.write_text("before\n<!-- bench_target:begin -->\nold table\n<!-- bench_target:end -->\nafter\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_target.py"), "--seconds", "0.5",
         "--warmup", "0.2", "--transports", "iwarp", "--ops", "LOAD", "--sizes", "4096",
         "--window", "4", "--pool-mib", "16", "--json", str(out), "--markdown", "--write-docs", str(page)],
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
    before, table, after = page.read_text().split("<!-- bench_target")
    assert (before, after) == ("before\n", ":end -->\nafter\n")
    assert "| iwarp | LOAD | 4096 |" in table and "old table" not in table


@pytest.mark.slow
def test_the_floor_moves_what_the_target_moves_beside_its_baseline(tmp_path):
    """tools/bench_floor.py: the floor's LOAD puts the reference target's octets on the
    wire, so its baseline is the same as the target's."""
    out = tmp_path / "floor.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_floor.py"), "--seconds", "0.5",
         "--warmup", "0.2", "--sizes", "4096", "--window", "4", "--pool-mib", "16",
         "--json", str(out), "--markdown"],
        capture_output=True, text=True, timeout=90, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(out.read_text())["results"]
    reference, floor = row["reference"], row["floor"]
    assert floor["ops"] > 0 and row["floor_baseline"]["ops"] > 0
    assert floor["wire"] == reference["kbtp"]["wire"]
    assert proc.stdout.count("| 4096 |") == 1


@pytest.mark.parametrize("size", [4096, 3 * 65536])    # the latter in several Write FPDUs
def test_the_floor_loads_every_block_intact(size):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_floor
        import bench_target
    finally:
        sys.path.remove(str(ROOT / "tools"))
    seen = set()

    def check(handle: int, data: bytes) -> None:
        assert data == bench_floor.block_bytes(handle, size)
        seen.add(handle)
    opts = bench_target.Opts(0.3, 4, 1 << 30, 16, 0.1, None)
    result = asyncio.run(bench_floor.bench_floor(size, opts, check))
    assert result["ops"] > 0 and seen
    assert result["wire"]["rx"] > size


def test_the_floor_refuses_a_bad_size_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_floor.py"), "--sizes",
                           "4k"], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--sizes 4k: not a list of integers")
