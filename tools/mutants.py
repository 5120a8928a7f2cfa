#!/usr/bin/env python3
"""How many machine-made bugs do ``kbtp conform`` and ``kbtp fuzz`` kill, in a target or an initiator?

Mutants of the reference target's protocol core are made with Cosmic Ray's operators
(``pip install -e .[mutation]``): every place an operator can change the code of
operations.py, table.py, ring.py, sessions.py, direct.py or connection.py is one mutant.
A random sample of them (``--sample``, ``--seed``) is judged one at a time: the package
is copied to a temporary directory with the one mutated module, a ``kbtp target`` runs
from that copy (first on PYTHONPATH), and the unmutated checkers judge it from outside,
as they would any target: the cases of ``kbtp conform --quick`` and the cases of
``kbtp fuzz --cases N --seed S`` on both bindings, each tool ending at its first failure
or finding (a broken target would otherwise make the rest wait out their timeouts, and
the fuzzer minimize). A mutant is killed when either tool fails it on either binding (or
the mutated target does not start: "killed at start"). The score comes with
a Wilson 95% interval, because a sample is not the whole.

    .venv/bin/python tools/mutants.py --list                          # how many mutants there are
    nice .venv/bin/python tools/mutants.py --sample 50 --seed 1 --markdown docs/MUTANTS.md
    .venv/bin/python tools/mutants.py --only ring.py:core/ReplaceComparisonOperator_Lt_LtE:3

Mutants are judged against the unmutated target first (the control: both tools must pass).

With ``--role initiator`` the mutants are of the reference initiator's protocol code
(client.py: requests and completions; direct.py: Direct Load and Direct Allocation;
results.py: completion matching), and the judges are ``kbtp conform --role initiator
--quick`` and ``kbtp fuzz --role initiator``, running ``kbtp initiator ... script`` from
the mutated copy as the program under test, on both bindings:

    nice .venv/bin/python tools/mutants.py --role initiator --sample 40 --seed 1 --markdown docs/MUTANTS_INITIATOR.md
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import html
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kbtp_scapy"
CORE = ("operations.py", "table.py", "ring.py", "sessions.py", "direct.py", "connection.py")


@dataclass(frozen=True)
class Role:
    """What is mutated (``modules`` of the subpackage ``package``) and what judges it."""

    name: str
    package: str
    modules: tuple[str, ...]
    what: str
    fuzz_cases: int          # default --fuzz-cases: an initiator's case starts a program
    timeout: float           # default --timeout: an initiator's runs get half of it, and the
                             # credits cases hold completions back for seconds
    outside: tuple[str, ...] = ()   # functions that are not the protocol code (left out)


ROLES = {"target": Role("target", "target", CORE, "the target's protocol core", 1000, 3.0),
         "initiator": Role("initiator", "initiator", ("client.py", "direct.py", "results.py"),
                           "the reference initiator's protocol code", 40, 10.0,
                           # the tools' way to send any octets: no program under test calls it
                           ("raw",))}
TRANSPORTS = ("iwarp", "roce")
#: The target's shape for the runs: small, with a short Ticket Timeout so the cases that
#: wait for an abandoned ticket are not skipped.
TARGET_OPTIONS = ["--blocks", "128", "--max-initiators", "8", "--ticket-timeout", "300", "--retention", "30"]
PORTS = {"iwarp": 5420, "roce": 4791}
#: Seconds one checker may take against one target: the clean target takes 10 to 40 on a
#: loaded machine, so a mutant still running at this has hung the checker (a kill).
VERDICT_TIMEOUT = 240
#: Where the hand-written classification of the survivors starts in the Markdown report;
#: a new run rewrites what is above it and keeps the rest.
CLASSIFIED = "\n<!-- survivors classified by hand below; kept when the report is regenerated -->\n"
#: ``kbtp`` as this interpreter runs it (the package it imports follows PYTHONPATH).
KBTP = [sys.executable, "-c", "from kbtp_scapy.cli import entry; entry()"]
#: The checkers always come from this checkout, whatever is installed.
CHECKER_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@dataclass(frozen=True)
class Mutant:
    module: str          # file name within kbtp_scapy/PACKAGE
    operator: str        # Cosmic Ray operator name
    occurrence: int      # which place in the module that operator changes
    line: int
    package: str = "target"

    @property
    def path(self) -> Path:
        return PACKAGE / self.package / self.module

    @property
    def name(self) -> str:
        return f"{self.module}:{self.operator}:{self.occurrence}"


@dataclass
class Verdict:
    mutant: str
    line: int
    diff: str
    killed: bool
    by: list[str] = field(default_factory=list)     # e.g. ["conform/iwarp", "fuzz/roce"]
    at_start: bool = False
    seconds: float = 0.0
    detail: str = ""


def operators() -> list[tuple[str, object]]:
    """Every Cosmic Ray operator that takes no arguments, by name."""
    import cosmic_ray.plugins as plugins
    out = []
    for name in plugins.operator_names():
        cls = plugins.get_operator(name)
        if not cls.arguments():
            out.append((name, cls()))
    return out


def left_out(source: str, functions: tuple[str, ...] = ()) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every type annotation (the modules have ``from __future__ import
    annotations``, so a mutant there is never evaluated: equivalent by construction) and of
    the functions named in ``functions`` (the role's ``outside``)."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        notes: list = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in functions:
            notes = [node]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                     if x is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes
                  if n is not None and n.end_lineno is not None and n.end_col_offset is not None]
    return spans


def enumerate_mutants(role: Role = ROLES["target"]) -> list[Mutant]:
    """Every (module, operator, occurrence) Cosmic Ray can apply, outside type annotations.
    The occurrence counts every place, so a name means the same mutant with or without
    the filter."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    found = []
    ops = operators()
    for module in role.modules:
        path = PACKAGE / role.package / module
        tree = get_ast_from_path(path)
        skip = left_out(path.read_text(), role.outside)
        nodes = list(ast_nodes(tree))
        for name, op in ops:
            positions = [start for node in nodes for start, _ in op.mutation_positions(node)]
            found += [Mutant(module, name, i, start[0], role.package) for i, start in enumerate(positions)
                      if not any(a <= tuple(start) < b for a, b in skip)]
    return found


def mutated_source(m: Mutant) -> tuple[str, str]:
    """(original, mutated) source of the mutant's module."""
    import cosmic_ray.plugins as plugins
    from cosmic_ray.mutating import mutate_code
    original = m.path.read_text()
    mutated = mutate_code(original, plugins.get_operator(m.operator)(), m.occurrence)
    if mutated is None:
        raise ValueError(f"{m.name}: the operator found nothing to change there")
    return original, mutated


def diff_of(original: str, mutated: str, module: str) -> str:
    import difflib
    return "".join(difflib.unified_diff(original.splitlines(True), mutated.splitlines(True),
                                        f"a/{module}", f"b/{module}", n=0))


@contextlib.contextmanager
def package_copy(m: Mutant | None):
    """A directory holding a copy of kbtp_scapy with the mutant's module changed."""
    with tempfile.TemporaryDirectory(prefix="kbtp-mutant-") as tmp:
        shutil.copytree(PACKAGE, Path(tmp) / "kbtp_scapy",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        if m is not None:
            (Path(tmp) / "kbtp_scapy" / m.package / m.module).write_text(mutated_source(m)[1])
        yield tmp


class TargetProcess:
    """``kbtp target`` from ``pythonpath`` on loopback addresses of its own."""

    def __init__(self, pythonpath: str, transport: str, host: str, log: Path) -> None:
        self.url = f"{transport}://{host}:{PORTS[transport]}"
        env = {**os.environ, "PYTHONPATH": pythonpath}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [*KBTP, "target",
             "--transport", transport, "--listen", f"{host}:{PORTS[transport]}", *TARGET_OPTIONS],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=pythonpath)

    def ready(self, timeout: float = 15.0) -> bool:
        """Whether the target answers a HELLO (the probe the checkers make first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            probe = subprocess.run(
                [*KBTP, "conform", "--target", self.url,
                 *self.local(), "--only", "session.hello_ack.header", "--timeout", "1", "-q"],
                cwd=ROOT, env=CHECKER_ENV, capture_output=True, timeout=30)
            if probe.returncode in (0, 1):
                return True
            time.sleep(0.3)
        return False

    def local(self) -> list[str]:
        host = self.url.split("://")[1].rsplit(":", 1)[0]
        return ["--local", host[:-1] + "2"] if self.url.startswith("roce") else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def judge(pythonpath: str, tools: list[str], fuzz_cases: int, seed: int, timeout: float,
          net: int, workdir: Path, first_kill: bool = False) -> tuple[list[str], bool, str]:
    """Run the checkers against a target from ``pythonpath`` on each binding (with
    ``first_kill``, only until one kills it): which
    (tool/binding) exited non-zero, whether the target failed to start, and why."""
    by, detail = [], []
    for k, transport in enumerate(TRANSPORTS):
        host = f"127.71.{net % 250}.{2 * k + 1}"
        target = TargetProcess(pythonpath, transport, host, workdir / f"target-{transport}.log")
        try:
            if not target.ready():
                return [f"start/{transport}"], True, f"the {transport} target did not start or answer"
            commands = {tool: [sys.executable, __file__, f"--judge-{tool}", target.url, *target.local(),
                               "--fuzz-cases", str(fuzz_cases), "--seed", str(seed), "--timeout", str(timeout)]
                        for tool in ("conform", "fuzz")}
            for tool in tools:
                if by and first_kill:
                    break
                verdict(commands[tool], f"{tool}/{transport}", by, detail)
                if target.proc.poll() is not None:
                    by.append(f"crash/{transport}")
                    detail.append(f"the {transport} target exited ({target.proc.returncode})")
                    break
        finally:
            target.stop()
    return by, False, "; ".join(detail)


def verdict(command: list[str], name: str, by: list[str], detail: list[str]) -> None:
    """Run one judge (a ``--judge-*`` of this script); add ``name`` to ``by`` when it kills."""
    try:
        run = subprocess.run(command, cwd=ROOT, env=CHECKER_ENV, capture_output=True, text=True,
                             timeout=VERDICT_TIMEOUT)
        code, out = run.returncode, run.stdout + run.stderr
    except subprocess.TimeoutExpired:
        code, out = -1, f"no verdict within {VERDICT_TIMEOUT} s (a hang is a kill)"
    if code != 0:
        by.append(name)
        detail.append(f"{name} exit {code}: " + _gist(out))


def judge_initiator(pythonpath: str, tools: list[str], fuzz_cases: int, seed: int, timeout: float,
                    net: int, workdir: Path, first_kill: bool = False) -> tuple[list[str], bool, str]:
    """The initiator checkers, each with its checking target on loopback addresses of its
    own, running the initiator from ``pythonpath`` once per case."""
    by: list[str] = []
    detail: list[str] = []
    for k, transport in enumerate(TRANSPORTS):
        host, local = f"127.72.{net % 250}.{2 * k + 1}", f"127.72.{net % 250}.{2 * k + 2}"
        url = f"{transport}://{host}:{PORTS[transport]}"
        for tool in tools:
            if by and first_kill:
                break
            verdict([sys.executable, __file__, f"--judge-initiator-{tool}", url, "--program-path", pythonpath,
                     *(["--local", local] if transport == "roce" else []), "--fuzz-cases", str(fuzz_cases),
                     "--seed", str(seed), "--timeout", str(timeout)], f"{tool}/{transport}", by, detail)
    return by, False, "; ".join(detail)


def initiator_program(pythonpath: str, roce: bool) -> list[str]:
    """``kbtp initiator ... script`` from ``pythonpath`` (-P: not the checkout in the
    working directory), as the driver interface runs it."""
    return ["env", f"PYTHONPATH={pythonpath}", sys.executable, "-P", "-m", "kbtp_scapy", "initiator", "{url}",
            "--timeout", "{timeout}", *(["--local", "{local}"] if roce else []), "--id-file", "{state}/id",
            "script", "--ops", "{ops}", "--in", "{in}", "--out", "{out}"]


# -- the judges: the checkers as kbtp conform and kbtp fuzz run them, ending at the first verdict

async def judge_conform(url: str, local: str | None, timeout: float) -> int:
    """``kbtp conform --quick`` against ``url``, stopping at the first case that fails
    (or could not be judged): 1 then, else 0. A killed mutant needs one failure, and a
    broken target makes the remaining cases wait out their timeouts."""
    from kbtp_scapy.conform.cases import all_cases
    from kbtp_scapy.conform.registry import ERROR, FAIL, WARN
    from kbtp_scapy.conform.runner import RunState, probe, run_case
    from kbtp_scapy.harness import HarnessError
    from kbtp_scapy.wire.address import parse_url
    state = RunState()
    try:
        info = await probe(url, local, timeout, state)
    except HarnessError as exc:
        print(f"HARNESS {exc}")
        return 2
    for c in all_cases():
        out = await run_case(c, url, parse_url(url).transport, info, timeout=timeout, local=local,
                             pcap_dir=None, quick=True, state=state)
        if out.verdict in (FAIL, WARN, ERROR):
            print(f"{out.verdict} {c.id}: expected {out.expected}; seen {out.seen} {out.detail}")
            return 1
    return 0


async def judge_fuzz(url: str, local: str | None, timeout: float, cases: int, seed: int) -> int:
    """``kbtp fuzz --cases N --seed S`` against ``url``, stopping at the first finding
    (without minimizing it): 1 then, or when the fuzzer's sessions cannot be set up."""
    from kbtp_scapy.fuzz.cases import make_case
    from kbtp_scapy.fuzz.runner import Runner
    from kbtp_scapy.fuzz.state import SetupFault
    from kbtp_scapy.harness import HarnessError
    from kbtp_scapy.wire.address import parse_url
    runner = Runner(url, {"local": local} if local else {}, timeout)
    try:
        await runner.start()
        for index in range(cases):
            res = await runner.run_case(make_case(parse_url(url).transport, seed, index))
            if res.findings:
                f = res.findings[0]
                print(f"finding in case {index}: {f.kind}: {f.detail}"[:400])
                return 1
    except (HarnessError, SetupFault) as exc:
        print(f"finding: the fuzzer's set-up failed: {exc}")
        return 1
    finally:
        try:
            await asyncio.wait_for(runner.stop(), 2 * timeout)
        except Exception:
            pass
    return 0


async def judge_initiator_conform(url: str, local: str | None, timeout: float, pythonpath: str) -> int:
    """``kbtp conform --role initiator --quick``, stopping at the first case not passed."""
    from kbtp_scapy.conform.initiator.runner import all_cases, run
    from kbtp_scapy.conform.registry import ERROR, FAIL, WARN
    program = initiator_program(pythonpath, url.startswith("roce"))
    for c in all_cases():
        for out in await run(url, program, [c], timeout=timeout, local=local, quick=True):
            if out.verdict in (FAIL, WARN, ERROR):
                print(f"{out.verdict} {c.id}: expected {out.expected}; seen {out.seen} {out.detail}")
                return 1
    return 0


async def judge_initiator_fuzz(url: str, local: str | None, timeout: float, cases: int, seed: int,
                               pythonpath: str) -> int:
    """``kbtp fuzz --role initiator --cases N --seed S`` (no minimising): 1 on a finding."""
    from kbtp_scapy.conform.initiator import hostile
    program = initiator_program(pythonpath, url.startswith("roce"))
    summary = await hostile.campaign(program, url, seed=seed, count=cases, timeout=timeout,
                                     local=local or "", budget=0)
    for record in summary.findings:
        print(f"finding in case {record['case']}: " + "; ".join(
            f"{f['oracle']}: {f['detail']}" for f in record["findings"])[:400])
    if summary.error:
        print(f"finding: the hostile target's run failed: {summary.error}")
    return 1 if summary.findings or summary.error else 0


def judged_names(path: str) -> set[str]:
    """The mutants named in a --json report, or in a text file one a line (# starts a comment)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        return {v["mutant"] for v in json.loads(text)["mutants"]}
    return {ln.split("#")[0].strip() for ln in text.splitlines()} - {""}


def _gist(output: str) -> str:
    """The lines of a tool's output that say what failed."""
    lines = [ln.strip() for ln in output.splitlines()
             if ln.startswith(("FAIL", "WARN", "ERROR")) or "finding" in ln.lower() or "error" in ln.lower()]
    return " | ".join(lines[:3])[:400]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def score(verdicts: list[Verdict], tool: str | None = None) -> dict:
    """Killed over judged (by ``tool`` alone when given), with its interval."""
    n = len(verdicts)
    k = sum(v.killed and (tool is None or v.at_start or any(b.startswith(tool) for b in v.by))
            for v in verdicts)
    lo, hi = wilson(k, n)
    return {"killed": k, "judged": n, "score": round(k / n, 3) if n else None,
            "ci95": [round(lo, 3), round(hi, 3)]}


def markdown(doc: dict) -> str:
    both, conform, fuzz = doc["score"], doc["score_conform"], doc["score_fuzz"]
    role = ROLES[doc["role"]]
    flag = " --role initiator" if role.name == "initiator" else ""
    first_kill = "--first-kill" in doc["command"]

    def pct(s: dict) -> str:
        return (f"{s['killed']} of {s['judged']} ({100 * s['score']:.0f}%, 95% interval "
                f"{100 * s['ci95'][0]:.0f}-{100 * s['ci95'][1]:.0f}%)")
    lines = [
        f"# Mutation score of the {role.name} checkers", "",
        "Generated by `tools/mutants.py`; repeat with:", "",
        f"    {doc['command']}", "",
        f"{doc['population']} mutants of {role.what} ({', '.join(role.modules)}); a random sample "
        f"of {both['judged']} (seed {doc['seed']}) was judged, each by `kbtp conform{flag} --quick` and "
        f"`kbtp fuzz{flag} --cases {doc['fuzz_cases']}` on both bindings, in {doc['seconds'] / 60:.0f} minutes "
        f"({doc['seconds'] / max(1, both['judged']):.0f} s a mutant).", "",
        f"- killed by conform and fuzz together: {pct(both)}",
        f"- killed by conform alone: {pct(conform)}",
        f"- killed by fuzz alone: {pct(fuzz)}" + (" (not measured: with --first-kill fuzz judged only the "
                                                  "mutants conform left)" if first_kill else ""),
        f"- control (the unmutated {role.name}): {doc['control']}", "",
        "| mutant | line | killed by | change |", "| --- | --- | --- | --- |"]
    for v in doc["mutants"]:
        change = " → ".join(ln[1:].strip() for ln in v["diff"].splitlines()
                                if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
        by = "start" if v["at_start"] else ", ".join(v["by"]) or "**survived**"
        cell = html.escape(change[:160]).replace("|", "&#124;")
        lines.append(f"| `{v['mutant']}` | {v['line']} | {by} | <code>{cell}</code> |")
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, population: list[Mutant], started: float, control: str,
           verdicts: list[Verdict]) -> dict:
    """The run so far as a document, written to --json and --markdown (after every mutant,
    so a run stopped early still leaves its verdicts)."""
    doc = {"command": "nice .venv/bin/python tools/mutants.py " + " ".join(sys.argv[1:]), "role": args.role,
           "population": len(population), "seed": args.seed, "fuzz_cases": args.fuzz_cases,
           "seconds": round(time.monotonic() - started), "control": control,
           "score": score(verdicts), "score_conform": score(verdicts, "conform"),
           "score_fuzz": score(verdicts, "fuzz"), "mutants": [asdict(v) for v in verdicts]}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.markdown:
        page = Path(args.markdown)
        kept = page.read_text().partition(CLASSIFIED)[2] if page.exists() else ""
        page.write_text(markdown(doc) + (CLASSIFIED + kept if kept else ""))
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="count the mutants per module and operator, run nothing")
    ap.add_argument("--sample", type=int, default=50, help="mutants to judge (default 50; 0: all)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the sample and of the fuzz runs")
    ap.add_argument("--only", action="append", default=[], metavar="MUTANT", help="judge only this mutant")
    ap.add_argument("--tool", choices=("conform", "fuzz"), action="append", help="only this checker")
    ap.add_argument("--exclude", action="append", default=[], metavar="FILE",
                    help="draw the sample from the mutants not named in FILE (a --json report, or one "
                         "name a line): a new sample then adds only mutants not judged before")
    ap.add_argument("--role", choices=sorted(ROLES), default="target",
                    help="mutate the target's protocol core or the reference initiator's (default target)")
    ap.add_argument("--fuzz-cases", type=int, help="kbtp fuzz --cases (default 1000; 40 for --role initiator)")
    ap.add_argument("--timeout", type=float, help="the checkers' --timeout (default 3 s; 10 s for --role initiator)")
    ap.add_argument("--net", type=int, default=0, metavar="N",
                    help="the third octet of the loopback addresses the targets listen on starts at N "
                         "(default 0): two runs at once need ranges that do not meet")
    ap.add_argument("--json", metavar="FILE", help="write every verdict as JSON to FILE")
    ap.add_argument("--markdown", metavar="FILE", help="write the report as Markdown to FILE")
    ap.add_argument("--no-control", action="store_true", help="skip the run against the unmutated target")
    ap.add_argument("--first-kill", action="store_true",
                    help="stop judging a mutant at its first kill (faster; 'fuzz alone' then undercounts)")
    ap.add_argument("--judge-conform", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--judge-fuzz", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--judge-initiator-conform", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--judge-initiator-fuzz", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--program-path", help=argparse.SUPPRESS)
    ap.add_argument("--local", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the target of the mutant being judged is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    role = ROLES[args.role]
    if args.fuzz_cases is None:
        args.fuzz_cases = role.fuzz_cases
    if args.timeout is None:
        args.timeout = role.timeout
    if args.judge_initiator_conform:
        return asyncio.run(judge_initiator_conform(args.judge_initiator_conform, args.local, args.timeout,
                                                   args.program_path))
    if args.judge_initiator_fuzz:
        return asyncio.run(judge_initiator_fuzz(args.judge_initiator_fuzz, args.local, args.timeout,
                                                args.fuzz_cases, args.seed, args.program_path))
    if args.judge_conform:
        return asyncio.run(judge_conform(args.judge_conform, args.local, args.timeout))
    if args.judge_fuzz:
        return asyncio.run(judge_fuzz(args.judge_fuzz, args.local, args.timeout, args.fuzz_cases, args.seed))
    try:
        import cosmic_ray  # noqa: F401 - its operators make the mutants
    except ImportError:
        print("mutants.py: Cosmic Ray is not installed; run: .venv/bin/pip install -e '.[mutation]'",
              file=sys.stderr)
        return 2
    population = enumerate_mutants(role)
    judge_role = judge if role.name == "target" else judge_initiator
    if args.list:
        counts: dict[str, int] = {}
        for m in population:
            counts[f"{m.module} {m.operator}"] = counts.get(f"{m.module} {m.operator}", 0) + 1
        for key, n in sorted(counts.items()):
            print(f"{n:5}  {key}")
        print(f"{len(population)} mutants")
        return 0
    by_name = {m.name: m for m in population}
    if args.only:
        unknown = [n for n in args.only if n not in by_name]
        if unknown:
            ap.error(f"unknown mutant {unknown[0]} (see --list for the modules and operators)")
        sample = [by_name[n] for n in args.only]
    else:
        judged = set().union(*map(judged_names, args.exclude))
        fresh = [m for m in population if m.name not in judged]
        sample = random.Random(args.seed).sample(fresh, min(args.sample or len(fresh), len(fresh)))
    tools = args.tool or ["conform", "fuzz"]
    started = time.monotonic()
    verdicts: list[Verdict] = []
    control = "not run"
    with tempfile.TemporaryDirectory(prefix="kbtp-mutants-") as work:
        if not args.no_control:
            with package_copy(None) as copy:
                by, at_start, detail = judge_role(copy, tools, args.fuzz_cases, args.seed, args.timeout, args.net,
                                             Path(work))
            control = "passes" if not by else f"DOES NOT PASS ({detail})"
            print(f"control: {control}", file=sys.stderr)
            if by:
                return 2
        for i, m in enumerate(sample, 1):
            t0 = time.monotonic()
            original, mutated = mutated_source(m)
            workdir = Path(work) / f"m{i}"
            workdir.mkdir()
            with package_copy(m) as copy:
                by, at_start, detail = judge_role(copy, tools, args.fuzz_cases, args.seed, args.timeout,
                                                  args.net + i, workdir, args.first_kill)
            v = Verdict(m.name, m.line, diff_of(original, mutated, m.module), bool(by), by, at_start,
                        round(time.monotonic() - t0, 1), detail)
            verdicts.append(v)
            print(f"[{i}/{len(sample)}] {m.name:60} line {m.line:4} "
                  f"{'killed by ' + ','.join(by) if by else 'SURVIVED'} ({v.seconds:.0f} s)", file=sys.stderr)
            report(args, population, started, control, verdicts)
    doc = report(args, population, started, control, verdicts)
    s = doc["score"]
    print(f"killed {s['killed']} of {s['judged']} ({s['score']}, 95% interval {s['ci95']}); "
          f"conform alone {doc['score_conform']['score']}, fuzz alone {doc['score_fuzz']['score']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
