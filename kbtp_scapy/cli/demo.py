"""``kbtp demo``: the main job on built-in defaults."""
from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import click

from .. import tables as T
from ..capture import kbtp_messages, rdma_messages, read_packets
from ..samples import write_samples


@click.command()
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for the captures (default: a new temporary folder).")
def demo(out: str | None) -> None:
    """Craft a capture of every KBTP message and status code over iWARP and RoCEv2
    (IPv4, and IPv6 in an ADDR_LE session), decode each back, and summarise.

    The captures open in Wireshark; the decode shows what `kbtp decode` prints.
    """
    outdir = Path(out or tempfile.mkdtemp(prefix="kbtp-demo-"))
    problems = 0
    for path in write_samples(outdir):
        found = list(kbtp_messages(rdma_messages(read_packets(path))))
        ops = collections.Counter(T.OPCODES.describe(f.fields.get("opcode", -1)) for f in found)
        statuses = {f.fields["status"] for f in found
                    if f.fields.get("opcode") == T.BY_NAME["COMPLETION"].opcode}
        malformed = [f for f in found if f.error]
        answered_malformed = sum(1 for f in found if f.fields.get("status") == T.STATUS.by_name()["MALFORMED"])
        missing_ops = set(T.OPCODES.by_name()) - set(ops)
        missing_st = set(T.STATUS.by_value()) - statuses
        ok = not missing_ops and not missing_st and len(malformed) == answered_malformed
        problems += not ok
        click.echo(f"{'ok ' if ok else 'BAD'} {path}: {len(found)} KBTP messages, "
                   f"{len(ops)} opcodes, {len(statuses)} status codes, "
                   f"{len(malformed)} malformed on purpose, each answered MALFORMED")
        for name in sorted(missing_ops | {T.STATUS.describe(s) for s in missing_st}):
            click.echo(f"    missing: {name}")
    click.echo(f"\nOpen them in Wireshark, or: kbtp decode {outdir}/roce_session.pcap")
    if problems:
        raise click.ClickException(f"{problems} capture(s) did not decode back completely")
