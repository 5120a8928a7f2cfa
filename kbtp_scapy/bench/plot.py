"""``kbtp bench --plot FILE``: the latency distribution and the throughput over time, as PNG
or SVG (by FILE's suffix). Matplotlib is the checkout's optional extra ``[plot]``: well kept,
both formats from one renderer, no display needed (a ``Figure`` of its own, no pyplot)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..extras import Extra, install
from .runner import Measured

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg")
#: throughput is counted in intervals of this many seconds
STEP = 0.1
#: latencies spanning fewer decades than these get a linear axis, or labels at 1, 2 and 5 of
#: each decade on a log axis; a wider span has them at each decade
LINEAR_BELOW, ONE_TWO_FIVE_BELOW = 1.0, 2.0


def write(path: str, runs: list[Measured], title: str) -> None:
    """The figure of ``runs`` in ``path``, PNG or SVG."""
    if Path(path).suffix.lower() not in FORMATS:
        raise ValueError(f"{path}: give a .png or .svg file")
    figure(runs, title).savefig(path)


def figure(runs: list[Measured], title: str) -> Figure:
    """One row per size: latency histogram and throughput over time."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"--plot needs matplotlib: {install(Extra.PLOT)}") from None
    fig = Figure(figsize=(11, 3.6 * len(runs)))
    axes = fig.subplots(len(runs), 2, squeeze=False)
    for (dist, over_time), run in zip(axes, runs):
        spans = []
        for s in run.samples.values():
            if not s.latencies:
                continue
            us = [ns / 1000 for ns in s.latencies]
            lo, hi = min(us), max(us)
            spans += [lo, hi]
            bins = [lo * (hi / lo) ** (i / 60) for i in range(61)] if hi > lo > 0 else 10
            dist.hist(us, bins=bins, histtype="step", label=f"{s.op} ({len(us)})")
            points = s.throughput(STEP, run.seconds)
            over_time.plot([t for t, _ in points], [r for _, r in points], label=s.op)
        if spans:
            _latency_axis(dist, min(spans), max(spans))
        dist.set(xlabel="latency [us]", ylabel="requests", title=f"{run.size} octets: latency")
        over_time.set(xlabel="time [s]", ylabel="ops/s", title=f"{run.size} octets: throughput")
        over_time.set_ylim(bottom=0)          # a dip reads as the share of the rate it is
        for ax in (dist, over_time):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _latency_axis(ax: Axes, lo: float, hi: float) -> None:
    """Plain numbers that do not overlap. Matplotlib's log axis labels its minor ticks too
    when the data span under two decades, in scientific notation, run together
    ("2×10²3×10²"); under one decade a log axis has no tick worth its name."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    decades = math.log10(hi / lo) if lo > 0 else 0.0
    if decades < LINEAR_BELOW:
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
        return
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5) if decades < ONE_TWO_FIVE_BELOW else (1,)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
