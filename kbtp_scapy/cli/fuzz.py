"""``kbtp fuzz --target URL``: the stateful protocol fuzzer's command line."""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import click

from .. import words
from ..fuzz import report
from ..fuzz.campaign import Control, Run, campaign, load_case, replay_case
from ..fuzz.cases import parse_name
from ..fuzz.corpus import CorpusError, load
from ..fuzz.restart import Restart
from ..initiator.limits import MAX_BLOCK_SIZE, MAX_BLOCKS
from ..wire.address import parse_url
from . import interrupt
from .errors import Exit, file_line
from .interrupt import run_stoppable
from .options import Output, limit_options, limits, raw_io, raw_io_options, say_resolved


class _Progress:
    """One line on stderr rewritten in place, only when stderr is a terminal; cleared
    before anything else is printed."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.last, self.width = 0.0, 0

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.2 and not force):
            return
        self.last = now
        text = text[:shutil.get_terminal_size((100, 20)).columns - 1]
        click.echo("\r" + text.ljust(self.width), err=True, nl=False)
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            click.echo("\r" + " " * self.width + "\r", err=True, nl=False)
            self.width = 0


def _pace(done: int, total: int, elapsed: float, time_limit: float | None) -> str:
    """``, 41.5 cases/s, ETA 0:12`` (the sooner of the case count's and --time-limit's end)."""
    if not done or elapsed <= 0:
        return ""
    rate = done / elapsed
    left = (total - done) / rate
    if time_limit is not None:
        left = min(left, max(0.0, time_limit - elapsed))
    minutes, seconds = divmod(round(left), 60)
    hours, minutes = divmod(minutes, 60)
    clock = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
    return f", {rate:.1f} cases/s, ETA {clock}"


@click.command(context_settings={"max_content_width": 100})
@click.option("--role", type=click.Choice(["target", "initiator"]), default="target", show_default=True,
              help="What to fuzz: a target at --target, or the initiator command given after '--' "
                   "against a hostile target on --listen (docs/INITIATOR_CONFORMANCE.md).")
@click.option("--target", "url", metavar="URL",
              help="The target: iwarp://HOST:PORT or roce://HOST[:PORT] (the transport follows).")
@click.option("--listen", metavar="URL", help="--role initiator: where the hostile target listens.")
@click.option("--local", metavar="ADDR", help="RoCEv2: the fuzzer's own address to send from.")
@raw_io_options("fuzzer", verbs=False)
@click.option("--cases", "count", type=click.IntRange(min=1), default=1000, show_default=True,
              help="How many cases to run.")
@click.option("--seed", type=click.IntRange(min=0), default=1, show_default=True,
              help="Seed of the run: same seed, same cases.")
@click.option("--start", type=click.IntRange(min=0), default=0, show_default=True,
              help="Index of the first case.")
@click.option("--time-limit", type=click.FloatRange(min=0), metavar="S",
              help="Stop starting new cases after S seconds (the run still counts as complete).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True, metavar="SECONDS",
              help="How long to wait for one answer of the target (and for a connection).")
@limit_options
@click.option("--out", type=Output(folder=True), default="fuzz-findings", show_default=True,
              help="Directory for findings: CASE.json and CASE.pcap.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout, and nothing else there.")
@click.option("--json-file", type=Output(dash=True), metavar="FILE",
              help="Write the summary as JSON to FILE ('-': stdout, as --json); the text stays on stdout.")
@click.option("--replay", metavar="CASE", help="Run one case: a name like roce-42-007315, or a finding's JSON file.")
@click.option("--minimize-budget", type=click.IntRange(min=0), default=24, show_default=True,
              help="Most replays spent minimizing one finding.")
@click.option("--max-findings", type=click.IntRange(min=0), default=0, show_default=True,
              help="Stop after this many cases with findings (0: never).")
@click.option("--seed-corpus", "corpus_paths", multiple=True, metavar="CAPTURE",
              help="A pcap/pcapng (or a folder of them; repeatable) whose KBTP requests mutated cases "
                   "start from, besides the built-in ones; case names carry the corpus's digest.")
@click.option("--restart-cmd", metavar="CMD",
              help="When the target goes away (a gone finding, saved as without it), run CMD through the "
                   "shell to start it again, wait until it answers a HELLO, and go on with the next case.")
@click.option("--restart-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              metavar="SECONDS", help="How long to wait for the target to answer after --restart-cmd.")
@click.option("-q", "--quiet", is_flag=True, help="No progress, only the summary.")
@click.argument("program", nargs=-1, type=click.UNPROCESSED)
def fuzz(role: str, listen: str | None, program: tuple[str, ...], url: str | None, local: str | None,
         io: str, iface: str | None, raw_addr: str | None, count: int, seed: int,
         start: int, time_limit: float | None, timeout: float, max_block_size: int, max_blocks: int, out: str,
         as_json: bool, json_file: str | None,
         replay: str | None, minimize_budget: int, max_findings: int, corpus_paths: tuple[str, ...],
         restart_cmd: str | None,
         restart_timeout: float, quiet: bool) -> None:
    """Fuzz a KBTP target statefully, judging only what it sends back.

    Two sessions go through HELLO, ALLOC_STORE, STORE, LOAD, FREE, BIND (DIRECT_ALLOC),
    GOODBYE and reconnects, carrying handles, generations, tickets and STags forward;
    each case mutates requests (every field through the Scapy layers, Scapy fuzz(),
    flags against lengths, inline length lies, generations, handles at range edges,
    unknown and Private Use opcodes, forged BINDs, raw octets), sends more requests than
    credits, makes RDMA accesses to STags never granted and FetchAdds with wrong Add
    Data or Mask, fills the quota, or leaves a ticket unbound past its Ticket Timeout.
    A model of what the target must do judges every answer: status, Generation, Data
    Length, Block Offset, loaded data, the echoed Request ID and Block Handle, reserved
    octets, canaries around every buffer the target writes, completion record or Send,
    Invalidate, HELLO_ACK; what it cannot predict is counted in the summary, with why.
    After each case: a fresh HELLO, the guard blocks loaded back, and with DIRECT_LOAD
    the table and ring read back. Findings are minimized and saved as pcap + JSON.
    Ctrl-C or SIGTERM stops the run and prints the summary (exit status 130 or 143).

    With --role initiator it is a hostile target instead, on --listen, running the
    initiator command given after '--' once per case (the driver interface of kbtp
    conform --role initiator): malformed HELLO_ACKs, completions with wrong Request IDs,
    lengths or statuses, garbage and torn ring slots, Writes outside the descriptors,
    stalls and disconnects. The program must neither crash nor hang, never report as
    valid data the target did not serve as valid, and never write outside its grant.

    With --seed-corpus, the KBTP requests of the user's own captures are seeds too: half the
    mutated requests start from one (its opcode, flags, handle relative to the session's
    Handle Base, data size) before their family mutates it. Case names then end in the
    corpus's digest (roce-7-000123-c1a2b3c4d), which a replay by name must match.

    A target that stops answering or goes away during the run is a finding too (kind gone,
    as a crash is to AFL): the last cases' frames are saved as its pcap, with the replay
    line, and the summary is printed. With --restart-cmd the run goes on instead, as with
    AFL or boofuzz: CMD (a shell command that starts the target again, in the background or
    as itself, left running) is run, and once the target answers a HELLO within
    --restart-timeout the next case follows; the summary counts the restarts. A target that
    does not come back in time ends the run as without the option.

    Exit status: 0 no finding, 1 the target misbehaved (or went away), 2 usage or harness
    error (including a target that refuses the fuzzer's sessions from the start), 130
    interrupted by Ctrl-C, 143 by SIGTERM (the summary of the cases run; a second signal aborts).

    \b
    Examples:
      kbtp fuzz --target roce://127.0.0.1 --local 127.0.0.2 --cases 10000 --seed 7
      kbtp fuzz --target iwarp://127.0.0.1:5420 --time-limit 600 --json-file fuzz.json
      kbtp fuzz --target roce://127.0.0.1 --local 127.0.0.2 --replay roce-7-000123
      kbtp fuzz --target iwarp://127.0.0.1:5420 --cases 20 --seed-corpus pcaps/roce_session.pcap
      kbtp fuzz --target iwarp://127.0.0.1:5420 --cases 20 --restart-cmd 'systemctl restart kbtp-target'
    """
    if role == "initiator":
        from .fuzz_initiator import fuzz_initiator
        fuzz_initiator(listen, program, local=local, count=count, seed=seed, start=start,
                       timeout=timeout, out=out, as_json=as_json, json_file=json_file, replay=replay,
                       budget=minimize_budget, quiet=quiet)
        return
    if url is None or listen or program:
        raise click.UsageError("--target URL is required (--listen and a command are for --role initiator)")
    try:
        transport = parse_url(url).transport
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    say_resolved(url)
    options = raw_io(transport, io, iface, raw_addr)
    replay_args = ["--io", "raw", "--iface", options["iface"], "--addr", options["addr"]] if options else []
    if local and transport == "roce":
        options["local"] = local
        replay_args += ["--local", local]
    if timeout != 10.0:
        replay_args += ["--timeout", f"{timeout:g}"]
    options["limits"] = limits(max_block_size, max_blocks, timeout)
    replay_args += [f"--{name}={value}" for name, value, default in (
        ("max-block-size", max_block_size, MAX_BLOCK_SIZE), ("max-blocks", max_blocks, MAX_BLOCKS))
        if value != default]
    if json_file == "-":
        as_json, json_file = True, None
    try:
        corpus = load(list(corpus_paths)) if corpus_paths else None
    except CorpusError as exc:
        raise Exit(2, str(exc)) from None
    replay_args += [arg for path in corpus_paths for arg in ("--seed-corpus", path)]
    case = None
    if replay:
        try:
            case = load_case(replay, corpus)
        except (ValueError, KeyError, OSError) as exc:
            raise click.UsageError(f"--replay {replay}: {exc}") from None
        if parse_name(case.name)[0] != transport:
            raise click.UsageError(f"case {case.name} is a {parse_name(case.name)[0]} case, the target is {url}")
    run = Run(url, options, timeout, replay_args, minimize_budget,
              Restart(restart_cmd, restart_timeout) if restart_cmd else None, corpus)
    bar = _Progress(not quiet)

    started = time.monotonic()

    def on_case(done: int, s: report.Summary) -> None:
        bar.show(f"kbtp fuzz: case {done}/{count}, {len(s.saved)} with findings"
                 + _pace(done, count, time.monotonic() - started, time_limit), force=done == count)

    def on_minimize(name: str, tries: int, budget: int, steps: int) -> None:
        bar.show(f"kbtp fuzz: minimizing {name}: replay {tries}/{budget + 1}, {steps} steps", force=True)

    control = Control(on_case, on_minimize)
    out_dir = Path(out)
    if case is not None:
        summary = run_stoppable(lambda: replay_case(run, control, case), control.interrupt)
    else:
        summary = run_stoppable(lambda: campaign(run, control, seed, count, start, time_limit, out_dir,
                                               max_findings), control.interrupt)
    bar.clear()
    summary.interrupted_status = interrupt.status()
    text = report.table(summary)
    nothing_ran = summary.exit_code == report.EXIT_HARNESS and not summary.cases
    if as_json:
        click.echo(report.as_json(summary), nl=False)
    if not nothing_ran:               # else the error line below is all there is to say
        click.echo(text, err=as_json)
    if json_file:
        try:
            Path(json_file).write_text(report.as_json(summary))
        except OSError as exc:
            raise Exit(2, file_line(json_file, exc, option="--json-file")) from None
    if summary.error and summary.saved:
        click.echo(f"kbtp: the run ended early after the findings: {summary.error}", err=True)
    if summary.interrupted:
        raise Exit(summary.exit_code, f"interrupted ({interrupt.how()}) after {words.count(summary.cases, 'case')}"
                    + (f", {len(summary.saved)} with findings" if summary.saved else ""))
    if summary.exit_code == report.EXIT_HARNESS:
        raise Exit(2, f"{'cannot fuzz' if nothing_ran else 'harness error'}: {summary.error}")
    if summary.exit_code == report.EXIT_FINDING:
        raise Exit(1, f"{words.count(len(summary.saved), 'case')} with findings"
                    + (f" (saved in {out_dir})" if not replay else "")
                    + (f"; the target went away at case {summary.gone_at}" if summary.gone_at else "")
                    + (f", restarted {words.count(summary.restarts, 'time')}" if summary.restarts else ""))
