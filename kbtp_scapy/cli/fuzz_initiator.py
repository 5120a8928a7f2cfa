"""``kbtp fuzz --role initiator --listen URL -- CMD ...``: a hostile target for initiators.

The command line of ``fuzz.py`` hands over here; the cases, oracles and minimisation are
``conform/initiator/hostile.py``'s.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from ..conform.initiator import hostile
from ..conform.initiator.hostile import EXIT_FINDING, EXIT_HARNESS
from ..conform.initiator.runner import default_local
from ..wire.address import parse_url


def fuzz_initiator(listen: str | None, program: tuple[str, ...], *, local: str | None, count: int,
                   seed: int, start: int, timeout: float, out: str, as_json: bool,
                   json_file: str | None, replay: str | None, budget: int, quiet: bool) -> int:
    """Run the campaign; returns the exit status (0 clean, 1 findings, 2 harness)."""
    if not listen:
        raise click.UsageError("--role initiator needs --listen URL (where the hostile target listens)")
    if not program:
        raise click.UsageError("give the initiator's command after '--', e.g. -- kbtp initiator {url} ...")
    try:
        transport = parse_url(listen).transport
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if replay:
        try:
            if hostile.parse_name(replay)[0] != transport:
                raise click.UsageError(f"--replay {replay} is not a {transport} case")
        except ValueError:
            raise click.UsageError(f"--replay {replay}: not a case name like {transport}-1-000007") from None
    if transport != "roce":
        local = ""             # only RoCEv2 needs the initiator's own address
    elif local is None:
        local = default_local(listen)

    def progress(done: int, summary: hostile.Summary) -> None:
        if not quiet and sys.stderr.isatty():
            click.echo(f"\r\x1b[Kkbtp fuzz --role initiator: case {done}/{count}, "
                       f"{len(summary.findings)} with findings", err=True, nl=False)

    summary = asyncio.run(hostile.campaign(list(program), listen, seed=seed, count=count, start=start,
                                           timeout=timeout, local=local or "", out=Path(out),
                                           budget=budget, replay=replay, progress=progress))
    if not quiet and sys.stderr.isatty():
        click.echo("\r\x1b[K", err=True, nl=False)
    if json_file == "-":
        as_json, json_file = True, None
    click.echo(hostile.as_json(summary) if as_json else hostile.table(summary))
    if json_file:
        Path(json_file).write_text(hostile.as_json(summary))
    if summary.exit_code == EXIT_HARNESS:
        raise click.ClickException(f"harness error: {summary.error}")
    if summary.exit_code == EXIT_FINDING:
        raise _Findings(len(summary.findings), out)
    return 0


class _Findings(click.ClickException):
    exit_code = EXIT_FINDING

    def __init__(self, count: int, out: str) -> None:
        super().__init__(f"{count} case(s) with findings (saved in {out})")
