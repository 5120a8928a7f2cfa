"""``kbtp fuzz --target URL``: the stateful protocol fuzzer's command line."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import click

from ..fuzz import report
from ..fuzz.cases import Case, make_case, parse_name
from ..fuzz.runner import Runner, minimize
from ..fuzz.state import HarnessError
from ..rnic import parse_url
from ..rnic.pcap import PcapSink


class _Exit(click.ClickException):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = code


async def _finding(url: str, options: dict, case: Case, kinds: set[str], out: Path | None,
                   budget: int) -> report.Saved:
    """Minimize on fresh sessions, replay the result once more with a capture, save it."""
    minimized = await minimize(lambda: Runner(url, options), case, kinds, budget)
    if out:
        out.mkdir(parents=True, exist_ok=True)
    pcap = out / f"{case.name}.pcap" if out else None
    sink = PcapSink(pcap) if pcap else None
    r = Runner(url, options, [sink] if sink else None)
    try:
        await r.start()
        res = await r.run_case(case, minimized)
        shown = [f for f in res.findings if f.kind in kinds]
    except HarnessError:
        shown = []
    finally:
        await r.stop()
        if sink:
            sink.close()
    saved = report.Saved(case, shown, minimized, bool(shown), pcap_path=str(pcap) if pcap else None)
    return saved


async def campaign(url: str, options: dict, seed: int, count: int, start: int, time_limit: float | None,
                   out: Path | None, budget: int, max_findings: int, progress: Callable[[int, report.Summary], None]) -> report.Summary:
    transport = parse_url(url).transport
    summary = report.Summary(url, seed)
    t0 = time.monotonic()
    runner = Runner(url, options)
    try:
        await runner.start()
        for index in range(start, start + count):
            if time_limit is not None and time.monotonic() - t0 > time_limit:
                summary.stopped = f"--time-limit {time_limit:g} s reached"
                break
            case = make_case(transport, seed, index)
            res = await runner.run_case(case)
            summary.cases += 1
            if res.findings:
                first = res.findings
                saved = await _finding(url, options, case, {f.kind for f in first}, out, budget)
                if not saved.reproduced:
                    saved.findings, saved.minimized = first, case.steps
                if out:
                    report.save(out, url, saved)
                summary.saved.append(saved)
                summary.reconnects += runner.world.reconnects
                if max_findings and len(summary.saved) >= max_findings:
                    summary.stopped = f"--max-findings {max_findings} reached"
                    break
                await runner.restart()
            progress(index - start + 1, summary)
    except HarnessError as exc:
        summary.error = str(exc)
    except Exception as exc:   # a fuzzer fault must end the run as a harness error, never a pass
        summary.error = f"{type(exc).__name__}: {exc}"
    finally:
        summary.reconnects += runner.world.reconnects if runner.world else 0
        summary.steps = Counter(runner.families)
        summary.seconds = time.monotonic() - t0
        try:
            await runner.stop()
        except Exception:   # the verdict is already made; a failing GOODBYE changes nothing
            pass
    return summary


async def replay_case(url: str, options: dict, what: str) -> report.Summary:
    """One case, by name (regenerated) or from a saved finding's JSON (its minimized steps)."""
    path = Path(what)
    if path.suffix == ".json" and path.exists():
        doc = json.loads(path.read_text())
        transport, seed, index = parse_name(doc["case"])
        case = Case(doc["case"], seed, index, doc["minimized_steps"] or doc["steps"])
    else:
        transport, seed, index = parse_name(what)
        case = make_case(transport, seed, index)
    if transport != parse_url(url).transport:
        raise click.UsageError(f"case {case.name} is a {transport} case, the target is {url}")
    summary = report.Summary(url, seed)
    t0 = time.monotonic()
    r = Runner(url, options)
    try:
        await r.start()
        res = await r.run_case(case)
        summary.cases = 1
        if res.findings:
            summary.saved.append(report.Saved(case, res.findings, case.steps, True))
    except HarnessError as exc:
        summary.error = str(exc)
    except Exception as exc:
        summary.error = f"{type(exc).__name__}: {exc}"
    finally:
        summary.steps = Counter(r.families)
        summary.seconds = time.monotonic() - t0
        await r.stop()
    return summary


@click.command(context_settings={"max_content_width": 100})
@click.option("--target", "url", metavar="URL", required=True,
              help="The target: iwarp://HOST:PORT or roce://HOST[:PORT] (the transport follows).")
@click.option("--local", metavar="ADDR", help="Local address of the fuzzer's initiators (RoCEv2).")
@click.option("--cases", "count", type=click.IntRange(min=1), default=1000, show_default=True,
              help="How many cases to run.")
@click.option("--seed", type=click.IntRange(min=0), default=1, show_default=True,
              help="Seed of the run: same seed, same cases.")
@click.option("--start", type=click.IntRange(min=0), default=0, show_default=True,
              help="Index of the first case.")
@click.option("--time-limit", type=click.FloatRange(min=0), metavar="S",
              help="Stop starting new cases after S seconds (the run still counts as complete).")
@click.option("--out", type=click.Path(file_okay=False), default="fuzz-findings", show_default=True,
              help="Directory for findings: CASE.json and CASE.pcap.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the summary as JSON ('-': stdout).")
@click.option("--replay", metavar="CASE", help="Run one case: a name like roce-42-007315, or a finding's JSON file.")
@click.option("--minimize-budget", type=click.IntRange(min=0), default=24, show_default=True,
              help="Most replays spent minimizing one finding.")
@click.option("--max-findings", type=click.IntRange(min=0), default=0, show_default=True,
              help="Stop after this many cases with findings (0: never).")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
def fuzz(url: str, local: str | None, count: int, seed: int, start: int, time_limit: float | None,
         out: str, json_file: str | None, replay: str | None, minimize_budget: int, max_findings: int,
         quiet: bool) -> None:
    """Fuzz a KBTP target statefully, judging only what it sends back.

    Two sessions go through HELLO, ALLOC_STORE, STORE, LOAD, FREE, BIND (DIRECT_ALLOC),
    GOODBYE and reconnects, carrying handles, generations, tickets and STags forward;
    each case mutates requests (every field through the Scapy layers, Scapy fuzz(),
    flags against lengths, inline length lies, generations, handles at range edges,
    unknown and Private Use opcodes, forged BINDs, raw octets), sends more requests than
    credits, or makes RDMA accesses to STags never granted and FetchAdds with wrong Add
    Data or Mask. After each case: a fresh HELLO, known LOADs, and with DIRECT_LOAD the
    table and ring read back. Findings are minimized and saved as pcap + JSON.

    Exit status: 0 no finding, 1 the target misbehaved, 2 usage or harness error.

    \b
    Examples:
      kbtp fuzz --target roce://127.0.0.1 --local 127.0.0.2 --cases 10000 --seed 7
      kbtp fuzz --target iwarp://127.0.0.1:5420 --time-limit 600 --json fuzz.json
      kbtp fuzz --target roce://127.0.0.1 --replay roce-7-000123
      kbtp fuzz --target roce://127.0.0.1 --replay fuzz-findings/roce-7-000123.json
    """
    try:
        transport = parse_url(url).transport
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    options = {"local": local} if local and transport == "roce" else {}
    out_dir = Path(out)
    last = [0.0]

    def progress(done: int, s: report.Summary) -> None:
        now = time.monotonic()
        if quiet or (now - last[0] < 2 and done != count):
            return
        last[0] = now
        click.echo(f"[{done}/{count}] findings {len(s.saved)}", err=True)

    if replay and not (replay.endswith(".json") and Path(replay).exists()):
        try:
            parse_name(replay)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    if replay:
        summary = asyncio.run(replay_case(url, options, replay))
    else:
        summary = asyncio.run(campaign(url, options, seed, count, start, time_limit, out_dir,
                                       minimize_budget, max_findings, progress))
    click.echo(report.table(summary))
    if json_file == "-":
        click.echo(report.as_json(summary))
    elif json_file:
        Path(json_file).write_text(report.as_json(summary))
    if summary.error and summary.saved:
        click.echo(f"kbtp: the run ended early after the findings: {summary.error}", err=True)
    if summary.exit_code == report.EXIT_HARNESS:
        raise _Exit(2, f"harness error: {summary.error}")
    if summary.exit_code == report.EXIT_FINDING:
        raise _Exit(1, f"{len(summary.saved)} case(s) with findings"
                    + (f" (saved in {out_dir})" if not replay else ""))

