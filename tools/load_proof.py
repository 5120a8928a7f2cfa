#!/usr/bin/env python3
"""Do the checkers' verdicts hold on a busy host? The clean reference peers, judged with busy loops beside them.

For each setup (the reference target over iWARP and RoCEv2, software and chains execution;
the reference initiator over both bindings) the checker runs once on the host as it is,
then ``--runs`` times with ``--loops-per-core`` busy loops per core beside it (each loop a
process that ends by itself). Every process is separate, as in use: ``kbtp target``,
``kbtp conform`` and the programs the initiator checker starts. A case is load-proof when
no loaded run FAILs or ERRORs it: PASS as on the quiet run, or SKIP where the checker says
its own host could not keep up (``conform/pace.py``), the one verdict the issue allows a
busy checker. The report counts, per setup, the runs whose verdicts are all the quiet
run's and the runs with a SKIP of that kind.

    .venv/bin/python tools/load_proof.py --runs 5                       # the timing cases
    .venv/bin/python tools/load_proof.py --runs 5 --cases all --setup target:iwarp:software
    .venv/bin/python tools/load_proof.py --runs 5 --markdown table.md   # docs/LOAD_PROOF.md has its table

``--cases timing`` (the default) runs the cases whose verdicts hang on time
(``TARGET_CASES``, ``INITIATOR_CASES``); ``--cases all`` runs every case (minutes a run
per binding quiet, many more under load).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

KBTP = [sys.executable, "-m", "kbtp_scapy"]
LOOPS_PER_CORE = 8
#: the target cases whose verdicts hang on time: tickets against the Ticket Timeout
#: (many taken, a part of it slept on purpose, bound after round trips, one abandoned),
#: and the target's RDMA Read held while what must not happen meanwhile is watched
TARGET_CASES = ["direct.quota.tickets", "direct.ticket.within_timeout", "direct.bind.verify",
                "direct.alloc.atomics", "direct.ticket.abandoned", "completion.order",
                "session.credits.request"]
#: the initiator cases that do: the Ticket Timeout from the initiator's end, completions
#: held back, answers the program must wait past, and a plain one (a program slow to start)
INITIATOR_CASES = ["direct_alloc.ticket_timeout", "direct_alloc.abandoned", "credits.one",
                   "credits.completion_buffers", "completion.duplicate", "completion.unknown_id",
                   "hello.header"]
SETUPS = ["target:iwarp:software", "target:roce:software", "target:iwarp:chains", "target:roce:chains",
          "initiator:iwarp", "initiator:roce"]
#: seconds the busy loops and one checker run may last at most
BOUND = 1800
#: what a SKIP says when the checker's own pace was the reason (conform/pace.py)
PACE = "took the checker"

Verdicts = dict[str, tuple[str, str]]      # case -> (verdict, detail)


@contextmanager
def busy_loops(per_core: int = LOOPS_PER_CORE) -> Iterator[None]:
    """``per_core`` busy loops per core, each ending by itself after ``BOUND`` s."""
    loop = f"import time\nend = time.monotonic() + {BOUND}\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(per_core * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@contextmanager
def reference_target(transport: str, execution: str, host: str, local: str) -> Iterator[tuple[str, list[str]]]:
    """``kbtp target`` listening on ``host``: its URL and the checker's --local option."""
    url = f"{transport}://{host}:{5420 if transport == 'iwarp' else 4791}"
    proc = subprocess.Popen([*KBTP, "target", "--transport", transport, "--listen", url.split("//")[1],
                             "--execution", execution], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()          # its start-up line, once it listens
        if "listening" not in first:
            raise RuntimeError(f"kbtp target did not start: {first.strip()}")
        yield url, (["--local", local] if transport == "roce" else [])
    finally:
        proc.kill()
        proc.wait()


def _verdicts(path: Path) -> Verdicts:
    doc = json.loads(path.read_text())
    return {c["id"]: (c["verdict"], c["detail"] or c["seen"]) for c in doc["cases"]}


def judge(setup: str, hosts: tuple[str, str], cases: list[str] | None) -> tuple[int, Verdicts]:
    """One ``kbtp conform`` run of ``setup`` (``target:T:E`` or ``initiator:T``) over
    ``cases`` (None: every case): its exit status and its verdicts by case."""
    role, transport, *rest = setup.split(":")
    only = [arg for c in cases or () for arg in ("--only", c)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "conform.json"
        if role == "target":
            with reference_target(transport, rest[0], *hosts) as (url, local):
                done = subprocess.run([*KBTP, "conform", "--target", url, *local, "-q", "--json-file", str(out),
                                       *only], capture_output=True, text=True, timeout=BOUND, check=False)
        else:
            port = 5430 if transport == "iwarp" else 4791
            program = [*KBTP, "initiator", "{url}", "--timeout", "{timeout}", "--local", "{local}",
                       "--id-file", "{state}/id", "script", "--ops", "{ops}", "--in", "{in}", "--out", "{out}"]
            done = subprocess.run([*KBTP, "conform", "--role", "initiator", "--listen",
                                   f"{transport}://{hosts[0]}:{port}", "-q", "--json-file", str(out), *only,
                                   "--", *program], capture_output=True, text=True, timeout=BOUND, check=False)
        if not out.exists():
            raise RuntimeError(f"{setup}: kbtp conform wrote no report: {done.stderr.strip()[-300:]}")
        return done.returncode, _verdicts(out)


@dataclass
class Result:
    """A setup's quiet verdicts and, per loaded run, the cases whose verdict differed."""

    setup: str
    quiet: Verdicts
    runs: list[dict[str, tuple[str, str]]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def failed(self) -> list[tuple[int, str, str, str]]:
        """(run, case, verdict, detail) of every FAIL or ERROR under load."""
        return [(i + 1, case, v, d) for i, run in enumerate(self.runs) for case, (v, d) in run.items()
                if v in ("FAIL", "ERROR")]

    def same(self) -> int:
        return sum(not run for run in self.runs)

    def paced(self) -> int:
        return sum(bool(run) and all(v == "SKIP" and PACE in d for v, d in run.values()) for run in self.runs)


def differences(quiet: Verdicts, loaded: Verdicts) -> dict[str, tuple[str, str]]:
    return {case: got for case, got in loaded.items() if quiet.get(case, ("", ""))[0] != got[0]}


def prove(setup: str, runs: int, per_core: int, cases: list[str] | None, hosts: tuple[str, str],
          progress=lambda text: None) -> Result:
    """The quiet run of ``setup``, then ``runs`` runs with the busy loops beside them."""
    result = Result(setup, judge(setup, hosts, cases)[1])
    bad = {c: v for c, v in result.quiet.items() if v[0] in ("FAIL", "ERROR")}
    if bad:
        raise RuntimeError(f"{setup}: the clean reference fails on a quiet host: {bad}")
    with busy_loops(per_core):
        for i in range(runs):
            started = time.monotonic()
            result.runs.append(differences(result.quiet, judge(setup, hosts, cases)[1]))
            result.seconds.append(time.monotonic() - started)
            progress(f"{setup}: run {i + 1}/{runs} under load: "
                     f"{', '.join(f'{c} {v}' for c, (v, _) in result.runs[-1].items()) or 'the quiet verdicts'}"
                     f" ({result.seconds[-1]:.0f} s)")
    return result


def markdown(results: list[Result], runs: int, per_core: int, cases: str) -> str:
    lines = [f"{runs} runs per setup with {per_core} busy loops per core beside the checker "
             f"({os.cpu_count()} cores), the {cases} cases; generated by `tools/load_proof.py`.", "",
             "| setup | cases | quiet | runs with the quiet verdicts | runs with a pace SKIP only | "
             "FAIL or ERROR under load | seconds a loaded run |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        quiet = ", ".join(f"{n} {v}" for v, n in sorted(_count(r.quiet).items()))
        failed = "; ".join(f"run {i} {c} {v}" for i, c, v, _ in r.failed()) or "none"
        took = f"{min(r.seconds):.0f}-{max(r.seconds):.0f}" if r.seconds else "-"
        lines.append(f"| {r.setup} | {len(r.quiet)} | {quiet} | {r.same()} of {len(r.runs)} | "
                     f"{r.paced()} | {failed} | {took} |")
    return "\n".join(lines) + "\n"


def _count(verdicts: Verdicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for v, _ in verdicts.values():
        out[v] = out.get(v, 0) + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="loaded runs per setup (default 5)")
    ap.add_argument("--loops-per-core", type=int, default=LOOPS_PER_CORE, help="busy loops per core (default 8)")
    ap.add_argument("--cases", choices=("timing", "all"), default="timing",
                    help="the cases whose verdicts hang on time (default), or every case")
    ap.add_argument("--setup", action="append", choices=SETUPS, help="only this setup (repeatable)")
    ap.add_argument("--net", type=int, default=0, metavar="N",
                    help="listen on 127.46.N.1 and 127.46.N.2 (default 0): two runs at once need two")
    ap.add_argument("--json", metavar="FILE", help="write every verdict as JSON to FILE")
    ap.add_argument("--markdown", metavar="FILE", help="write the report's table as Markdown to FILE")
    args = ap.parse_args()
    if args.runs < 1 or args.loops_per_core < 0 or not 0 <= args.net <= 255:
        ap.error("--runs is 1 or more, --loops-per-core 0 or more, --net 0 to 255")
    hosts = (f"127.46.{args.net}.1", f"127.46.{args.net}.2")
    results = []
    try:
        for setup in args.setup or SETUPS:
            cases = None if args.cases == "all" else (TARGET_CASES if setup.startswith("target")
                                                       else INITIATOR_CASES)
            results.append(prove(setup, args.runs, args.loops_per_core, cases, hosts,
                                 lambda text: print(text, file=sys.stderr, flush=True)))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"load_proof.py: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("load_proof.py: interrupted (Ctrl-C); the setups finished are reported", file=sys.stderr)
    table = markdown(results, args.runs, args.loops_per_core, args.cases)
    print(table, end="")
    if args.json:
        Path(args.json).write_text(json.dumps([{"setup": r.setup, "quiet": r.quiet, "runs": r.runs,
                                                "seconds": r.seconds} for r in results], indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 1 if any(r.failed() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
