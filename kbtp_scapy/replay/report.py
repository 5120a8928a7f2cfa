"""The replay's findings as text lines or one JSON document."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from ..words import count
from .compare import FAILING, Verdict
from .sessions import Capture

STATES = ("match", "differ", "error", "skipped", "unchecked")


def _where(v: Verdict) -> str:
    step, ses = v.played.step, v.played.session
    if step is None:
        return f"session {ses.index} frame {ses.frame} HELLO"
    rid = step.fields.get("request_id")
    ident = f" rid={rid}" if step.kind == "request" and rid is not None else ""
    return f"session {ses.index} frame {step.frame} {step.name}{ident}"


def summary(loops: list[list[Verdict]]) -> dict[str, int]:
    counts = Counter(v.state for verdicts in loops for v in verdicts)
    return {state: counts.get(state, 0) for state in STATES}


def text(capture: Capture, url: str, loops: list[list[Verdict]], verbose: bool = False,
         interrupted: str | None = None, quiet: bool = False) -> list[str]:
    """One line per step that did not match (every step with ``verbose``), then totals;
    a replay stopped part-way says where. ``quiet``: only the steps that differ or
    failed, then the totals."""
    if quiet:
        return [*_steps(loops, lambda v: v.state in FAILING), _total(capture, loops, interrupted)]
    lines = [f"replay of {capture.path} ({count(len(capture.sessions), 'session')}) against {url}"]
    lines += [f"note: {n}" for n in capture.notes]
    lines += [f"note: session {s.index}: {n}" for s in capture.sessions for n in s.notes]
    if capture.ends:
        lines.append(f"note: {capture.ends}: the steps after it are not in the replay")
    if interrupted:
        lines.append(f"note: {interrupted}: the steps after it were not replayed")
    lines += _steps(loops, lambda v: verbose or v.state != "match" or bool(v.detail))
    return [*lines, _total(capture, loops, interrupted)]


def _steps(loops: list[list[Verdict]], shown: Callable[[Verdict], bool]) -> list[str]:
    """One line for each step ``shown`` picks, prefixed by its loop when there are several."""
    lines = []
    for number, verdicts in enumerate(loops, 1):
        prefix = f"loop {number}: " if len(loops) > 1 else ""
        for v in filter(shown, verdicts):
            reasons = "; ".join(d.describe() for d in v.differences) or v.detail
            lines.append(f"{prefix}{v.state.upper():9} {_where(v)}{': ' + reasons if reasons else ''}")
    return lines


def _total(capture: Capture, loops: list[list[Verdict]], interrupted: str | None) -> str:
    counts = summary(loops)
    verdict = result(capture, counts, interrupted).upper()
    return f"{verdict}: " + ", ".join(f"{counts[s]} {s}" for s in STATES)


def result(capture: Capture, counts: dict[str, int], interrupted: str | None) -> str:
    """different; interrupted or incomplete (the capture is cut short), a match of a part;
    or match."""
    if any(counts[s] for s in FAILING):
        return "different"
    return "interrupted" if interrupted else "incomplete" if capture.ends else "match"


def _verdict_json(v: Verdict) -> dict[str, Any]:
    step, ses = v.played.step, v.played.session
    out: dict[str, Any] = {"session": ses.index, "frame": step.frame if step else ses.frame,
                           "operation": step.name if step else "HELLO", "state": v.state}
    if step is not None and step.kind == "request" and "request_id" in step.fields:
        out["request_id"] = step.fields["request_id"]
        if "handle" in step.fields:
            out["handle"] = step.fields["handle"]
    for name, outcome in (("captured", v.played.captured), ("replayed", v.played.replayed)):
        if outcome is not None:
            out[name] = {k: (x.hex() if isinstance(x, bytes) else x) for k, x in outcome.values().items()}
            out[name]["form"] = outcome.form
    if v.differences:
        out["differences"] = [d.as_json() for d in v.differences]
    if v.detail:
        out["detail"] = v.detail
    return out


def as_json(capture: Capture, url: str, loops: list[list[Verdict]], ignore: list[str],
            kept: set[int], interrupted: str | None = None) -> dict[str, Any]:
    counts = summary(loops)
    verdict = result(capture, counts, interrupted)
    return {
        "capture": capture.path, "target": url, "ignored": sorted(ignore),
        "sessions": [{"session": s.index, "transport": s.transport, "frame": s.frame,
                      "handle_base": s.ack.get("hello_ack.handle_base"),
                      "handle_count": s.ack.get("hello_ack.handle_count"),
                      "steps": len(s.steps), "notes": s.notes} for s in capture.sessions],
        "notes": capture.notes,
        "capture_ends": capture.ends,
        "interrupted": interrupted,
        "handles_kept": sorted(kept),
        "loops": [[_verdict_json(v) for v in verdicts] for verdicts in loops],
        "summary": counts,
        "result": "differ" if verdict == "different" else verdict,
    }
