"""The allocation storm: four initiator processes against one target, on each transport.

Afterwards every block is either free exactly once or bound exactly once (the target's
memory is audited), every block a worker left bound holds exactly what it stored last,
and every LOAD during the storm returned what had been stored.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.audit import audit

from .kbtp_harness import TargetThread

WORKERS = 4
SECONDS = 10
CONFIG = TargetConfig(blocks=256, block_size=4096, max_initiators=4, features=0, request_credits=16)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_allocation_storm(transport):
    t = TargetThread(transport, CONFIG)
    try:
        storm(t, [t.connect_options(i).get("local") for i in range(WORKERS)])
    finally:
        t.stop()


def storm(t: TargetThread, locals_: list[str | None]) -> None:
    """WORKERS initiator processes (sending from ``locals_`` on RoCEv2) against ``t``."""
    root = Path(__file__).resolve().parent.parent
    procs = []
    for i, local in enumerate(locals_):
        cmd = [sys.executable, "-m", "tests.storm_worker", t.url, "--seconds", str(SECONDS),
               "--seed", str(i)] + (["--local", local] if local else [])
        procs.append(subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=SECONDS + 60)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    for r in results:
        assert r["errors"] == []
        assert r["counts"]["alloc_store"] > 20 and r["counts"]["free"] > 10, r["counts"]
    assert t.run(lambda: audit(t.target)) == []
    table, memory = t.target.memory.table, t.target.memory
    bound = {}
    for r in results:
        bound.update(r["bound"])

    def holdings():
        out = {}
        for h in range(table.base_handle, table.base_handle + table.count):
            e = table.read(h)
            if e.valid:
                out[str(h)] = hashlib.sha256(bytes(memory.block(e.block_offset, e.data_length))).hexdigest()
        return out
    assert t.run(holdings) == bound
