"""``kbtp conform --role initiator --listen URL -- CMD ...``: checking an initiator.

The command line of ``conform.py`` hands over here; the outputs (text, JSON, JUnit,
pcaps, exit codes) are target conformance's, from ``conform/report.py``.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from ..conform import report
from ..conform.initiator.runner import all_cases, run
from ..conform.registry import Case, select
from ..harness import HarnessError
from . import interrupt
from .conform import Console, write_html
from .errors import Exit


def check_initiator(listen: str | None, program: tuple[str, ...], *, local: str | None,
                    list_only: bool, only: tuple[str, ...], exclude: tuple[str, ...], quick: bool,
                    strict: bool, as_json: bool, json_file: str | None, junit_file: str | None,
                    html_file: str | None, pcap_dir: str | None, keep: str | None, timeout: float, quiet: bool,
                    console: Console, io: dict | None = None) -> int:
    """Run the initiator cases; returns the exit code (the caller raises it). On Ctrl-C
    the partial report holds the verdicts ``console`` heard."""
    cases = select(all_cases(), only, exclude)
    if not cases:
        raise click.UsageError("no initiator case matches --only/--exclude (see --role initiator --list)")
    if list_only:
        click.echo(report.listing(cases))
        return 0
    if not listen:
        raise click.UsageError("--role initiator needs --listen URL (where the checking target listens)")
    if not program:
        raise click.UsageError("give the initiator's command after '--', e.g. -- kbtp initiator {url} ...")
    if json_file == "-":
        as_json, json_file = True, None
    if not as_json:
        click.echo(f"kbtp conform --role initiator: checking target on {listen}, "
                   f"program: {' '.join(program)}\n")
    interrupt.terminate_as_interrupt()
    try:
        outcomes = asyncio.run(run(listen, list(program), cases, timeout=timeout, local=local,
                                   quick=quick, pcap_dir=Path(pcap_dir) if pcap_dir else None,
                                   listener=console, keep=Path(keep) if keep else None, io=io))
    except HarnessError as exc:
        doc = _doc(listen, program, [], str(exc), strict, quick, cases)
        _emit(as_json, json_file, doc)
        _write(junit_file, report.junit(listen, [], str(exc)))
        write_html(html_file, listen, [], str(exc))
        raise Exit(report.EXIT_HARNESS, f"conform: {exc}") from None
    except KeyboardInterrupt:        # as the target's checker: keep what was judged
        console.clear()
        done = list(console.outcomes)
        why = report.interrupted(len(done), len(cases), interrupt.how())
        if not as_json:
            click.echo(report.footer(done, why))
        _emit(as_json, json_file, _doc(listen, program, done, why, strict, quick, cases,
                                       interrupt.status()))
        _write(junit_file, report.junit(listen, done, why))
        write_html(html_file, listen, done, why)
        raise Exit(interrupt.status(), f"conform: {why}; the reports hold the cases judged until "
                                            "then") from None
    if not as_json:
        click.echo(report.footer(outcomes))
    _emit(as_json, json_file, _doc(listen, program, outcomes, None, strict, quick, cases))
    _write(junit_file, report.junit(listen, outcomes))
    write_html(html_file, listen, outcomes, None)
    return report.exit_code(outcomes, strict)


def _doc(listen: str, program: tuple[str, ...], outcomes: list, error: str | None, strict: bool,
         quick: bool, selected: list[Case], code: int | None = None) -> str:
    doc = json.loads(report.as_json(listen, None, outcomes, error, strict, quick, selected, code))
    doc.update(role="initiator", listen=doc.pop("target"), program=list(program))
    doc.pop("target_info", None)
    return json.dumps(doc, indent=2)


def _emit(as_json: bool, json_file: str | None, doc: str) -> None:
    if as_json:
        click.echo(doc)
    _write(json_file, doc)


def _write(path: str | None, content: str | bytes) -> None:
    if path is not None:
        Path(path).write_bytes(content.encode() if isinstance(content, str) else content)
