"""``kbtp conform --target URL``: the conformance checker's command line."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import click

from ..conform import report
from ..conform.cases import all_cases
from ..conform.registry import ERROR, FAIL, WARN, Case, select
from ..conform.rerun import ReportError, again
from ..conform.runner import Listener, Outcome, run
from ..harness import HarnessError
from ..initiator.results import TargetInfo
from ..wire.address import parse_url
from ..words import count
from . import interrupt
from .errors import Exit
from .options import Output, limit_options, limits, raw_io, say_resolved


class Console(Listener):
    """The text report, one case at a time as verdicts come, on stdout (unless the JSON
    goes there); on a terminal, one progress line on stderr, rewritten in place and
    cleared before each result is printed."""

    def __init__(self, url: str, text: bool, quiet: bool) -> None:
        self.url, self.text, self.quiet = url, text, quiet
        self.progress = not quiet and sys.stderr.isatty()
        self._shown = False
        self.info: TargetInfo | None = None
        self.outcomes: list[Outcome] = []         # as they come: the partial report on Ctrl-C

    def probed(self, info: TargetInfo, total: int) -> None:
        self.info = info
        if self.text:
            click.echo(report.header(self.url, info))

    def started(self, index: int, total: int, case: Case) -> None:
        if self.progress:
            click.echo(f"\r\x1b[K[{index}/{total}] {case.id} ...", err=True, nl=False)
            self._shown = True

    def finished(self, index: int, total: int, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        lines = report.case_lines(outcome, self.quiet) if self.text else []
        if lines:
            self.clear()
            click.echo("\n".join(lines))

    def gone(self, case: Case, left: int) -> None:
        if self.text and left:
            self.clear()
            click.echo(report.went_away(left, case.id))

    def clear(self) -> None:
        if self._shown:
            click.echo("\r\x1b[K", err=True, nl=False)
            self._shown = False


def _same_target(a: str, b: str) -> bool:
    """Two URLs of one target (``roce://127.0.0.1`` is ``roce://127.0.0.1:4791``)."""
    try:
        return parse_url(a) == parse_url(b)
    except ValueError:
        return a == b


@click.command(context_settings={"max_content_width": 100})
@click.option("--role", type=click.Choice(["target", "initiator"]), default="target", show_default=True,
              help="What to check: a target at --target, or the initiator command given after '--' "
                   "against a checking target on --listen (docs/INITIATOR_CONFORMANCE.md).")
@click.option("--target", "url", metavar="URL", help="The target: iwarp://HOST:PORT or roce://HOST[:PORT].")
@click.option("--listen", metavar="URL", help="--role initiator: where the checking target listens.")
@click.option("--keep", type=Output(folder=True), metavar="DIR",
              help="--role initiator: keep each run's inputs, outputs and stderr in DIR.")
@click.option("--local", metavar="ADDR", help="Local address of the checker's initiator (RoCEv2).")
@click.option("--io", type=click.Choice(["udp", "verbs"]), default="udp", show_default=True,
              help="--role initiator: the checking target on the soft RNIC (udp) or on an RDMA "
                   "device (verbs, with --device); on a device the cases that watch the "
                   "initiator's one-sided accesses are SKIP.")
@click.option("--device", metavar="DEV", help="--io verbs: the RDMA device (as 'ibv_devices' lists it).")
@click.option("--list", "list_only", is_flag=True, help="List the cases and their requirements, run nothing.")
@click.option("--coverage", is_flag=True,
              help="Print the requirement-to-case matrix (every normative sentence of the text, the cases "
                   "that check it, or why none can), run nothing; with --json as JSON.")
@click.option("--spec", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="The specification's text for --coverage [default: docs/kbtp-draft.txt of the checkout].")
@click.option("--only", multiple=True, metavar="PREFIX", help="Run only cases whose id starts so (repeatable).")
@click.option("--exclude", multiple=True, metavar="PREFIX", help="Leave out cases whose id starts so (repeatable).")
@click.option("--rerun-failed", "rerun", type=click.Path(dir_okay=False), metavar="REPORT",
              help="Run again the cases REPORT, the JSON of an earlier run (--json-file), did not "
                   "judge for good: FAIL, WARN, ERROR, and every case it could not run (the target "
                   "went away or was never reached, Ctrl-C); with --only/--exclude, those of them.")
@click.option("--quick", is_flag=True, help="Leave out the slow cases (they are reported as SKIP).")
@click.option("--strict", is_flag=True, help="A WARN (a SHOULD not met) fails the run too (exit status 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout instead of text.")
@click.option("--json-file", type=Output(dash=True), metavar="FILE",
              help="Also write the results as JSON to FILE ('-': the same as --json).")
@click.option("--junit", "junit_file", type=Output(), metavar="FILE",
              help="Write the results as JUnit XML to FILE (a WARN is a failure of type warning).")
@click.option("--html", "html_file", type=Output(), metavar="FILE",
              help="Write the results as one HTML page to FILE: each case with its requirement, "
                   "expected and seen, and a link to its capture (--pcap-dir).")
@click.option("--pcap-dir", type=Output(folder=True), metavar="DIR",
              help="Write a pcap per case that did not pass.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True, metavar="SECONDS",
              help="Seconds to wait for any one answer; cases that need longer waits are skipped.")
@click.option("-q", "--quiet", is_flag=True, help="No progress; print only cases that did not pass.")
@limit_options
@click.argument("program", nargs=-1, type=click.UNPROCESSED)
def conform(role: str, url: str | None, listen: str | None, keep: str | None, local: str | None,
            io: str, device: str | None, list_only: bool, coverage: bool, spec: str | None, only: tuple[str, ...],
            exclude: tuple[str, ...], rerun: str | None, quick: bool, strict: bool, as_json: bool,
            json_file: str | None,
            junit_file: str | None, html_file: str | None, pcap_dir: str | None, timeout: float, quiet: bool,
            max_block_size: int, max_blocks: int, program: tuple[str, ...]) -> None:
    """Check a KBTP target against the specification, judging only what it sends back.

    One case per testable requirement, each PASS, FAIL, WARN (a SHOULD not met), SKIP (a
    feature the target did not offer, a slow case under --quick, or a case not run because
    the target went away) or ERROR (the checker itself could not judge, for example no
    session to be had). A target that breaks a rule in a step that only prepares a case
    (ends the connection, leaves a request unanswered, refuses it) FAILs that case, naming
    the rule; a target that stops answering FAILs the case where it did. Points where the
    specification is silent are reported as information, never as failures. Cases do not
    depend on one another: each uses fresh Initiator IDs and handles no earlier case used.

    Exit status: 0 all good, 1 the target failed a requirement (with --strict, or a
    SHOULD), 2 usage or harness error, or a case that could not be judged, 130
    interrupted by Ctrl-C, 143 by SIGTERM (a CI job's timeout): the reports hold the cases
    judged until then; a second signal aborts.

    With --role initiator the checker is the target instead: it listens on --listen and
    runs the initiator command given after '--' once per case, with the placeholders
    {url} {local} {ops} {in} {out} {state} {timeout} (or the variables KBTP_TARGET_URL,
    KBTP_LOCAL, KBTP_OPS, KBTP_IN, KBTP_OUT, KBTP_STATE, KBTP_TIMEOUT) saying what to do; docs/INITIATOR_CONFORMANCE.md
    has the interface. For the reference initiator:
    kbtp conform --role initiator --listen URL -- kbtp initiator {url} --id-file {state}/id
    script --ops {ops} --in {in} --out {out}

    With --io verbs --device DEV the checking target runs on an RDMA device (rxe, siw, a
    NIC); the cases that watch or change the initiator's RDMA accesses on target memory
    are then SKIP, because the device serves those in the kernel.

    \b
    Examples:
      kbtp conform --target roce://127.0.0.1 --local 127.0.0.2
      kbtp conform --target iwarp://10.0.0.5:5420 --junit conform.xml --pcap-dir failed/
      kbtp conform --target iwarp://10.0.0.5:5420 --html conform.html --pcap-dir failed/
      kbtp conform --target iwarp://127.0.0.1:5420 --quick --strict --json > conform.json
      kbtp conform --target iwarp://127.0.0.1:5420 --rerun-failed conform.json
      kbtp conform --target iwarp://10.0.0.5:5420 --only ops. --only generation. --exclude ops.quota
      kbtp conform --list --only direct.
      kbtp conform --role initiator --list --only direct_alloc.
      kbtp conform --coverage --json > coverage.json
    """
    if coverage:
        _coverage(spec, as_json)
        return
    if role == "initiator":
        if rerun:
            raise click.UsageError("--rerun-failed is for --role target")
        from .conform_initiator import check_initiator
        console = Console(listen or "", not (as_json or json_file == "-"), quiet)
        try:
            code = check_initiator(listen, program, local=local, list_only=list_only, only=only,
                                   exclude=exclude, quick=quick, strict=strict, as_json=as_json,
                                   json_file=json_file, junit_file=junit_file, html_file=html_file,
                                   pcap_dir=pcap_dir,
                                   keep=keep, timeout=timeout, quiet=quiet, console=console,
                                   io=raw_io("", io, None, None, device))   # no --io raw here
        finally:
            console.clear()
        if code:
            raise Exit(code, f"conform: the initiator did not pass (exit status {code}); see each "
                              "case's expected/seen above")
        return
    if program or listen or keep or io != "udp" or device:
        raise click.UsageError("--listen, --keep, --io, --device and a command are for --role initiator")
    cases = select(all_cases(), only, exclude)
    if rerun is not None:
        try:
            left = again(Path(rerun))
        except ReportError as exc:
            raise click.BadParameter(str(exc), param_hint="--rerun-failed") from None
        cases = [c for c in cases if c.id in left.cases]
        if not cases:
            click.echo(f"kbtp conform: no case to run again: {rerun} judged every case"
                       + (" of --only/--exclude" if only or exclude else "")
                       + " (PASS, or SKIP for a reason of the target's)", err=True)
            return
    if not cases:
        raise click.UsageError("no case matches --only/--exclude; --list shows the cases")
    if list_only:
        click.echo(report.listing(cases))
        return
    if not url:
        raise click.UsageError("--target URL is required (or --list)")
    say_resolved(url)
    if rerun is not None and left.target is not None and not _same_target(left.target, url):
        click.echo(f"kbtp conform: note: {rerun} judged {left.target}; its cases not judged for "
                   f"good run against {url}", err=True)
    if json_file == "-":
        as_json, json_file = True, None
    console = Console(url, not as_json, quiet)
    interrupt.terminate_as_interrupt()
    try:
        info, outcomes = asyncio.run(run(url, cases, timeout=timeout, local=local, quick=quick,
                                         limits=limits(max_block_size, max_blocks, timeout),
                                         pcap_dir=Path(pcap_dir) if pcap_dir else None,
                                         listener=console))
    except HarnessError as exc:
        console.clear()
        doc = report.as_json(url, None, [], str(exc), strict, quick, cases)
        _emit(as_json, json_file, doc)
        _write(junit_file, report.junit(url, [], str(exc)))
        write_html(html_file, url, [], str(exc))
        raise Exit(report.EXIT_HARNESS, f"conform: {exc}") from None
    except KeyboardInterrupt:        # a CI timeout kills runs so: keep what was judged
        console.clear()
        done = console.outcomes
        why = report.interrupted(len(done), len(cases), interrupt.how())
        if console.text:
            click.echo(report.footer(done, why))
        _emit(as_json, json_file, report.as_json(url, console.info, done, why, strict, quick, cases,
                                                 interrupt.status()))
        _write(junit_file, report.junit(url, done, why))
        write_html(html_file, url, done, why)
        raise Exit(interrupt.status(), f"conform: {why}; the reports hold the cases judged until "
                                            "then") from None
    console.clear()
    if console.text:
        click.echo(report.footer(outcomes))
    _emit(as_json, json_file, report.as_json(url, info, outcomes, None, strict, quick, cases))
    _write(junit_file, report.junit(url, outcomes))
    write_html(html_file, url, outcomes, None)
    code = report.exit_code(outcomes, strict)
    if code:
        raise Exit(code, _summary(outcomes, strict))


def _coverage(spec: str | None, as_json: bool) -> None:
    """The matrix; exit 1 when a sentence has neither a case nor a reason."""
    from ..conform import matrix
    path = Path(spec) if spec else matrix.SPEC
    if not path.exists():
        raise Exit(report.EXIT_HARNESS, f"conform: the specification's text is not at {path}; "
                                        "give it with --spec FILE")
    try:
        rows = matrix.matrix(path.read_text())
    except ValueError as exc:
        raise Exit(report.EXIT_HARNESS, f"conform: {path}: {exc}; is it the KBTP draft?") from None
    click.echo(json.dumps(matrix.as_dict(rows), indent=1) if as_json else matrix.text_report(rows).rstrip("\n"))
    gaps = matrix.gaps(rows)
    if gaps:
        raise Exit(report.EXIT_DIFFERS, f"conform: {len(gaps)} normative sentence(s) with no case and no "
                                        f"reason, first: {gaps[0].sentence.key}")


def _summary(outcomes: list[Outcome], strict: bool) -> str:
    failed = sum(o.verdict == FAIL for o in outcomes)
    warned = sum(o.verdict == WARN for o in outcomes)
    errors = sum(o.verdict == ERROR for o in outcomes)
    parts = [f"{count(failed, 'case')} failed"] + ([f"{warned} WARN (--strict)"] if strict and warned else [])
    if errors:
        parts.append(f"{errors} could not be judged (ERROR)")
    left = report.not_run(outcomes)
    return (f"conform: {', '.join(parts)}{'; ' + left if left else ''}; see each case's expected/seen "
            "above (--pcap-dir keeps their captures)")


def _emit(as_json: bool, json_file: str | None, doc: str) -> None:
    if as_json:
        click.echo(doc)
    _write(json_file, doc)


def _write(path: str | None, content: str | bytes) -> None:
    if path is None:
        return
    Path(path).write_bytes(content.encode() if isinstance(content, str) else content)


def write_html(path: str | None, url: str, outcomes: list[Outcome], error: str | None) -> None:
    """--html: the page, its capture links relative to its own folder."""
    if path is not None:
        _write(path, report.html(url, outcomes, error, str(Path(path).resolve().parent)))
