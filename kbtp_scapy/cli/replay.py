"""``kbtp replay CAPTURE --target URL``: replay captured KBTP sessions against a live target."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from ..capture import CaptureError
from ..harness import HarnessError
from ..wire.address import parse_url
from ..words import count
from . import interrupt
from .errors import CONNECTION_ERRORS, Exit, describe, file_trouble, hint, local_trouble, reason
from .interrupt import run_stoppable
from .options import Output, limit_options, limits, say_resolved


class _Failed(click.ClickException):
    """The target misbehaved or differed: exit 1, after the report."""

    exit_code = 1


class _Harness(click.ClickException):
    """The replay could not run: exit 2, so an aborted run never reads as a pass."""

    exit_code = 2


class _Progress:
    """``step N/M`` on stderr, at most every half second, only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.last, self.shown = enabled, 0.0, 0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or done == total) and total > 50:
            text = f"replaying: step {done}/{total}"
            self.last, self.shown = now, len(text)
            click.echo(f"\r{text}", err=True, nl=False)

    def end(self) -> None:
        """Clear the line, so the report that follows is all that stays on the screen."""
        if self.shown:
            click.echo("\r" + " " * self.shown + "\r", err=True, nl=False)


def _interrupted(runs: list, loops: int) -> str:
    """Where Ctrl-C stopped the replay: in which loop, after how many of its steps."""
    last = runs[-1] if runs else None
    if last is not None and last.stopped_at is not None:
        done, total = last.stopped_at
        where = f"after {done} of {total} steps" + (f" of loop {len(runs)} of {loops}" if loops > 1 else "")
    else:
        where = f"after {count(len(runs), 'loop')} of {loops}"
    return f"interrupted ({interrupt.how()}) {where}"


def _harness(exc: Exception, url: str, local: str | None, timeout: float) -> _Harness:
    """The replay's harness error, with the reason and a hint when its own text has none,
    naming the initiator's own address when that is what failed."""
    text, cause = str(exc).rstrip(), exc.__cause__ or exc.__context__
    if cause is None:
        return _Harness(text)
    mine = local_trouble(cause, parse_url(url), local)
    if mine:
        text = f"{mine}: {reason(cause)}"
    elif text.endswith(":"):
        text = f"{text} {reason(cause, timeout)}"
    return _Harness(text + (f"; {hint(cause)}" if hint(cause) else ""))


@click.command()
@click.argument("capture", type=click.Path(dir_okay=False))
@click.option("--target", "url", required=True, metavar="URL",
              help="The live target: roce://HOST[:PORT] or iwarp://HOST:PORT (either binding, "
                   "whatever the capture's).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as one JSON document on stdout instead of text.")
@click.option("--json-file", metavar="FILE", type=Output(dash=True),
              help="Also write the JSON report to FILE; the text stays on stdout ('-': as --json).")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress; print only the steps that differ or fail, and the final line.")
@click.option("--ignore", "ignore", multiple=True, metavar="FIELD",
              help="Do not compare FIELD (status, generation, data_length, block_offset, data, "
                   "ticket, flags); repeat or separate with commas. block_offset is always ignored "
                   "unless --strict.")
@click.option("--strict", is_flag=True,
              help="Compare Block Offsets too, and Generations as captured (not as they move).")
@click.option("--pace", is_flag=True, help="Keep the captured timing between steps.")
@click.option("--loop", "loops", type=click.IntRange(1), default=1, show_default=True,
              help="Replay the capture N times in a row, each time with new sessions.")
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              metavar="SECONDS", help="How long to wait for each answer and connection.")
@limit_options
@click.option("--local", default=None, metavar="ADDR",
              help="RoCEv2: local address to send from (ignored over iWARP).")
@click.option("-v", "--verbose", is_flag=True, help="List matching steps too.")
def replay(capture, url, as_json, json_file, quiet, ignore, strict, pace, loops, timeout, max_block_size,
           max_blocks, local, verbose) -> None:
    """Replay the KBTP sessions of CAPTURE (pcap or pcapng, iWARP or RoCEv2, from any
    implementation) against the target at URL and compare every completion, loaded
    block and direct-mode read with the capture.

    Each captured session is rebuilt (HELLO, requests, the data it supplied inline or
    through RDMA Reads, the completions and loaded blocks it got) and replayed on a new
    connection with fresh buffers and STags. Handles are moved into the range the new
    HELLO_ACK grants; Block Offsets, tickets and slots are mapped as the replay learns
    them. Sessions run concurrently, each step waiting for what the capture shows it
    waited for; otherwise as fast as the target answers (--pace keeps the captured
    timing).

    Generations are compared as they move: a handle's first Generation in a session
    sets its offset and later ones must keep it, so a capture replays to a match on a
    target whose entries were used before (or were not). --strict compares them as
    captured: then a capture that starts from a fresh target matches only a fresh one.

    \b
    Exit status: 0 every compared step matched; 1 the target differed or failed to
    answer, or the capture is cut short (the steps before its end are replayed); 2 usage
    error or the replay could not run; 130 interrupted (Ctrl-C: the steps replayed until
    then are reported, marked interrupted; a second Ctrl-C aborts), 143 the same for
    SIGTERM. A target that goes
    away during --loop exits 1 with the loops replayed until then, marked partial.

    Of the sample captures (pcaps/), rxe_kernel_session.pcap, siw_kernel_session.pcap
    and fleet/producer*.pcap replay to MATCH. The four synthetic *_session.pcap (iwarp,
    roce and their addr_le_ipv6 forms) differ by design, exit 1: a script made them to
    show failures (NO_SPACE, NOT_SEALED, INTERNAL, TICKET_ABANDONED), tickets and a
    Generation that no live target gives. fleet/consumer*.pcap differ too: they load
    blocks that other hosts' sessions (the producers' captures) stored.

    \b
    Examples (with kbtp target running on each binding):
      kbtp initiator roce://127.0.0.1 --pcap session.pcap alloc-store 0x4000 --text hi --seal
      kbtp replay session.pcap --target roce://127.0.0.1
      kbtp replay session.pcap --target iwarp://127.0.0.1:5420 --json-file report.json
      kbtp replay session.pcap --target roce://127.0.0.1 --loop 3 --pace -v
    """
    from ..replay import compare, player, report, sessions

    try:
        target = parse_url(url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--target") from None
    say_resolved(target)
    url, transport = str(target), target.transport     # a host name resolved once, and reported so
    ignored = {n.strip().lower() for item in ignore for n in item.split(",") if n.strip()}
    unknown = ignored - set(compare.FIELDS)
    if unknown:
        raise click.BadParameter(f"unknown field {', '.join(sorted(unknown))}; choose from "
                                 f"{', '.join(compare.FIELDS)}", param_hint="--ignore")
    if not strict:
        ignored |= compare.DEFAULT_IGNORE
    if capture == "-":
        raise _Harness("replay reads a capture file, not standard input; save it first (tcpdump -w FILE)")
    try:
        cap = sessions.load(capture)
    except CaptureError as exc:
        raise _Harness(str(exc)) from None
    if json_file == "-":
        as_json, json_file = True, None
    progress = _Progress(sys.stderr.isatty() and not as_json and not quiet)
    stop = player.Stop()
    try:
        runs = run_stoppable(lambda: player.play(cap, url, loops=loops, pace=pace, timeout=timeout,
                                                 local=local if transport == "roce" else None,
                                                 progress=progress, stop=stop,
                                                 limits=limits(max_block_size, max_blocks, timeout)),
                             stop.ask)
    except HarnessError as exc:
        raise _harness(exc, url, local, timeout) from None
    except CONNECTION_ERRORS as exc:
        raise _Harness(describe(f"cannot replay against {url}", exc, timeout)) from None
    finally:
        progress.end()
    frozen = frozenset(ignored)
    verdicts = [compare.judge_run(run.results, frozen, relative=not strict) for run in runs]
    kept = set().union(*(run.mapping.kept for run in runs))
    interrupted = _interrupted(runs, loops) if stop.asked else stop.gone    # what made it partial
    document = json.dumps(report.as_json(cap, url, verdicts, sorted(ignored), kept, interrupted),
                          indent=1)
    if json_file:
        try:
            Path(json_file).write_text(document + "\n")
        except OSError as exc:
            raise file_trouble(json_file, exc, option="--json-file") from None
    if as_json:
        click.echo(document)
    else:
        for line in report.text(cap, url, verdicts, verbose, interrupted, quiet=quiet):
            click.echo(line)
    if interrupted:
        code = 1 if stop.gone else interrupt.status()   # the target failed; or the user stopped it
        raise Exit(code, f"replay: {interrupted}; the report above holds the steps replayed until then")
    counts = report.summary(verdicts)
    if counts["differ"] or counts["error"]:
        differ = counts["differ"]
        raise _Failed(f"replay: {count(differ, 'step')} {'differs' if differ == 1 else 'differ'}, "
                      f"{counts['error']} failed")
    if cap.ends:
        raise _Failed(f"{capture}: {cap.ends}; the steps before it were replayed")
    if not counts["match"]:
        raise _Harness("replay: no step could be compared")
