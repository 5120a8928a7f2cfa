"""Run documented commands as a user would, in a sandbox of the test's own.

``Sandbox(tmp_path)`` is a scratch copy of the checkout (the package, the dissector, the
sample pcaps, docs/) with a HOME of its own and ``kbtp`` on PATH, so commands run as written
from the checkout's root and whatever they write stays in the copy. ``run(lines)`` runs them
in order in a fresh network namespace (and a mount namespace with a private /run/netns, so
``ip netns add`` names are ours too): 127.0.0.1:4791, 127.0.0.1:5420 and any address a line
names are the sandbox's, never the host's. A target the lines talk to but do not start is
started for them first, on its defaults (not for a URL a line gives ``--listen``: it listens
there itself). Lines that start ``kbtp target`` serve: they are started, waited for until
they listen, and stopped with Ctrl-C.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).with_name("sandbox_driver.py")
COPIED = ("kbtp_scapy", "dissector", "pcaps", "docs")
URL = re.compile(r"\b(roce|iwarp)://(\[[0-9a-fA-F:]+\]|[0-9.]+)(?::(\d+))?")
PORTS = {"roce": 4791, "iwarp": 5420}


def serves(line: str) -> bool:
    """A line that runs until interrupted: the reference target."""
    return re.search(r"(^|\s)kbtp target(\s|$)", line) is not None


#: a URL a line listens on itself (``kbtp conform --role initiator --listen URL``): no target
#: A whole campaign (conformance, fuzzing, the demo, a benchmark): tens of seconds each, so
#: the fast subset (-m 'not slow') leaves docs blocks and --help examples that run one to
#: the full suite. Listing cases or coverage is quick.
CAMPAIGN = re.compile(r"\bkbtp (?:conform|fuzz|demo|bench)\b(?![^\n]*--(?:list|coverage|help)\b)")


def campaign_marks(text: str) -> tuple:
    """``pytest.mark.slow`` for a block or example list that runs a campaign."""
    return (pytest.mark.slow,) if CAMPAIGN.search(text) else ()


LISTENS = re.compile(r"--listen[ =]" + URL.pattern)


def named_targets(lines: list[str]) -> list[tuple[str, str, int]]:
    """(transport, host, port) of every target URL the lines name, in order of appearance,
    but for those a line listens on itself."""
    found = {}
    for line in lines:
        for transport, host, port in URL.findall(LISTENS.sub("", line)):
            key = (transport, host.strip("[]"), int(port or PORTS[transport]))
            found.setdefault(key, None)
    return list(found)


@dataclass
class Step:
    line: str
    rc: int | None
    stdout: str
    stderr: str
    started: bool | None = None        # a serving line: did it come up and listen
    target: bool = False                # a target the sandbox started or a line left serving
    interrupted: bool = False           # a long run, stopped with Ctrl-C while it was fine

    @property
    def ok(self) -> bool:
        """It ended well: exit 0, or a Ctrl-C'd long run ending as Ctrl-C should (130)."""
        if self.interrupted:
            return self.rc in (0, 130) and "Traceback" not in self.stderr
        return self.rc == 0 and self.started is not False

    def why(self) -> str:
        return (f"$ {self.line}\nexit {self.rc}{'' if self.started is not False else ', never listened'}"
                f"\n--- stdout\n{self.stdout[-1500:]}\n--- stderr\n{self.stderr[-1500:]}")


class Sandbox:
    def __init__(self, tmp_path: Path) -> None:
        if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
            pytest.skip("the sandbox needs root, unshare and ip (network namespaces)")
        self.dir = tmp_path
        self.checkout = tmp_path / "checkout"
        for name in COPIED:
            shutil.copytree(ROOT / name, self.checkout / name, symlinks=True)
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.env = {"HOME": str(self.home), "LANG": "C.UTF-8", "TERM": "dumb",
                    "PYTHONPATH": str(self.checkout),
                    "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin"}
        self.runs = 0

    def run(self, lines: list[str], *, keep_servers: bool = True, timeout: float = 300,
            interrupt: dict[str, float] | None = None, names: str = "") -> list[Step]:
        """Run ``lines`` in one fresh namespace; one Step per line (serving lines last,
        when they are stopped), then the targets started for them.

        ``keep_servers``: serving lines stay up for the lines after them (a README block);
        otherwise each is stopped once it listens (a list of --help examples). ``interrupt``:
        lines that run long, and after how many seconds they get Ctrl-C. ``names``: more
        text whose target URLs count (a script the lines run). ``timeout``: each line's bound,
        for a hang, not for speed: ``kbtp demo`` takes about 30 s alone and passed 120 s on a
        loaded 2-core CI machine, its steps running 4-12 times slower there."""
        self.runs += 1
        brought = [] if any(serves(line) for line in lines) else named_targets([*lines, names])
        addresses = sorted({host for _, host, _ in brought if not ipaddress.ip_address(host).is_loopback})
        spec = {
            "cwd": str(self.checkout), "env": self.env, "addresses": addresses,
            "targets": [f"kbtp target --transport {t} --listen {h if ':' not in h else f'[{h}]'}:{p}"
                        for t, h, p in brought],
            "steps": [{"line": line, "serve": serves(line), "keep": keep_servers, "timeout": timeout,
                       "interrupt": (interrupt or {}).get(line)} for line in lines],
        }
        spec_path = self.dir / f"spec{self.runs}.json"
        result_path = self.dir / f"result{self.runs}.json"
        spec_path.write_text(json.dumps(spec))
        budget = 60 + sum(s["timeout"] for s in spec["steps"]) + 30 * len(spec["targets"])
        proc = subprocess.run(["unshare", "--net", "--mount", sys.executable, str(DRIVER),
                               str(spec_path), str(result_path)],
                              capture_output=True, text=True, timeout=budget)
        if not result_path.exists():
            if "unshare" in proc.stderr and "Operation not permitted" in proc.stderr:
                pytest.skip(f"cannot make namespaces here: {proc.stderr.strip()}")
            raise AssertionError(f"the sandbox failed: {proc.stderr}")
        steps = []
        for r in json.loads(result_path.read_text()):
            steps.append(Step(r["line"], r["rc"], r["stdout"], r["stderr"], r.get("started"),
                              r.get("target", False), r.get("interrupted", False)))
        return steps

    def write(self, name: str, text: str) -> Path:
        path = self.checkout / name
        path.write_text(text)
        return path
