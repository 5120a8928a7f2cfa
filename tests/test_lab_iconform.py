"""The initiator checker against initiators on the kernel's RDMA: the C example
(examples/c-initiator, written from the specification alone on libibverbs and librdmacm)
and the reference initiator on the verbs backend, in the lab's guest on Linux rxe and siw.

The checker runs on the host, in the lab's namespace, listening on the host side of the
lab's links; it starts each run of the initiator in the guest through ``tools/rdma_lab.py
exec --lab``. The guest writes only in the lab's directory, so the runs' files are kept
there (``--keep``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .lab import BINDINGS, in_lab
from .sandbox import ROOT

pytestmark = pytest.mark.lab
C_INITIATOR = ROOT / "examples" / "c-initiator"
#: per run of the initiator in the guest (the reference's Python starts in about 6 s there)
RUN_TIMEOUT = 60


@pytest.fixture(scope="module")
def c_initiator() -> str:
    """``make`` of the C example, as its README says (Debian's libibverbs-dev, librdmacm-dev)."""
    built = subprocess.run(["make", "-C", str(C_INITIATOR)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return str(C_INITIATOR / "kbtp-initiator")


def check(lab, transport: str, program: list[str], *only: str) -> tuple[int, dict, str]:
    """``kbtp conform --role initiator`` on the host side of the binding, ``program`` in the guest."""
    binding = BINDINGS[transport]
    listen = binding.url(binding.host)
    keep = lab.dir / f"keep-{transport}-{len(program)}"
    args = [sys.executable, "-m", "kbtp_scapy", "conform", "--role", "initiator", "--listen", listen,
            "--local", binding.guest, "--keep", str(keep), "--timeout", str(RUN_TIMEOUT), "--json",
            *[a for prefix in only for a in ("--only", prefix)], "--",
            sys.executable, str(ROOT / "tools" / "rdma_lab.py"), "exec", "--lab", str(lab.dir),
            "--timeout", str(RUN_TIMEOUT), "--", *program]
    with lab.shared(), in_lab(lab):
        done = subprocess.run(args, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def hostile(lab, transport: str, program: list[str], cases: int) -> tuple[int, dict, str]:
    """``kbtp fuzz --role initiator`` likewise; its working files go to the lab's directory
    (TMPDIR), where the guest can write."""
    binding = BINDINGS[transport]
    args = [sys.executable, "-m", "kbtp_scapy", "fuzz", "--role", "initiator", "--listen",
            binding.url(binding.host), "--local", binding.guest, "--cases", str(cases),
            "--seed", "1", "--timeout", "30", "--json", "--out", str(lab.dir / f"found-{transport}"), "--",
            sys.executable, str(ROOT / "tools" / "rdma_lab.py"), "exec", "--lab", str(lab.dir),
            "--timeout", "30", "--", *program]
    with lab.shared(), in_lab(lab):
        done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env={**os.environ, "TMPDIR": str(lab.dir)})
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def judged(doc: dict) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for case in doc["cases"]:
        by.setdefault(case["verdict"], []).append(case["id"])
    return by


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_c_initiator_passes_the_checker(lab, c_initiator, transport):
    """Every case PASS, or SKIP for what the example leaves out (it reports those
    UNSUPPORTED) and for what the binding lacks (siw has no atomics, RECORD is RoCEv2's),
    and one WARN: it asks for no INVALIDATE (a SHOULD), because MRs from ibv_reg_mr cannot
    be invalidated remotely; it deregisters each request's MR instead (its README)."""
    code, doc, err = check(lab, transport, [c_initiator])
    verdicts = judged(doc)
    bad = [c for c in doc["cases"] if c["verdict"] not in ("PASS", "SKIP")
           and (c["verdict"], c["id"]) != ("WARN", "security.single_use_stags")]
    assert not bad and code == 0, json.dumps(bad, indent=1)[-6000:] + err[-2000:]
    assert len(verdicts["PASS"]) >= 20, verdicts
    for must in ("hello.header", "hello.id_entropy", "hello.id_retained", "credits.one",
                 "completion.out_of_order", "load.data_after_completion", "direct_load.order",
                 "direct_load.generation", "descriptor.load_length"):
        assert must in verdicts["PASS"], (must, verdicts)
    skipped = {c["id"]: c["detail"] for c in doc["cases"] if c["verdict"] == "SKIP"}
    assert all(skipped.values()), skipped


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_c_initiator_survives_the_hostile_target(lab, c_initiator, transport):
    """Malformed HELLO_ACKs, completions with wrong IDs and lengths, garbage ring slots,
    disconnects: no crash, no hang, no data reported that was not served, on the device."""
    code, doc, err = hostile(lab, transport, [c_initiator], 12)
    assert (code, doc["cases"], doc["findings"]) == (0, 12, []), json.dumps(doc, indent=1)[-6000:] + err[-2000:]


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_reference_initiator_on_verbs_passes_the_checker(lab, transport):
    """The reference initiator on the guest's device (its Python runs about twenty times
    slower there, so four cases, those that judge what the device does: HELLO, credits,
    the LOAD descriptor's edges probed through the device, Direct Load's RDMA Reads)."""
    binding = BINDINGS[transport]
    program = [*lab.kbtp(), "initiator", "{url}", "--io", "verbs", "--device", binding.device,
               "--local", "{local}", "--id-file", "{state}/id", "--timeout", "{timeout}", "script",
               "--ops", "{ops}", "--in", "{in}", "--out", "{out}"]
    code, doc, err = check(lab, transport, program, "hello.header", "credits.one",
                           "descriptor.load_length", "direct_load.order")
    bad = [c for c in doc["cases"] if c["verdict"] != "PASS"]
    assert not bad and code == 0, json.dumps(bad, indent=1)[-6000:] + err[-2000:]
    assert len(doc["cases"]) == 4


#: a sample of cases for the checking target on the device: what the initiator sends, what
#: lands in its buffers, its buffers probed through the device, and one that watches its
#: RDMA Reads on target memory (SKIP there); the checker's Python is slow in the guest
ON_DEVICE = ("hello.header", "credits.one", "descriptor.load_length", "load.data_after_completion",
             "completion.out_of_order", "direct_load.order")


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_checking_target_on_verbs_judges_the_c_initiator(lab, c_initiator, transport):
    """``--io verbs``: the checking target on the guest's device, the C initiator beside it
    on the same device. The cases judged from the initiator's messages and its buffers pass
    as on the soft RNIC; the one that watches its RDMA Reads is SKIP, saying why."""
    binding = BINDINGS[transport]
    args = lab.kbtp("conform", "--role", "initiator", "--listen", binding.url(binding.guest),
                    "--io", "verbs", "--device", binding.device, "--local", binding.guest,
                    "--timeout", str(RUN_TIMEOUT), "--json", *[a for c in ON_DEVICE for a in ("--only", c)],
                    "--", c_initiator)
    done = lab.run(args, timeout=900, check=False, env={"TMPDIR": str(lab.dir)})
    assert done.stdout, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    verdicts = {c["id"]: c for c in doc["cases"]}
    assert set(verdicts) == set(ON_DEVICE), sorted(verdicts)
    skipped = verdicts.pop("direct_load.order")
    assert skipped["verdict"] == "SKIP" and "--io verbs" in skipped["detail"], skipped
    bad = [c for c in verdicts.values() if c["verdict"] != "PASS"]
    assert not bad and done.returncode == 0, json.dumps(bad, indent=1)[-6000:] + done.stderr[-2000:]


def test_exec_passes_the_checker_variables_and_kills_in_the_guest(lab):
    """The wrapper itself: KBTP_* reach the guest, the exit status comes back, and a run
    past --timeout is killed in the guest (the checker's SIGKILL cannot reach it there)."""
    base = [sys.executable, str(ROOT / "tools" / "rdma_lab.py"), "exec", "--lab", str(lab.dir)]
    with lab.shared():
        env = {"PATH": "/usr/bin:/bin", "KBTP_OPS": "free 0", "OTHER": "not passed"}
        said = subprocess.run([*base, "--", "sh", "-c", 'echo "$KBTP_OPS|$OTHER"; exit 7'],
                              capture_output=True, text=True, timeout=60, env=env)
        assert (said.returncode, said.stdout.strip()) == (7, "free 0|"), said
        slow = subprocess.run([*base, "--timeout", "2", "--", "sleep", "30"], capture_output=True,
                              text=True, timeout=60)
        assert slow.returncode != 0 and "after 2 s" in slow.stderr, slow
        left = lab.run(["sh", "-c", "ps -eo args | grep -c '^sleep 30' || true"], check=False).stdout
        assert left.strip() == "0", left
