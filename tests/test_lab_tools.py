"""The toolkit's verdicts on a target whose RDMA is the kernel's: ``kbtp conform``, a bounded
``kbtp fuzz`` and ``kbtp replay`` against the reference target on the verbs backend on Linux
rxe and siw in the lab's guest, and every operation through a lossy path (tc netem)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest

from kbtp_scapy.rnic.pcap import PcapSink

from .lab import BINDINGS, GuestTarget, HostTarget, in_lab, lab_captures, rdma_lab
from .test_target_faults import mixed_workload

pytestmark = pytest.mark.lab
#: per binding; the guest's emulated CPU is what limits it (about 0.2 s of it per case),
#: so the suite runs 200 (its 30 minutes also hold the initiator checks of
#: test_lab_iconform.py) and a maintainer 2,000 or more with KBTP_LAB_FUZZ_CASES
FUZZ_CASES = int(os.environ.get("KBTP_LAB_FUZZ_CASES", "200"))


def kbtp(lab, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """The kbtp command on the host, in the lab's namespace."""
    with in_lab(lab):
        return subprocess.run([sys.executable, "-m", "kbtp_scapy", *args], capture_output=True,
                              text=True, timeout=timeout)


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_conform_passes_the_verbs_target(lab, tmp_path, transport):
    """Every case PASS or SKIP with its reason; on siw, DIRECT_ALLOC is not offered (no
    atomics) and RECORD is RoCEv2's."""
    with GuestTarget(lab, BINDINGS[transport], "--blocks", "1024", "-S", "4096") as target:
        report = tmp_path / "conform.json"
        done = kbtp(lab, "conform", "--target", target.url, "--quick", "--json-file", str(report),
                    timeout=600)
        target.stop()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    results = json.loads(report.read_text())["cases"]
    verdicts = {r["verdict"] for r in results}
    assert verdicts <= {"PASS", "SKIP"}, [r for r in results if r["verdict"] not in ("PASS", "SKIP")]
    skipped = [r for r in results if r["verdict"] == "SKIP"]
    assert all(r["detail"] for r in skipped)
    assert len(results) - len(skipped) >= 30
    if transport == "iwarp":
        assert any("DIRECT_ALLOC" in r["detail"] for r in skipped)


def test_fuzz_finds_nothing_in_the_verbs_targets(lab, tmp_path):
    """FUZZ_CASES cases per binding, both bindings at once (the guest is the slow part)."""
    procs = {}
    # not -v: a debug line per malformed request costs the emulated guest a tenth of its time
    with GuestTarget(lab, BINDINGS["roce"], verbose=False) as rxe, \
            GuestTarget(lab, BINDINGS["iwarp"], verbose=False) as siw:
        with in_lab(lab):
            for name, target in (("rxe", rxe), ("siw", siw)):
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "kbtp_scapy", "fuzz", "--target", target.url, "--cases",
                     str(FUZZ_CASES), "--seed", "12", "--out", str(tmp_path / name), "-q",
                     "--json-file", str(tmp_path / f"{name}.json")],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outputs = {name: p.communicate(timeout=1500)[0] for name, p in procs.items()}
        rxe_log, siw_log = rxe.stop(), siw.stop()
    for name, proc in procs.items():
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        assert proc.returncode == 0 and summary["cases"] >= FUZZ_CASES, outputs[name][-3000:]
        assert not summary["findings"], outputs[name][-3000:]
    for log in (rxe_log, siw_log):
        assert "Traceback" not in log


def test_replay_of_a_host_capture_matches_the_rxe_target(lab, tmp_path):
    """A session against the soft-RNIC target on the host, captured there, replayed
    against the verbs target on rxe: every step matches (Block Offsets are the target's
    own and are compared only with --strict)."""
    binding = BINDINGS["roce"]
    pcap = tmp_path / "host.pcap"
    sink = PcapSink(str(pcap))
    host = HostTarget(lab, binding, frame_listeners=[sink])
    try:
        with in_lab(lab):
            asyncio.run(asyncio.wait_for(lab_captures.session(host.url, roce=True,
                                                              local=rdma_lab.HOST_IP2), 120))
    finally:
        host.stop()
        sink.close()
    with GuestTarget(lab, binding) as target:
        done = kbtp(lab, "replay", str(pcap), "--target", target.url, "--json-file",
                    str(tmp_path / "replay.json"), timeout=300)
        target.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "replay.json").read_text())
    steps = sum(s["steps"] for s in report["sessions"])
    assert report["result"] == "match" and steps > 10, report["summary"]


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_every_operation_completes_with_2_percent_loss(lab, transport):
    """tc netem in the guest drops 2% of what it sends and, through an ifb device, 2% of
    what it receives: rxe's retransmissions, the soft RNIC's and TCP's bring every
    operation through with the right data."""
    binding = BINDINGS[transport]
    netdev = "eth0" if transport == "roce" else "eth1"
    lossy = [["tc", "qdisc", "replace", "dev", netdev, "root", "netem", "loss", "2%"],
             ["ip", "link", "add", "ifb0", "type", "ifb"], ["ip", "link", "set", "ifb0", "up"],
             ["tc", "qdisc", "replace", "dev", "ifb0", "root", "netem", "loss", "2%"],
             ["tc", "qdisc", "add", "dev", netdev, "handle", "ffff:", "ingress"],
             ["tc", "filter", "add", "dev", netdev, "parent", "ffff:", "matchall", "action",
              "mirred", "egress", "redirect", "dev", "ifb0"]]
    try:
        for argv in lossy:
            lab.run(argv)
        # test_target_faults' lossy geometry: 4 KiB blocks, Max Inline 4096 (the workload
        # stores 4096 octets inline)
        with GuestTarget(lab, binding, "--blocks", "128", "-S", "4096", "--max-inline", "4096",
                         "--max-initiators", "2", "--quota", "64", "--handles", "128",
                         "--ticket-timeout", "10000") as target:
            with in_lab(lab):
                asyncio.run(asyncio.wait_for(mixed_workload(target.url), 300))
            target.stop()
        dropped = [_dropped(lab.run(["tc", "-s", "qdisc", "show", "dev", dev]).stdout)
                   for dev in (netdev, "ifb0")]
    finally:
        for argv in (["tc", "qdisc", "del", "dev", netdev, "root"],
                     ["tc", "qdisc", "del", "dev", netdev, "ingress"], ["ip", "link", "del", "ifb0"]):
            lab.run(argv, check=False)
    assert all(n > 0 for n in dropped), f"netem dropped {dropped} (sent, received): no loss tested"


def _dropped(stats: str) -> int:
    """The 'dropped N' of a qdisc's statistics."""
    return int(re.search(r"dropped (\d+)", stats)[1])
