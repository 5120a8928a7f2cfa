"""``kbtp conform --target URL``: the conformance checker's command line."""
from __future__ import annotations

import asyncio
from pathlib import Path

import click

from ..conform import report
from ..conform.registry import all_cases, select
from ..conform.runner import HarnessError, Outcome, run


class _Exit(click.ClickException):
    """Ends the command with an exit code and a one-line reason, after its output."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = code


@click.command(context_settings={"max_content_width": 100})
@click.option("--target", "url", metavar="URL", help="The target: iwarp://HOST:PORT or roce://HOST[:PORT].")
@click.option("--local", metavar="ADDR", help="Local address of the checker's initiator (RoCEv2).")
@click.option("--list", "list_only", is_flag=True, help="List the cases and their requirements, run nothing.")
@click.option("--only", multiple=True, metavar="PREFIX", help="Run only cases whose id starts so (repeatable).")
@click.option("--exclude", multiple=True, metavar="PREFIX", help="Leave out cases whose id starts so (repeatable).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, writable=True),
              help="Write the results as JSON to FILE ('-' for stdout).")
@click.option("--junit", "junit_file", type=click.Path(dir_okay=False, writable=True),
              help="Write the results as JUnit XML to FILE.")
@click.option("--pcap-dir", type=click.Path(file_okay=False), help="Write a pcap per case that did not pass.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds to wait for any one answer; cases that need longer waits are skipped.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr; print only cases that did not pass.")
def conform(url: str | None, local: str | None, list_only: bool, only: tuple[str, ...],
            exclude: tuple[str, ...], json_file: str | None, junit_file: str | None,
            pcap_dir: str | None, timeout: float, quiet: bool) -> None:
    """Check a KBTP target against the specification, judging only what it sends back.

    One case per testable requirement, each PASS, FAIL, WARN (a SHOULD not met), SKIP (a
    feature the target did not offer) or ERROR (the checker could not judge). Points where
    the specification is silent are reported as information, never as failures.

    Exit status: 0 all good, 1 the target failed a requirement, 2 usage or harness error.

    \b
    Examples:
      kbtp conform --target roce://127.0.0.1 --local 127.0.0.2
      kbtp conform --target iwarp://10.0.0.5:5420 --junit conform.xml --pcap-dir failed/
      kbtp conform --target roce://10.0.0.5 --only ops. --only generation. --exclude ops.quota
      kbtp conform --list --only direct.
    """
    cases = select(all_cases(), only, exclude)
    if not cases:
        raise click.UsageError("no case matches --only/--exclude (see --list)")
    if list_only:
        click.echo(report.listing(cases))
        return
    if not url:
        raise click.UsageError("--target URL is required (or --list)")

    def progress(i: int, n: int, o: Outcome) -> None:
        if not quiet:
            click.echo(f"[{i}/{n}] {o.verdict:5} {o.case.id} ({o.duration:.1f} s)", err=True)

    try:
        info, outcomes = asyncio.run(run(url, cases, timeout=timeout, local=local,
                                         pcap_dir=Path(pcap_dir) if pcap_dir else None,
                                         progress=progress))
    except HarnessError as exc:
        _write(json_file, report.as_json(url, None, [], str(exc)))
        _write(junit_file, report.junit(url, [], str(exc)))
        raise _Exit(report.EXIT_HARNESS, f"harness error: {exc}") from None
    click.echo(report.text(url, info, outcomes, quiet))
    _write(json_file, report.as_json(url, info, outcomes))
    _write(junit_file, report.junit(url, outcomes))
    code = report.exit_code(outcomes)
    if code:
        failed = sum(o.verdict == "FAIL" for o in outcomes)
        errors = sum(o.verdict == "ERROR" for o in outcomes)
        raise _Exit(code, f"{failed} case(s) failed, {errors} could not be judged (ERROR)")


def _write(path: str | None, content: str | bytes) -> None:
    if path is None:
        return
    if path == "-" and isinstance(content, str):
        click.echo(content)
        return
    Path(path).write_bytes(content.encode() if isinstance(content, str) else content)
