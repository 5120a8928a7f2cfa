"""Every example of every ``--help`` runs as written, from the checkout's root, in a sandbox of
its own (``tests/sandbox.py``): the examples of one command run in order, as a user tries
them, against reference targets the sandbox starts at the addresses they name; examples that
start a target run on their own and are stopped with Ctrl-C once they listen."""
from __future__ import annotations

import re

import click
import pytest

from kbtp_scapy.cli import cli

from .sandbox import Sandbox, campaign_marks, serves

#: examples that fail in files other engineers own, reported to the lead: the test expects
#: them to fail, and fails when one starts to pass (then delete it from here)
KNOWN: dict[str, str] = {}
#: ``kbtp demo`` itself is what tests/test_demo.py runs
COVERED = {"kbtp demo"}
#: runs of minutes are fine if they are still fine after this many seconds, then Ctrl-C
LONG_AFTER = 15


def long_run(line: str) -> bool:
    cases = re.search(r"--cases (\d+)", line)
    return "kbtp fuzz" in line and (bool(cases and int(cases[1]) > 2000) or "--time-limit" in line)


def commands() -> list[tuple[str, click.Command, click.Context]]:
    """Every command and subcommand with the context its help is rendered in."""
    found = []

    def walk(cmd: click.Command, name: str, parent: click.Context | None) -> None:
        ctx = click.Context(cmd, info_name=name, parent=parent)
        found.append((ctx.command_path, cmd, ctx))
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, sub), sub, ctx)

    walk(cli, "kbtp", None)
    return found


def examples(cmd: click.Command, ctx: click.Context) -> list[str]:
    """The lines of the Examples paragraph of the command's --help."""
    lines = cmd.get_help(ctx).splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("Examples")), None)
    if start is None:
        return []
    out = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        out.append(line.strip())
    return out


WITH_EXAMPLES = [(path, examples(cmd, ctx)) for path, cmd, ctx in commands() if examples(cmd, ctx)]


def test_every_command_with_options_shows_examples():
    """The top level and every subcommand that is not a group's one-line leaf."""
    shown = {path for path, _ in WITH_EXAMPLES}
    assert {"kbtp", "kbtp decode", "kbtp craft", "kbtp demo", "kbtp dissector", "kbtp target",
            "kbtp initiator", "kbtp replay", "kbtp conform", "kbtp fuzz"} <= shown


def _bare(line: str) -> str:
    return line.split("#", 1)[0].strip()


@pytest.mark.slow
@pytest.mark.parametrize("path,lines", [pytest.param(p, lines, marks=campaign_marks("\n".join(lines)), id=p)
                                        for p, lines in WITH_EXAMPLES])
def test_help_examples_run_as_written(tmp_path, path, lines):
    box = Sandbox(tmp_path)
    lines = [line for line in lines if _bare(line) not in COVERED]
    steps = []
    for line in (line for line in lines if serves(line)):
        steps += box.run([line], keep_servers=False)
    rest = [line for line in lines if not serves(line)]
    if rest:
        steps += box.run(rest, keep_servers=False,
                         interrupt={line: LONG_AFTER for line in rest if long_run(line)})
    ran = {s.line for s in steps}
    assert ran >= set(lines), set(lines) - ran
    failed = [s for s in steps if not s.ok and s.line not in KNOWN]
    fixed = [s.line for s in steps if s.ok and s.line in KNOWN]
    assert not failed, f"{path} --help:\n" + "\n\n".join(s.why() for s in failed)
    assert not fixed, f"these examples run now: delete them from KNOWN: {fixed}"
