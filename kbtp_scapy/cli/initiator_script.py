"""``kbtp initiator URL script --ops OPS --in DIR --out DIR``: a whole operation script in one session.

This is what makes ``kbtp initiator`` a program the initiator checker can run with no
glue (``docs/INITIATOR_CONFORMANCE.md``): the checker passes the script, the directories
and the Initiator ID file, in placeholders or in the environment.
"""
from __future__ import annotations

import os
from pathlib import Path

import click

from ..initiator import Initiator
from ..initiator.driver import Runner
from ..initiator.script import Script, ScriptError, parse
from .initiator import initiator, session
from .options import Output


def _script(ctx: click.Context, param: click.Parameter, value: str | None) -> Script:
    if value is None:                  # click reads an empty variable as unset: it is a script
        value = os.environ.get("KBTP_OPS")
    if value is None:
        raise click.BadParameter("give the operations with --ops or KBTP_OPS")
    try:
        return parse(value)
    except ScriptError as exc:
        raise click.BadParameter(str(exc)) from None


@initiator.command(name="script")
@click.option("--ops", "ops", envvar="KBTP_OPS", callback=_script, metavar="OPS",
              help="The operations, e.g. 'alloc_store 7 @kv seal; load 7 @back; free 7' "
                   "(env KBTP_OPS).")
@click.option("--in", "in_dir", envvar="KBTP_IN", default=".", show_default=True,
              type=click.Path(file_okay=False), help="Directory of the stores' @files (env KBTP_IN).")
@click.option("--out", "out_dir", envvar="KBTP_OUT", required=True, type=Output(folder=True),
              help="Directory for the loads' @files and 'results' (env KBTP_OUT).")
@session
async def script(ini: Initiator, o: dict, ops: Script, in_dir: str, out_dir: str) -> bool:
    """Run an operation script in one session; one 'OP HANDLE STATUS' line per operation
    goes to OUT/results. Handles are offsets into the granted range.

    \b
    Examples (with kbtp target running):
      mkdir -p in out && head -c 4096 /dev/urandom > in/kv
      kbtp initiator iwarp://127.0.0.1:5420 script --in in --out out --ops 'alloc_store 7 @kv seal; load 7 @b'
      cmp in/kv out/b && cat out/results
    """
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return bool(await Runner(ini, Path(in_dir), Path(out_dir)).run(ops))
