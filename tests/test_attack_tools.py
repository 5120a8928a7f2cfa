"""The client tools pointed at a hostile target (issue 32, T1 to T4).

The target is ``tests/attack.py``'s ``HostileTarget`` (iWARP and RoCEv2), framed from the
texts with no code of the package. Each tool runs as a user runs it, a process of its own, under an address-space
cap (so a tool that trusts a Block Size of 0xFFFFFFF8 fails here instead of taking the
machine), and must end by itself within its deadline, with a one-line message (no
traceback), its exit status, and a peak RSS under 256 MB.
"""
from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kbtp_scapy.initiator import Initiator, PeerLimit
from kbtp_scapy.initiator.limits import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_UNMATCHED, Limits

from .attack import DIRECT_LOAD, HostileTarget, direct_load_descriptors
from .kbtp_harness import fresh_hosts

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "pcaps" / "iwarp_session.pcap"      # a session with DIRECT_LOAD reads
TIMEOUT = 2                                          # each tool's --timeout
ENDS_WITHIN = 90.0                                   # seconds a tool may take on a busy machine
PEAK_RSS_MB = 256
ADDRESS_SPACE = 2 << 30                              # the cap a trusted 4 GiB buffer runs into
ID = "00112233445566778899aabbccddeeff"
HUGE_BLOCK = 0xFFFFFFF8


def _commands(target: HostileTarget, scratch: Path, conform_case: str, op: str) -> dict[str, list[str]]:
    """The five client tools aimed at ``target``, each as a user would run it; ``op`` is what
    ``kbtp initiator`` and ``kbtp bench`` do (load or direct_load)."""
    url, t = target.url, str(TIMEOUT)
    local = ["--local", target.roce_peer] if target.roce_peer else []
    return {
        "initiator": ["initiator", url, *local, "--id", ID, "--timeout", t, op.replace("_", "-"), "0x4000"],
        "bench": ["bench", url, *local, "--op", op, "-n", "5", "--timeout", t, "--no-histogram"],
        "conform": ["conform", "--target", url, *local, "--timeout", t, "-q", "--only", conform_case],
        "fuzz": ["fuzz", "--target", url, *local, "--timeout", t, "--cases", "2", "-q", "--out",
                 str(scratch / "fuzz")],
        "replay": ["replay", str(CAPTURE), "--target", url, *local, "--timeout", t, "-q"],
    }


@dataclass
class Ran:
    tool: str
    code: int | None          # None: killed at ENDS_WITHIN
    seconds: float
    peak_mb: float
    stderr: str
    stdout: str

    def problems(self, codes: set[int]) -> list[str]:
        """What is wrong with this run, as a line each (none: it behaved)."""
        out = []
        if self.code is None:
            out.append(f"still running after {ENDS_WITHIN:g} s (killed)")
        elif self.code not in codes:
            out.append(f"exit status {self.code}, not {sorted(codes)}")
        if "Traceback" in self.stderr + self.stdout:
            out.append(f"a traceback: {self.stderr[-300:]!r}")
        said = [line for line in self.stderr.splitlines() if line.startswith("kbtp: ")]
        if self.code is not None and len(said) != 1:
            out.append(f"{len(said)} 'kbtp: ' lines on stderr, not one: {self.stderr[-300:]!r}")
        if self.peak_mb >= PEAK_RSS_MB:
            out.append(f"peak RSS {self.peak_mb:.0f} MB")
        return [f"{self.tool}: {p}" for p in out]


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_tool(tool: str, args: list[str], scratch: Path) -> Ran:
    """``kbtp ARGS`` in a process of its own, waited for with its own resource usage."""
    out_path, err_path = scratch / f"{tool}.out", scratch / f"{tool}.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "kbtp_scapy", *args], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, cwd=scratch, preexec_fn=_capped)
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - started > ENDS_WITHIN:
                proc.kill()
                killed = True
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)     # reaped here, not by Popen
    return Ran(tool, None if killed else proc.returncode, time.monotonic() - started,
               usage.ru_maxrss / 1024, err_path.read_text(errors="replace"),
               out_path.read_text(errors="replace"))


def attack(scratch: Path, codes: dict[str, set[int]], conform_case: str, target: HostileTarget,
           op: str = "load") -> dict[str, Ran]:
    """Every tool against ``target``; fails listing what each did wrong."""
    runs, problems = {}, []
    with target:
        for tool, args in _commands(target, scratch, conform_case, op).items():
            runs[tool] = ran = run_tool(tool, args, scratch)
            problems += ran.problems(codes[tool])
    assert not problems, "\n".join(problems)
    return runs


def hostile(binding: str = "iwarp", **plan) -> HostileTarget:
    """A hostile target of ``binding``; over RoCEv2 the tools send from an address of their own."""
    host, peer = fresh_hosts(2)
    return HostileTarget(host, roce_peer=peer if binding == "roce" else None, **plan)


BINDINGS = pytest.mark.parametrize("binding", ["iwarp", "roce"])


FAILED = {"initiator": {1}, "bench": {1}, "conform": {1}, "fuzz": {1}, "replay": {1}}
#: a target that never says HELLO_ACK: conform, fuzz and replay have no verdict to give
#: (2; issue 31 may call a target that dies a finding, 1), bench's run could not start (2),
#: the initiator fails (1)
UNREACHABLE = {"initiator": {1}, "bench": {2}, "conform": {1, 2}, "fuzz": {1, 2}, "replay": {2}}


@pytest.mark.slow
@BINDINGS
def test_a_block_size_of_0xfffffff8_is_refused_by_every_tool_in_little_memory(tmp_path, binding):
    """T1: each tool refuses the HELLO_ACK as the target's fault (FAIL, finding, exit 1)."""
    runs = attack(tmp_path, FAILED, "ops.load.not_valid", hostile(binding, ack={"block_size": HUGE_BLOCK}))
    for tool in ("initiator", "bench"):
        assert f"Block Size of {HUGE_BLOCK} octets" in runs[tool].stderr, runs[tool].stderr
    for tool in ("conform", "fuzz"):
        assert f"Block Size of {HUGE_BLOCK} octets" in runs[tool].stdout, runs[tool].stdout[-500:]


def test_conform_takes_raised_limits(tmp_path):
    """A vendor whose blocks are larger than the default limit raises it for conform too
    (conform used to keep the defaults, so such a target FAILed every case)."""
    with hostile(ack={"block_size": MAX_BLOCK_SIZE * 2}) as target:
        args = ["conform", "--target", target.url, "--timeout", str(TIMEOUT), "--only", "ops.load.not_valid"]
        refused = run_tool("conform", args, tmp_path)
        raised = run_tool("conform", [*args, "--max-block-size", str(MAX_BLOCK_SIZE * 2)], tmp_path)
    assert "within the checker's limits" in refused.stdout, refused.stdout[-500:]
    assert "checker's limits" not in raised.stdout and raised.code in (0, 1), raised.stdout[-500:]


@pytest.mark.slow
@BINDINGS
def test_a_hello_never_answered_ends_every_tool(tmp_path, binding):
    """T2: a connection that takes the HELLO and says nothing; ``kbtp bench`` waited forever."""
    runs = attack(tmp_path, UNREACHABLE, "ops.load.not_valid", hostile(binding, hello=False))
    assert runs["bench"].seconds < ENDS_WITHIN
    for tool, ran in runs.items():      # the connection was up: the HELLO_ACK is what is missing
        said = ran.stderr + ran.stdout
        assert f"no HELLO_ACK within {TIMEOUT} s" in said and "listening there" not in said, (tool, said)


@pytest.mark.slow
@BINDINGS
def test_requests_never_answered_end_every_tool(tmp_path, binding):
    """T2: HELLO_ACK, then silence: every request has its deadline (``kbtp bench`` had none)."""
    attack(tmp_path, FAILED, "ops.load.not_valid", hostile(binding, answer=False))


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["initiator", "bench"])
def test_after_a_request_never_answered_no_goodbye_waits_again(tmp_path, tool):
    """A target silent after its HELLO_ACK: the tool ends on the request's deadline and
    closes, sending no GOODBYE, whose acknowledgement and close it would wait on again (it
    took about twice --timeout)."""
    with hostile(answer=False) as target:
        ran = run_tool(tool, _commands(target, tmp_path, "", "load")[tool], tmp_path)
    assert ran.code == 1 and f"within {TIMEOUT} s" in ran.stderr, ran.stderr
    assert target.seen["requests"] >= 1 and target.seen["goodbye"] == 0, target.seen


@pytest.mark.slow
def test_blocks_as_large_as_the_limits_allow_then_silence_stay_in_little_memory(tmp_path):
    """T1 at the edge: a HELLO_ACK whose Block Size and Max Inline are the default limit
    itself, and no answer after it. Each tool holds a few blocks at once (a store's data,
    its Send, the frames queued to a peer that reads nothing), so the default limit is what
    keeps them under 256 MB: at 64 MiB bench peaked at 347 MB and conform at 376 MB."""
    target = hostile("iwarp", answer=False,
                     ack={"block_size": MAX_BLOCK_SIZE, "max_inline": MAX_BLOCK_SIZE, "quota": MAX_BLOCKS})
    attack(tmp_path, FAILED, "ops.limits.lengths", target)


@pytest.mark.slow
def test_an_rdma_read_never_answered_ends_every_tool(tmp_path):
    """T4: DIRECT_LOAD granted and no Read Response ever: ``kbtp replay --timeout`` and
    ``kbtp bench --op direct_load`` waited forever. iWARP only: TCP acknowledges the Read
    Request, where a RoCEv2 requester sends it again and its exhausted retries end the
    connection, so no tool hung there."""
    target = hostile("iwarp", ack={"features": DIRECT_LOAD}, reads=False,
                     descriptors=direct_load_descriptors((0x100, 0, 64), 0x4000, (0x200, 0, 16)))
    attack(tmp_path, FAILED, "direct.load.entry_and_block", target, op="direct_load")
    assert target.seen["reads"] >= 4, target.seen        # the tools did read


# -- the API under the tools -------------------------------------------------------------

@pytest.mark.parametrize("figure,value", [("block_size", HUGE_BLOCK), ("max_inline", 0xFFFFFFF0),
                                          ("quota", 0xFFFFFFFF)])
def test_the_initiator_refuses_a_hello_ack_past_its_limits(figure, value):
    """T1: ``Initiator.connect`` checks the HELLO_ACK's figures against ``Limits``."""
    async def main() -> str:
        with hostile(ack={figure: value}) as target:
            try:
                ini = await Initiator.connect(target.url, limits=Limits(wait=5))
            except PeerLimit as exc:
                return exc.detail
            await ini.close()
            return "accepted"
    detail = asyncio.run(main())
    assert f"of {value}" in detail, detail


def test_a_hello_ack_within_raised_limits_is_taken():
    async def main() -> int:
        with hostile(ack={"block_size": 1 << 27}) as target:
            ini = await Initiator.connect(target.url, limits=Limits(max_block_size=1 << 27, wait=5))
            await ini.close()
            return ini.target.block_size
    assert asyncio.run(main()) == 1 << 27


@pytest.mark.slow
@BINDINGS
def test_completions_answering_nothing_are_bounded(binding):
    """T3: a flood of COMPLETIONs with Request IDs never used keeps only the newest
    ``MAX_UNMATCHED`` and counts the rest (the queue grew by one per COMPLETION)."""
    flood = 4 * MAX_UNMATCHED

    async def main() -> tuple[int, int]:
        with hostile(binding, flood=flood, answer=False) as target:
            local = {"local": target.roce_peer} if target.roce_peer else {}
            ini = await Initiator.connect(target.url, limits=Limits(wait=5), **local)
            try:
                end = time.monotonic() + 60
                while ini.unmatched.qsize() + ini.dropped < flood and time.monotonic() < end:
                    await asyncio.sleep(0.05)
                return ini.unmatched.qsize(), ini.dropped
            finally:
                await ini.close()
    kept, dropped = asyncio.run(main())
    assert (kept, dropped) == (MAX_UNMATCHED, flood - MAX_UNMATCHED)
