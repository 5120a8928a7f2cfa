"""``kbtp bench --plot FILE``: the latency distribution and the throughput over time, as PNG
or SVG (by FILE's suffix). Matplotlib is the checkout's optional extra ``[plot]``: well kept,
both formats from one renderer, no display needed (Agg)."""
from __future__ import annotations

from pathlib import Path

from .runner import Measured

FORMATS = (".png", ".svg")
#: throughput is counted in intervals of this many seconds
STEP = 0.1


def write(path: str, runs: list[Measured], title: str) -> None:
    """One row per size: latency histogram (log x) and throughput over time."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: give a .png or .svg file")
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install '.[plot]' in the checkout "
                          "(tools/install.sh installs it)") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for (dist, over_time), run in zip(axes, runs):
        for s in run.samples.values():
            if not s.latencies:
                continue
            us = [ns / 1000 for ns in s.latencies]
            lo, hi = min(us), max(us)
            bins = [lo * (hi / lo) ** (i / 60) for i in range(61)] if hi > lo else 10
            dist.hist(us, bins=bins, histtype="step", label=f"{s.op} ({len(us)})")
            points = s.throughput(STEP, run.seconds)
            over_time.plot([t for t, _ in points], [r for _, r in points], label=s.op)
        dist.set(xscale="log", xlabel="latency [us]", ylabel="requests",
                 title=f"{run.size} octets: latency")
        over_time.set(xlabel="time [s]", ylabel="ops/s", title=f"{run.size} octets: throughput")
        over_time.set_ylim(bottom=0)          # a dip reads as the share of the rate it is
        for ax in (dist, over_time):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
