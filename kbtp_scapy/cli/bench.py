"""``kbtp bench URL``: ops/s, MB/s and latency percentiles of one operation against any KBTP
target, as a perftest-like table or JSON, with a terminal histogram and an optional plot."""
from __future__ import annotations

import csv
import json
import sys
from typing import Any

import click

from ..bench import kpi, runner
from ..bench.stats import histogram
from ..extras import Extra, install
from ..initiator import KbtpError, PeerLimit
from . import interrupt
from .errors import CONNECTION_ERRORS, Exit, file_trouble, hint, line, local_trouble, reason
from .interrupt import run_stoppable
from .options import (
    LOCAL_IS_ROCE,
    RAISE_LIMITS,
    Output,
    address,
    limit_options,
    limits,
    needs,
    raw_io,
    raw_io_options,
)

#: perftest-like columns: header, row key, width
COLUMNS = (("op", "op", 12), ("#bytes", "bytes", 8), ("#iterations", "iterations", 12),
           ("ops/s", "ops_per_s", 10), ("MB/sec", "mb_per_s", 9), ("Gb/s", "gbit_per_s", 8),
           ("t_min[usec]", "min", 12),
           ("t_p50", "p50", 9), ("t_p90", "p90", 9), ("t_p99", "p99", 9), ("t_p99.9", "p99.9", 9),
           ("t_max", "max", 9), ("CPU/op[usec]", "cpu_us_per_op", 13))
#: the column of --trials N, after #bytes: which trial of its size a row is
TRIAL = ("trial", "trial", 5)


def _sizes(ctx: click.Context, param: click.Parameter, given: tuple[str, ...]) -> list[int]:
    out = []
    for item in given:
        for part in item.split(","):
            try:
                out.append(int(part, 0))
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a size in octets") from None
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as perftest prints its results: a rule, the header, one line a row (with a
    trial column when the sizes were run more than once)."""
    columns = (*COLUMNS[:2], TRIAL, *COLUMNS[2:]) if any("trial" in row for row in rows) else COLUMNS
    rule = "-" * sum(w + 1 for _, _, w in columns)
    lines = [rule, " ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, _, w) in enumerate(columns))]
    for row in rows:
        values = {**row, **row.get("latency_us", {})}
        cells = []
        for i, (_, key, width) in enumerate(columns):
            value = values.get(key)
            text = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
            cells.append(f"{text:>{width}}" if i else f"{text:<{width}}")
        lines.append(" ".join(cells))
    return "\n".join([*lines, rule])


@click.command(context_settings={"max_content_width": 100})
@click.argument("url")
@click.option("--op", type=click.Choice(list(runner.OPERATIONS)), default="load", show_default=True,
              help="What each iteration does: load, store, alloc_store (ALLOC_STORE then FREE), "
                   "direct_load, direct_alloc (DIRECT_ALLOC then FREE).")
@click.option("-s", "--size", "sizes", multiple=True, callback=_sizes, metavar="OCTETS[,..]",
              help="Block data per request; repeat or list for several runs [default: the Block Size].")
@click.option("-a", "--all-sizes", is_flag=True,
              help="Sweep the sizes (perftest's -a): powers of two from 8 to the Block Size, a row each.")
@click.option("-q", "--qp", "connections", type=click.IntRange(1), default=1, show_default=True,
              help="Sessions at once (perftest's -q), each with its own Initiator ID and --in-flight "
                   "requests; the rows sum them.")
@click.option("-b", "--bidirectional", is_flag=True,
              help="Loads and stores at once (perftest's -b: both directions of block data), half "
                   "of --in-flight each, both reported.")
@click.option("-t", "--in-flight", type=click.IntRange(1), default=1, show_default=True,
              help="Requests in flight at once (perftest's -t), each on a handle of its own.")
@click.option("-D", "--duration", type=click.FloatRange(0.1), default=None, metavar="SECONDS",
              help="Run each size this long [default: 5 s, unless --iterations].")
@click.option("-n", "--iterations", type=click.IntRange(1), default=None,
              help="Run each size for this many iterations instead (perftest's -n).")
@click.option("--trials", type=click.IntRange(1), default=1, show_default=True,
              help="Run each size this many times (a row each), for --kpi's spread over trials.")
@click.option("--inline/--no-inline", default=None,
              help="Stores: data in the request, or RDMA-Read by the target [default: when it fits].")
@click.option("--local", default=None, metavar="ADDR", help="RoCEv2: local address to send from.")
@raw_io_options("bench")
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True, metavar="SECONDS",
              help="How long to wait for the connection and for each answer.")
@limit_options
@click.option("--pcap", type=Output(), default=None,
              help="Write every frame to this pcap (to check the times with tshark: kbtp.time).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout instead of text.")
@click.option("--csv", "csv_file", type=Output(dash=True), default=None,
              metavar="FILE", help="Also write the results as CSV to FILE, one row per operation and size "
                                   "('-': stdout instead of the table).")
@click.option("--kpi", "kpi_file", type=Output(dash=True), default=None,
              metavar="FILE", help="Also write the KV block transfer latency KPI as JSON to FILE: "
                                   "P50/P95/P99/P99.9 per trial, their mean, min and max over the "
                                   "trials ('-': stdout instead of the table).")
@click.option("--histogram/--no-histogram", "show_histogram", default=True, show_default=True,
              help="A latency histogram in the terminal after the table.")
@click.option("--plot", type=Output(), default=None, metavar="FILE", callback=needs(Extra.PLOT, "matplotlib"),
              help="PNG or SVG of the latency distribution and throughput over time "
                   f"(needs matplotlib: {install(Extra.PLOT)}).")
def bench(url: str, op: str, sizes: list[int], all_sizes: bool, connections: int, bidirectional: bool,
          in_flight: int, duration: float | None, iterations: int | None, trials: int, inline: bool | None,
          local: str | None, io: str, iface: str | None,
          raw_addr: str | None, device: str | None, timeout: float, max_block_size: int, max_blocks: int,
          pcap: str | None, as_json: bool, csv_file: str | None, kpi_file: str | None, show_histogram: bool,
          plot: str | None) -> None:
    """Benchmark the KBTP target at URL (roce://HOST[:PORT] or iwarp://HOST:PORT) in
    perftest's manner: one session (or --qp N), --in-flight requests at a time in each, each timed from posting
    to completion; ops/s, MB/s, latency min/p50/p90/p99/p99.9/max in microseconds, and the
    client's own CPU per operation (CPU/op, and cpu_percent in --json: near 100% the client,
    not the target, is the bottleneck).

    Exit status: 0 measured as asked; 1 the target failed: it refused a request, granted
    more than --max-block-size or --max-blocks allow, or failed during the run (the results
    until then are printed, marked partial); 2 usage error, the run could not start (no
    target answered at URL), or a plan the target cannot serve (a feature not granted, more
    in flight than its quota, a size over its Block Size); 130 interrupted by Ctrl-C or, as
    143, by SIGTERM (the results so far, marked partial).

    \b
    Examples (with kbtp target running):
      kbtp bench roce://127.0.0.1 --duration 2
      kbtp bench roce://127.0.0.1 --op alloc_store -s 64,4096 -t 8 -n 2000 --json
      kbtp bench iwarp://127.0.0.1:5420 --op direct_load -t 4 --duration 2 --no-histogram
      kbtp bench roce://127.0.0.1 --op store -t 16 --duration 2 --pcap bench.pcap
      kbtp bench roce://127.0.0.1 -s 512,4096 -n 2000 --csv bench.csv
      kbtp bench roce://127.0.0.1 -a -n 50 --no-histogram
      kbtp bench roce://127.0.0.1 -q 2 -t 4 --bidirectional -n 50 --no-histogram
      kbtp bench roce://127.0.0.1 --trials 3 -n 50 --kpi -
    """
    transport = url.split("://", 1)[0] if "://" in url else ""
    if transport not in ("iwarp", "roce"):
        raise click.BadParameter("must start with roce:// or iwarp://", param_hint="URL")
    if duration is not None and iterations is not None:
        raise click.UsageError("give --duration or --iterations, not both")
    if sizes and all_sizes:
        raise click.UsageError("give --size or --all-sizes, not both")
    if bidirectional and op != "load":
        raise click.UsageError("--bidirectional runs load and store; leave --op out")
    to_stdout = [name for name, given in (("--json", as_json), ("--csv -", csv_file == "-"),
                                          ("--kpi -", kpi_file == "-")) if given]
    if len(to_stdout) > 1:
        raise click.UsageError(f"{', '.join(to_stdout)}: only one can write to stdout; write the "
                               "others to files (--csv FILE, --kpi FILE)")
    if io == "verbs" and pcap:
        raise click.UsageError("--pcap records the soft RNIC's frames; with --io verbs capture "
                               "with tcpdump on the device's interface")
    if plot and not plot.lower().endswith((".png", ".svg")):
        raise click.BadParameter("give a .png or .svg file", param_hint="--plot")
    target = address(transport, url)
    options: dict[str, Any] = {"connect_timeout": timeout, **raw_io(transport, io, iface, raw_addr, device)}
    if local and transport == "iwarp" and io != "verbs":
        raise click.UsageError(LOCAL_IS_ROCE)
    if local:
        options["local"] = local
    plan = runner.Plan(str(target), op, sizes, in_flight, None if iterations else duration or 5.0,
                       iterations, inline, options, limits(max_block_size, max_blocks, timeout),
                       all_sizes=all_sizes, connections=connections, bidirectional=bidirectional,
                       trials=trials)
    sink = None
    if pcap:
        from ..rnic.pcap import PcapSink
        try:
            sink = PcapSink(pcap)
        except OSError as exc:
            raise file_trouble(pcap, exc, option="--pcap") from None
        plan.frame_listeners.append(sink)
    def stop() -> None:
        plan.interrupted = True

    try:
        runs = run_stoppable(lambda: runner.run(plan, lambda text: None if as_json else
                                                click.echo(f"kbtp bench: {text} ...", err=True)), stop)
    except runner.BenchError as exc:
        raise Exit(2, line(f"bench {target}", str(exc), "see 'kbtp bench --help'")) from None
    except runner.NotStarted as exc:
        what = local_trouble(exc.cause, target, local) or f"cannot benchmark {target}"
        raise Exit(2, line(what, reason(exc.cause, timeout), hint(exc.cause))) from None
    except runner.SessionRefused as exc:
        todo = ("fewer -q, or a larger --max-initiators on the target" if exc.error.name == "NO_SPACE"
                else "the target's log may say why")
        raise click.ClickException(line(f"bench {target}", str(exc), todo)) from None
    except PeerLimit as exc:
        raise click.ClickException(line(f"bench {target}: HELLO_ACK not usable", exc.detail, RAISE_LIMITS)) from None
    except KbtpError as exc:
        raise click.ClickException(line(f"bench {target}", str(exc), "the target's log may say why")) from None
    except CONNECTION_ERRORS as exc:
        what = local_trouble(exc, target, local) or f"cannot benchmark {target}"
        raise click.ClickException(line(what, reason(exc, timeout), hint(exc))) from None
    finally:
        if sink:
            sink.close()
    if not runs and plan.interrupted:
        raise Exit(interrupt.status(), f"bench: interrupted ({interrupt.how()}) before any request was measured")
    cut = runs[-1].cut
    what = "load+store" if bidirectional else op
    report = kpi.report(runs, str(target), {"op": what, "in_flight": in_flight,
                                            "connections": connections, "trials": trials,
                                            "iterations": iterations, "duration_s": plan.duration})
    if csv_file == "-":
        _write_csv(sys.stdout, runs)
    elif kpi_file == "-":
        click.echo(json.dumps(report, indent=1))
    else:
        _report(runs, target, what, in_flight, connections, as_json, show_histogram, cut)
    if kpi_file and kpi_file != "-":
        try:
            with open(kpi_file, "w") as out:
                json.dump(report, out, indent=1)
        except OSError as exc:
            raise file_trouble(kpi_file, exc, option="--kpi") from None
    if csv_file and csv_file != "-":
        try:
            with open(csv_file, "w", newline="") as out:
                _write_csv(out, runs)
        except OSError as exc:
            raise file_trouble(csv_file, exc, option="--csv") from None
    if plot:
        from ..bench.plot import write
        try:
            write(plot, runs, f"kbtp bench {what} {target}, {in_flight} in flight"
                  + (f" in each of {connections} sessions" if connections > 1 else "")
                  + (" (partial)" if cut is not None else ""))
        except ImportError as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:
            raise file_trouble(plot, exc, option="--plot") from None
        if not as_json:
            click.echo(f"\nwrote {plot}")
    done = f"the results above are of the {runs[-1].seconds:.1f} s measured until then, marked partial"
    if isinstance(cut, runner.Interrupted):
        raise Exit(interrupt.status(), f"bench: interrupted ({interrupt.how()}); {done}")
    if cut is not None:
        raise Exit(1, line(f"bench {target}: the connection ended", reason(cut, timeout), done))


#: the CSV's columns: the JSON row's, latencies flattened (lat_p50_us), and partial
CSV_COLUMNS = ("op", "bytes", "iterations", "errors", "seconds", "ops_per_s", "mb_per_s", "gbit_per_s",
               "lat_min_us", "lat_p50_us", "lat_p90_us", "lat_p99_us", "lat_p99.9_us", "lat_max_us",
               "lat_mean_us", "cpu_us_per_op", "cpu_percent", "partial", "trial")


def _write_csv(out: Any, runs: list[runner.Measured]) -> None:
    """One CSV row per operation and size, with a header: for a spreadsheet or a plot."""
    writer = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for run in runs:
        for row in run.rows():
            latency = {f"lat_{k}_us": v for k, v in row.get("latency_us", {}).items()}
            writer.writerow({**row, **latency, "partial": bool(row.get("partial"))})


def _ended(cut: BaseException | None) -> str | None:
    """Why the last size ended before its plan, for the JSON report."""
    if cut is None:
        return None
    return f"interrupted ({interrupt.how()})" if isinstance(cut, runner.Interrupted) else \
        f"the connection ended: {reason(cut)}"


def _report(runs: list[runner.Measured], target: Any, op: str, in_flight: int, connections: int, as_json: bool,
            show_histogram: bool, cut: BaseException | None) -> None:
    """The table and histograms, or the JSON document; a run cut short says so in both."""
    rows = [row for run in runs for row in run.rows()]
    if as_json:
        doc = {"target": str(target), "op": op, "in_flight": in_flight, "connections": connections,
               "results": rows}
        if cut is not None:
            doc.update(partial=True, ended=_ended(cut))
        click.echo(json.dumps(doc, indent=1))
        return
    click.echo(table(rows))
    if cut is not None:
        click.echo(f"partial: {_ended(cut)} after {runs[-1].seconds:.1f} s of the last size")
    if show_histogram:
        for run in runs:
            for s in run.samples.values():
                click.echo(f"\n{s.op} latency, {s.size} octets ({len(s.latencies)} requests):")
                click.echo("\n".join(histogram(s.latencies)))
