"""``kbtp decode``: every KBTP message in a capture or a hex string."""
from __future__ import annotations

import json

import click

from .. import codec
from ..capture import CaptureError, Found, kbtp_messages, rdma_messages, read_packets, to_json
from ..summary import describe


@click.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--hex", "hex_", metavar="HEX", help="Decode one KBTP message given as hex instead of a file.")
@click.option("--json", "as_json", is_flag=True, help="JSON Lines: one object per message, keyed by "
              "display-filter names (kbtp.opcode, kbtp.dd.stag, ...), plus frame and transport.")
@click.option("--addr-le/--no-addr-le", default=None,
              help="Force the byte order of address fields for sessions whose HELLO_ACK is not "
                   "in the capture (default: follow each session's HELLO_ACK).")
def decode(file: str | None, hex_: str | None, as_json: bool, addr_le: bool | None) -> None:
    """Decode the KBTP messages in FILE (pcap or pcapng; Ethernet or raw IP).

    iWARP streams (TCP/MPA/DDP/RDMAP, found by their MPA Request and Reply) and RoCEv2
    frames (UDP 4791) are reassembled; every Send that carries KBTP gives one line.
    A malformed message is shown as far as it decodes, with the reason.

    \b
    Examples:
      kbtp decode pcaps/roce_all_opcodes.pcap
      kbtp decode --json --addr-le mid_session.pcapng
      kbtp decode --hex 0130000100000000000000000000000000000000000000000
    """
    if (file is None) == (hex_ is None):
        raise click.UsageError("give a capture FILE or --hex HEX, not both and not neither")
    if hex_ is not None:
        try:
            data = bytes.fromhex(hex_.replace(":", "").replace(" ", ""))
        except ValueError:
            raise click.ClickException(f"--hex: not a hex string: {hex_[:40]!r}") from None
        try:
            found = Found(0, "none", (), codec.decode(data, addr_le=bool(addr_le)))
        except codec.Malformed as exc:
            found = Found(0, "none", (), exc.fields, exc.reason)
        _emit(found, as_json)
        return
    try:
        packets = read_packets(file)
    except CaptureError as exc:
        raise click.ClickException(str(exc)) from None
    for found in kbtp_messages(rdma_messages(packets), addr_le):
        _emit(found, as_json)


def _emit(found: Found, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(to_json(found), sort_keys=False))
        return
    text = describe(found.fields)
    if found.error:
        text += f" [malformed: {found.error}]"
    click.echo(f"{found.frame:>6} {found.transport:<5} {text}")
