"""Saving findings (pcap + JSON), the summary table and the JSON document of a run."""
from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import words
from .cases import Case, Step
from .corpus import Corpus
from .findings import Finding
from .tally import Tally

EXIT_OK, EXIT_FINDING, EXIT_HARNESS, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass
class Saved:
    case: Case
    findings: list[Finding]
    minimized: list[Step]
    reproduced: bool
    json_path: str | None = None
    pcap_path: str | None = None
    recent: list[str] = field(default_factory=list)   # the cases in the pcap (a target gone)


@dataclass
class Summary:
    url: str
    seed: int
    replay_args: list[str] = field(default_factory=list)   # options a replay must repeat
    cases: int = 0
    seconds: float = 0.0
    reconnects: int = 0
    steps: Counter = field(default_factory=Counter)
    answers: Counter = field(default_factory=Counter)
    oracle: Tally = field(default_factory=Tally)
    saved: list[Saved] = field(default_factory=list)
    error: str | None = None
    stopped: str = ""
    interrupted: bool = False
    interrupted_status: int = EXIT_INTERRUPTED    # 143 when SIGTERM, not Ctrl-C, stopped it
    gone_at: str = ""             # the case during which the target went away (the last time)
    restarts: int = 0             # times --restart-cmd brought the target back
    corpus: Corpus | None = None  # --seed-corpus

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return self.interrupted_status
        if self.saved:                # the target misbehaved, even if the run could not go on
            return EXIT_FINDING
        return EXIT_HARNESS if self.error else EXIT_OK

    def replay(self, what: str) -> str:
        """The command that runs one case again, with every option this run needed."""
        return shlex.join(["kbtp", "fuzz", "--target", self.url, *self.replay_args, "--replay", what])


def finding_document(summary: Summary, s: Saved) -> dict[str, Any]:
    doc = {"case": s.case.name, "seed": s.case.seed, "index": s.case.index, "target": summary.url,
           "replay": summary.replay(s.case.name),
           "findings": [f.as_dict() for f in s.findings], "steps": s.case.steps,
           "minimized_steps": s.minimized, "reproduced_in_isolation": s.reproduced,
           "pcap": s.pcap_path}
    if s.recent:
        doc["cases_in_pcap"] = s.recent
    if s.json_path:
        doc["replay_minimized"] = summary.replay(s.json_path)
    return doc


def save(out: Path, summary: Summary, s: Saved) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{s.case.name}.json"
    s.json_path = str(path)
    path.write_text(json.dumps(finding_document(summary, s), indent=2, default=str) + "\n")


def as_json(summary: Summary) -> str:
    kinds = Counter(f.kind for s in summary.saved for f in s.findings)
    return json.dumps({
        "target": summary.url, "seed": summary.seed, "cases": summary.cases,
        "seconds": round(summary.seconds, 2), "reconnects": summary.reconnects,
        "steps": dict(sorted(summary.steps.items())), "answers": dict(sorted(summary.answers.items())),
        "finding_kinds": dict(kinds), "oracle": summary.oracle.as_dict(),
        "findings": [finding_document(summary, s) for s in summary.saved],
        "error": summary.error, "stopped": summary.stopped, "interrupted": summary.interrupted,
        "gone_at": summary.gone_at or None, "restarts": summary.restarts,
        "seed_corpus": {"digest": summary.corpus.digest, "requests": len(summary.corpus.seeds)}
        if summary.corpus else None,
        "exit_code": summary.exit_code,
    }, indent=2, default=str) + "\n"


def table(summary: Summary) -> str:
    """The summary printed at the end of a run."""
    rate = summary.cases / summary.seconds if summary.seconds else 0.0
    stopped = summary.stopped or ("interrupted" if summary.interrupted else "")
    lines = [f"kbtp fuzz {summary.url} seed {summary.seed}: {summary.cases} cases in "
             f"{summary.seconds:.1f} s ({rate:.0f}/s), {summary.reconnects} reconnects"
             + (f", seed corpus {summary.corpus.digest} ({words.count(len(summary.corpus.seeds), 'request')})"
                if summary.corpus else "")
             + (f", the target restarted {words.count(summary.restarts, 'time')}" if summary.restarts else "")
             + (f", stopped: {stopped}" if stopped else ""), "",
             f"{'step family':28} {'count':>8}", f"{'-' * 28} {'-' * 8}"]
    lines += [f"{k:28} {v:>8}" for k, v in sorted(summary.steps.items())]
    if summary.answers:
        lines += ["", "answers: " + ", ".join(f"{v} {k}" for k, v in sorted(summary.answers.items()))]
    if summary.oracle.judged or summary.oracle.unpredicted:
        lines += ["", *summary.oracle.lines()]
    lines += ["", f"{'case':24} {'kind':18} {'steps':>5} {'min':>4}  detail",
              f"{'-' * 24} {'-' * 18} {'-' * 5} {'-' * 4}  {'-' * 30}"]
    for s in summary.saved:
        for f in s.findings:
            lines.append(f"{s.case.name:24} {f.kind:18} {len(s.case.steps):>5} {len(s.minimized):>4}  {f.detail}")
    if not summary.saved:
        lines.append("(no findings)")
    for s in summary.saved[:1]:
        lines.append(f"replay: {summary.replay(s.json_path or s.case.name)}")
    if summary.error:
        lines.append(f"harness error: {summary.error}")
    return "\n".join(lines)
