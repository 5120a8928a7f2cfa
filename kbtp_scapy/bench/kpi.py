"""``kbtp bench --kpi``: the KV block transfer latency report, following the KPI of that name
in the IETF benchmarking methodology draft for AI inference fabrics, as understood here: the
latency of each block transfer, P50/P95/P99/P99.9 per trial, and over the repeated trials
their mean and spread (min, max). FREE moves no block data and is left out."""
from __future__ import annotations

from typing import Any

from .runner import Measured
from .stats import percentile

METRIC = "KV block transfer latency"
SOURCE = ("IETF benchmarking methodology draft for AI inference fabrics, KV block transfer "
          "latency KPI (as understood by kbtp bench)")
#: the KPI's percentiles
PERCENTILES = (50.0, 95.0, 99.0, 99.9)


def _key(p: float) -> str:
    return f"p{p:g}_us"


def report(runs: list[Measured], target: str, plan: dict[str, Any]) -> dict[str, Any]:
    """One entry per request kind and size: each trial's percentiles (us, nearest rank, from
    posting to completion) and their mean, min and max over the trials."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        for s in run.samples.values():
            if s.op == "FREE" or not s.latencies:
                continue
            ordered = sorted(s.latencies)
            trial = {"trial": run.trial or 1, "samples": len(ordered),
                     **{_key(p): round(percentile(ordered, p) / 1000, 2) for p in PERCENTILES}}
            if run.cut is not None:
                trial["partial"] = True
            groups.setdefault((s.op, s.size), []).append(trial)
    results = []
    for (op, size), trials in groups.items():
        spread = {}
        for p in PERCENTILES:
            values = [t[_key(p)] for t in trials]
            spread[_key(p)] = {"mean": round(sum(values) / len(values), 2), "min": min(values), "max": max(values)}
        results.append({"op": op, "bytes": size, "trials": trials, "across_trials": spread})
    return {"metric": METRIC, "source": SOURCE, "unit": "microseconds", "target": target,
            "plan": plan, "results": results}
