"""``kbtp analyze``: statistics and hazards of one capture or a fleet's, on DuckDB."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from ..analyze.rows import CaptureError
from ..decode import Reader, Stats, capture_files, rdma_messages
from ..extras import Extra, lacking
from ..words import count
from .errors import Exit
from .options import Output, needs


def _captures(inputs: tuple[str, ...]) -> tuple[list[Path], list[Path]]:
    """(capture files, Parquet datasets) among the inputs: a folder holding ``*/*.parquet``
    is a dataset ``--parquet`` wrote; any other folder stands for its captures."""
    files, datasets = [], []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            if any(path.glob("*/*.parquet")):
                datasets.append(path)
                continue
            found = capture_files(path)
            if not found:
                raise click.BadParameter(f"{text}: no .pcap or .pcapng file and no dataset in it",
                                         param_hint="CAPTURE")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise click.BadParameter(f"{text}: no such file or folder", param_hint="CAPTURE")
    return files, datasets


class _Progress:
    """``decoding 3/120: NAME 41%`` on a terminal's stderr, rewritten in place."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.last = total, enabled, 0.0

    def __call__(self, done: int, path: Path, position: int) -> None:
        now = time.monotonic()
        if self.enabled and now - self.last > 0.2:
            self.last = now
            size = path.stat().st_size or 1
            click.echo(f"\rdecoding {done + 1}/{self.total}: {path.name[:50]} {100 * position // size}%",
                       err=True, nl=False)

    def clear(self) -> None:
        if self.enabled:
            click.echo("\r" + " " * 80 + "\r", err=True, nl=False)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def _text(result: Any) -> str:
    lines = [f"{result.messages} KBTP messages in {result.captures} capture(s), "
             f"{result.sessions} session(s), {result.targets} target(s)", ""]
    head = ("opcode", "status", "count", "p50 µs", "p95 µs", "p99 µs", "p99.9 µs", "max µs")
    rows = [(s["opcode"], s["status"], str(s["count"]), _us(s["p50"]), _us(s["p95"]), _us(s["p99"]),
             _us(s["p999"]), _us(s["max"])) for s in result.stats]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    lines.append("")
    total = sum(result.counts.values())
    if not result.messages:
        lines.append("nothing to judge: no KBTP message")
    elif not total:
        lines.append("no hazard found")
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items()))
        lines.append(f"{total} hazard(s): {kinds}")
        for f in result.findings:
            proof = ", ".join(f"{c} frame {n}" for c, n in f.evidence)
            where = f"{f.times} times; the first: {proof}" if f.times > 1 else proof
            lines.append(f"  [{f.kind}] ({f.severity}) {f.message} [{where}]")
        shown = sum(f.times for f in result.findings)
        if shown < total:
            lines.append(f"  ... and {total - shown} more not listed")
    return "\n".join(lines)


@click.command()
@click.argument("captures", nargs=-1, required=True, metavar="CAPTURE...")
@click.option("--parquet", "parquet", type=Output(folder=True, path_type=Path),
              help="Keep the decoded messages as a Parquet dataset in this folder (one folder per "
                   "capture); give the folder back to analyze it again without decoding.")
@click.option("--json", "as_json", is_flag=True, help="The statistics, sessions, timeline and hazards as one "
              "JSON object.")
@click.option("--report", type=Output(folder=True, path_type=Path), callback=needs(Extra.PLOT, "matplotlib"),
              help="Also write report.html, latency.png and throughput.png into this folder.")
@click.option("--dask", "scheduler", metavar="HOST:PORT|local", callback=needs(Extra.ANALYZE, "distributed"),
              help="Decode and judge on a Dask cluster (its scheduler's address), or on a local one of "
                   "--workers processes: for captures that do not fit one machine. Workers must see "
                   "the captures and the --parquet folder at the same paths (--dask local: a "
                   "temporary folder without --parquet).")
@click.option("--workers", type=click.IntRange(1, 256), default=2, show_default=True,
              help="Worker processes of --dask local.")
@click.option("--fail-on-hazard", is_flag=True, help="Exit 1 when a hazard is found (for CI).")
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
def analyze(captures: tuple[str, ...], parquet: Path | None, as_json: bool, report: Path | None,
            scheduler: str | None, workers: int, fail_on_hazard: bool, quiet: bool) -> None:
    """Statistics and hazards of one capture or many (files, folders of captures, or a
    dataset written by --parquet), read together as one fleet's traffic.

    Latency percentiles per opcode and status, and the hazards KV-cache systems suffer,
    each with the frames that prove it: a LOAD answered with another Generation than the
    one last stored or with a freed block (stale reads); a LOAD of a freed or re-bound
    handle that did not pin its Generation; requests never answered; answers slower than a
    bound derived from the dataset; more requests in flight than the credits granted;
    BINDs near or after the Ticket Timeout (from the FetchAdd that took the ticket);
    initiators at their quota; COMPLETIONs that answer nothing. Direct Loads are followed
    through their RDMA Reads: a block read on the word of an entry the handle's free or
    re-bind made stale, never confirmed, is a stale read too; a completion record (RECORD)
    answers its request as a COMPLETION does. A store in one host's capture and a load in
    another's are compared by their capture times. Queries run on DuckDB, embedded.

    Exit status: 0 analysed (1 with --fail-on-hazard when a hazard is found, or when there
    is no KBTP message to judge), 2 usage error or a capture that cannot be read, 130
    interrupted (Ctrl-C).

    \b
    Examples:
      kbtp analyze pcaps/roce_session.pcap
      kbtp analyze pcaps/fleet/                      # every capture of the folder, as one fleet
      kbtp analyze --json pcaps/fleet/ | python3 -m json.tool
      kbtp analyze --parquet fleet.parquet pcaps/fleet/ && kbtp analyze fleet.parquet
      kbtp analyze --report fleet-report pcaps/fleet/      # HTML and PNG plots
      kbtp analyze --dask local --workers 2 pcaps/fleet/   # the same on a Dask cluster
    """
    missing = lacking("kbtp analyze", Extra.ANALYZE, "duckdb", "pyarrow")
    if missing:
        raise Exit(2, missing)
    files, datasets = _captures(captures)
    if datasets and (files or len(datasets) > 1):
        raise click.UsageError("give one Parquet dataset alone, or capture files and folders")
    if scheduler is not None:
        result = _on_dask(files, datasets[0] if datasets else parquet, scheduler, workers, quiet)
    else:
        result = _here(files, datasets[0] if datasets else parquet, quiet)
    if report is not None:
        from ..analyze import report as html_report
        try:
            page = html_report.write(result, report)
        except ImportError as exc:
            raise Exit(2, str(exc)) from None
        except OSError as exc:
            raise Exit(2, f"--report {report}: {exc.strerror or exc}") from None
        click.echo(f"report: {page}", err=True)
    if as_json:
        body = asdict(result)
        body["bounds"] = [{"target": t, "opcode": o, "slow_s": b} for (t, o), b in sorted(result.bounds.items())]
        body["findings"] = [{**asdict(f), "evidence": [{"capture": c, "frame": n} for c, n in f.evidence]}
                            for f in result.findings]
        click.echo(json.dumps(body, default=str))
    else:
        click.echo(_text(result))
    if not result.messages:
        click.echo(f"kbtp analyze: {_nothing(files)}", err=True)
        if fail_on_hazard:
            raise Exit(1, "nothing to judge: no KBTP message, so no hazard could be looked for")
    if result.counts and fail_on_hazard:
        raise Exit(1, f"{sum(result.counts.values())} hazard(s) found")


def _nothing(files: list[Path]) -> str:
    """Why there is no message, as ``kbtp decode`` says it: how many frames were read and
    how many were cut by the snap length (a capture on the wrong interface, or cut short)."""
    if not files:
        return "no KBTP message in the dataset"
    stats = Stats()
    for path in files:
        try:
            with open(path, "rb") as stream:
                for _ in rdma_messages(Reader(stream, str(path)), stats):
                    pass
        except (OSError, CaptureError):
            continue                        # already reported while decoding
    return f"no KBTP message in {count(stats.frames, 'frame')}{stats.cut_note()}"


def _here(files: list[Path], out: Path | None, quiet: bool) -> Any:
    """Decode and judge in this process, on DuckDB."""
    from ..analyze import dataset, queries
    with tempfile.TemporaryDirectory(prefix="kbtp-analyze-") as scratch:
        out = out or Path(scratch)
        if files:
            progress = _Progress(len(files), not quiet and sys.stderr.isatty())
            def damaged(path: Path, why: str) -> None:
                progress.clear()
                _damaged(path, why)
            try:
                dataset.write(files, out, progress, damaged)
            except CaptureError as exc:
                raise Exit(2, f"{exc}; give a pcap or pcapng capture") from None
            except OSError as exc:
                raise Exit(2, f"cannot write the dataset in {out}: {exc.strerror or exc}") from None
            finally:
                progress.clear()
        return queries.analyze(out)


def _damaged(path: Path, why: str) -> None:
    """The one line of a capture that ends early, on either path."""
    click.echo(f"kbtp analyze: {path}: {why}; its messages before that are analysed", err=True)


def _on_dask(files: list[Path], out: Path | None, scheduler: str, workers: int, quiet: bool) -> Any:
    """Decode and judge on a Dask cluster (``analyze/distributed.py``)."""
    if files and out is None and scheduler != "local":
        raise click.UsageError("--dask HOST:PORT needs --parquet DIR, a folder every worker sees, for the "
                               "decoded captures")
    with tempfile.TemporaryDirectory(prefix="kbtp-analyze-") as scratch:
        return _cluster(files, out or Path(scratch), scheduler, workers, quiet)


def _cluster(files: list[Path], out: Path, scheduler: str, workers: int, quiet: bool) -> Any:
    from ..analyze import distributed
    try:
        client = distributed.client(None if scheduler == "local" else scheduler, workers)
    except OSError as exc:
        raise Exit(2, f"--dask {scheduler}: no Dask scheduler answered ({exc}); give its HOST:PORT "
                      "or 'local'") from None
    show = not quiet and sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            click.echo(f"\rdecoded {done}/{total} captures on the cluster", err=True, nl=False)

    def damaged(path: Path, why: str) -> None:
        if show:
            click.echo("\r" + " " * 60 + "\r", err=True, nl=False)
        _damaged(path, why)
    with client:
        try:
            return distributed.analyze(files, out, client, progress, damaged)
        except CaptureError as exc:
            raise Exit(2, f"{exc}; give a pcap or pcapng capture") from None
        finally:
            if show:
                click.echo("\r" + " " * 60 + "\r", err=True, nl=False)
