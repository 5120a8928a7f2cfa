"""The same analysis on a Dask cluster, for a fleet whose captures do not fit one machine.

Dask distributed rather than Spark: it is Python all the way (no JVM to install on every
worker, nothing to translate), it schedules plain functions, and its ``LocalCluster`` is a
real scheduler with worker processes, which the suite runs. The work splits where it is
independent: each capture is decoded into the dataset by a worker, then each target's
rows are judged by the checkers' own DuckDB queries on a worker (every checker looks at
one target's rows at a time: a handle's history, a session, a bound), and each opcode's
statistics likewise. Workers must see the dataset's folder at the same path (a shared or
network file system, as Dask's Parquet readers expect).
"""
from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import dataset as D, queries as Q


def _decode(path: str, out: str, name: str) -> str | None:
    """Decode one capture into the dataset; why it ended early, if it did."""
    from .rows import capture_rows
    why: list[str] = []
    D.write_capture(capture_rows(path, name, damaged=why.append), Path(out), name)
    return why[0] if why else None


def _judge(out: str, target: str | None) -> tuple[list[Q.Finding], dict, dict[str, int], list]:
    con = Q.connect(Path(out), "target", target)
    found, limits = Q.findings(con)
    return found, limits, Q.totals(con), Q.sessions(con)


def _statistics(out: str, opcode: str, first: float, interval: float) -> tuple[list, list]:
    con = Q.connect(Path(out), "opcode_name", opcode)
    return Q.statistics(con), Q.timeline(con, first, interval)


def client(scheduler: str | None, workers: int) -> Any:
    """A client of the cluster at ``scheduler`` (host:port), or of a local one."""
    from distributed import Client
    if scheduler:
        return Client(scheduler, timeout=30)
    # Ctrl-C is the command's to answer: workers started with SIGINT ignored (a Python that
    # starts so keeps it ignored) do not die mid-task, each with a traceback; and the client
    # makes the cluster, so closing it closes the cluster (not an atexit hook a late Ctrl-C
    # interrupts, with another traceback)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return Client(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, host="127.0.0.1")
    finally:
        signal.signal(signal.SIGINT, before)


def analyze(files: list[Path], out: Path, dask: Any,
            progress: Callable[[int, int], None] | None = None,
            damaged: Callable[[Path, str], None] | None = None) -> Q.Analysis:
    """Decode ``files`` into ``out`` on the cluster (none: ``out`` is already a dataset),
    then judge it there. ``damaged`` hears each capture that ended early and why, as
    ``dataset.write`` says it: its messages before the damage are in the dataset."""
    from distributed import as_completed
    if files:
        futures = {dask.submit(_decode, str(p), str(out), n, pure=False): p
                   for p, n in zip(files, D.names(files), strict=True)}
        for done, future in enumerate(as_completed(futures), 1):
            why = future.result()
            if why is not None and damaged is not None:
                damaged(futures[future], why)
            if progress is not None:
                progress(done, len(futures))
    con = Q.connect(out)
    targets = [r[0] for r in con.execute("SELECT DISTINCT target FROM m").fetchall()]
    opcodes = [r[0] for r in con.execute(
        "SELECT DISTINCT opcode_name FROM m WHERE opcode_name IN "
        f"{Q.REQUEST_NAMES}").fetchall()]
    captures = con.execute("SELECT count(DISTINCT capture) FROM m WHERE rdma_op IS NULL").fetchone()[0]
    first, interval = Q.span(con)
    con.close()
    judged = dask.gather([dask.submit(_judge, str(out), t, pure=False) for t in targets])
    stats = dask.gather([dask.submit(_statistics, str(out), o, first, interval, pure=False) for o in opcodes])
    found: list[Q.Finding] = []
    limits: dict = {}
    table: list[dict[str, Any]] = []
    messages = sessions = 0
    for part, part_limits, part_totals, part_sessions in judged:
        found += part
        limits.update(part_limits)
        messages += part_totals["messages"]
        sessions += part_totals["sessions"]
        table += part_sessions
    listed, counts = Q.summarize(found)
    rows = sorted((r for part, _ in stats for r in part), key=lambda r: (r["opcode"], r["status"]))
    times = sorted((r for _, part in stats for r in part), key=lambda r: (r["bin"], r["opcode"], r["status"]))
    return Q.Analysis(messages, captures, sessions, len(targets), rows, limits, listed, counts,
                      sorted(table, key=lambda r: r["session"]), interval, times)
