"""The reference target's --metrics: latency histograms per opcode, request arrival to
completion posted, scraped over HTTP as Prometheus serves them (issue 21)."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from .hostile import TargetProc

KBTP = [sys.executable, "-m", "kbtp_scapy"]
NAME = "kbtp_request_latency_seconds"


@pytest.mark.slow
def test_latency_histograms_per_opcode():
    net = f"127.49.{secrets.randbelow(250) + 1}"
    t = TargetProc("roce", f"{net}.1", "--blocks", "64", "--max-initiators", "2")
    try:
        before = t.metrics()
        assert not [k for k in before if k.startswith(NAME)]          # nothing served yet
        proc = subprocess.run([*KBTP, "bench", t.url, "--local", f"{net}.2", "--op", "alloc_store",
                               "-n", "400", "-t", "2", "--json"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        rows = {r["op"]: r for r in json.loads(proc.stdout)["results"]}
        m = t.metrics()
    finally:
        t.stop()
    for op in ("ALLOC_STORE", "FREE"):
        buckets = sorted(((float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items()
                          if k.startswith(f'{NAME}_bucket{{') and f'opcode="{op}"' in k))
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == float("inf") and counts == sorted(counts)     # cumulative
        served = m[f'{NAME}_count{{opcode="{op}"}}']
        assert counts[-1] == served == m[f'kbtp_operations_total{{opcode="{op}",status="OK"}}'] >= 400
        # the target's part of a request cannot be longer than the initiator's whole wait
        mean_target = m[f'{NAME}_sum{{opcode="{op}"}}'] / served
        assert 0 < mean_target * 1e6 < rows[op]["latency_us"]["mean"], (op, mean_target, rows[op])
