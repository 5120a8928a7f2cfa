"""``kbtp analyze --report DIR``: the analysis as an HTML page with two PNG plots beside it
(latency percentiles per opcode, requests per interval over time), readable offline.
Matplotlib is the checkout's optional extra ``[plot]``."""
from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

from ..extras import Extra, install
from .queries import Analysis

_PERCENTILES = ("p50", "p95", "p99", "p999")


def plots(result: Analysis, out: Path) -> list[str]:
    """latency.png and throughput.png in ``out``; their names."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"--report needs matplotlib: {install(Extra.PLOT)}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [s for s in result.stats if s["p50"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{s['opcode']}\n{s['status']}" for s in ok]
    for i, name in enumerate(_PERCENTILES):
        ax.bar([x + i * 0.2 for x in range(len(ok))], [s[name] * 1e6 for s in ok], width=0.2,
               label=name.replace("p999", "p99.9"))
    ax.set_xticks([x + 0.3 for x in range(len(ok))], labels, fontsize=7)
    ax.set_ylabel("latency, µs (request to COMPLETION)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=100)
    plt.close(fig)
    per_opcode: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in result.timeline:
        per_opcode[r["opcode"]][r["bin"]] += r["requests"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bins = sorted({b for counts in per_opcode.values() for b in counts})
    for opcode, counts in sorted(per_opcode.items()):
        ax.plot([b * result.interval_s for b in bins], [counts.get(b, 0) / result.interval_s for b in bins],
                label=opcode)
    ax.set_xlabel("seconds since the dataset's first message")
    ax.set_ylabel(f"requests per second (per {result.interval_s:g} s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    return ["latency.png", "throughput.png"]


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(key)))}</td>" for key, _ in columns)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value * 1e6:.0f}" if value < 10 else f"{value:g}"
    return "" if value is None else str(value)


def write(result: Analysis, out: Path) -> Path:
    """report.html and its plots in ``out``; the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    images = "".join(f'<img src="{name}" alt="{name}">' for name in plots(result, out))
    findings = [{"kind": f.kind, "severity": f.severity, "times": f.times, "message": f.message,
                 "evidence": ", ".join(f"{c} frame {n}" for c, n in f.evidence)} for f in result.findings]
    total = sum(result.counts.values())
    verdict = "no hazard found" if not total else f"{total} hazard(s): " + ", ".join(
        f"{n} {k}" for k, n in sorted(result.counts.items()))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kbtp analyze</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:2px 6px;text-align:left}}img{{max-width:48%;margin:4px}}</style>
</head><body>
<h1>KBTP capture analysis</h1>
<p>{result.messages} KBTP messages in {result.captures} capture(s), {result.sessions} session(s),
{result.targets} target(s).</p>
<h2 id="hazards">Hazards</h2><p>{html.escape(verdict)}</p>
{_table(findings, [("kind", "kind"), ("severity", "whose"), ("times", "times"), ("message", "what"),
                   ("evidence", "frames (the first time)")])}
<h2 id="latency">Latency per opcode and status (µs)</h2>
{_table(result.stats, [("opcode", "opcode"), ("status", "status"), ("count", "count"), ("p50", "p50"),
                       ("p95", "p95"), ("p99", "p99"), ("p999", "p99.9"), ("max", "max")])}
{images}
<h2 id="sessions">Sessions (latency in µs)</h2>
{_table(result.sessions_table, [("session", "session (Initiator ID)"), ("initiator", "initiator"),
                                ("target", "target"), ("requests", "requests"), ("ok", "OK"),
                                ("refused", "refused"), ("unanswered", "unanswered"), ("p50", "p50"),
                                ("p99", "p99")])}
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path
