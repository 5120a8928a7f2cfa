"""``kbtp initiator URL send HEX|FILE|-``: crafted octets as requests after a HELLO, and what
the target made of them: each answer decoded, then what became of the connection.

``kbtp craft`` builds any message, lies included; this sends it. Each message goes as one
Send, as the requests of a session do; its answers are whatever the target sends back that
answers no request of ours (the reference initiator matches nothing here), until ``--expect``
of them came or ``--wait`` seconds passed. The connection's fate is one of: answered, silence
(a message got no answer in time, the connection still up), or how it ended (an RDMAP
Terminate, a CM DREQ, a TCP FIN or reset, the queue pair's error state), named.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import click

from .. import codec
from ..capture import Found, to_json
from ..initiator import Initiator, SessionEnded
from ..rnic.qp import ENDINGS, Received
from ..summary import describe
from ..words import count
from .errors import file_trouble, say
from .initiator import initiator, session

#: one message per line of hex text (0x, spaces and colons allowed, as craft's --trailer)
HEX_LINE = re.compile(r"^(0x)?[0-9a-fA-F: ]+$")
#: how long a connection may take to end after the last answer, so its fate is seen
LINGER = 0.2
#: how the connection stood when the messages were done, besides ``ENDINGS``
STANDING = {"answered": "every message was answered, the connection is up",
            "silence": "a message got no answer in time, the connection is up"}


def _messages(ctx: click.Context, param: click.Parameter, given: str) -> list[bytes]:
    """HEX, a file (hex text, one message a line, or raw octets) or ``-`` (standard input)."""
    if given == "-":
        return _split(sys.stdin.buffer.read(), "standard input")
    path = Path(given)
    if path.exists():
        try:
            return _split(path.read_bytes(), given)
        except OSError as exc:
            raise file_trouble(given, exc, "read") from None
    text = given.strip()
    if not HEX_LINE.match(text):
        raise click.BadParameter(f"{given!r} is neither hex nor a file", param_hint="HEX|FILE|-")
    return _split(text.encode(), "the argument")


def _split(data: bytes, where: str) -> list[bytes]:
    try:
        lines = [line.strip() for line in data.decode("ascii").splitlines() if line.strip()]
    except UnicodeDecodeError:
        lines = []
    if lines and all(HEX_LINE.match(line) for line in lines):
        out = []
        for line in lines:
            digits = line.replace(":", "").replace(" ", "").removeprefix("0x")
            if len(digits) % 2:
                raise click.BadParameter(f"{where}: odd number of hex digits in {line[:40]!r}",
                                         param_hint="HEX|FILE|-")
            out.append(bytes.fromhex(digits))
        return out
    if not data:
        raise click.BadParameter(f"{where} is empty: nothing to send", param_hint="HEX|FILE|-")
    return [data]                       # raw octets, as craft -o x.raw writes them


def _decoded(msg: Received, addr_le: bool) -> tuple[str, dict[str, Any]]:
    """An answer as a summary line and as JSON keyed by display-filter names."""
    if msg.write_imm:
        return (f"RDMA Write with Immediate 0x{msg.imm:08x}",
                {"rdma": "write_with_immediate", "imm": msg.imm})
    try:
        found = Found(0, "none", (), codec.decode(msg.payload, addr_le), payload=msg.payload)
    except codec.Malformed as exc:
        found = Found(0, "none", (), exc.fields, exc.reason, payload=msg.payload)
    text = describe(found.fields) + (f" [malformed: {found.error}]" if found.error else "")
    record = {k: v for k, v in to_json(found).items() if k not in ("frame", "transport")}
    return text, record


class _Report:
    """Lines as things happen: text, or one JSON object a line with --json."""

    def __init__(self, as_json: bool, addr_le: bool) -> None:
        self.as_json, self.addr_le = as_json, addr_le

    def sent(self, index: int, wire: bytes) -> None:
        self._out({"sent": index, "octets": len(wire), "message": _decoded(Received(wire), self.addr_le)[1]},
                  f"sent {index}: {_decoded(Received(wire), self.addr_le)[0]} ({count(len(wire), 'octet')})")

    def answer(self, index: int, msg: Received) -> None:
        text, record = _decoded(msg, self.addr_le)
        self._out({"answer": index, **record}, f"  answer: {text}")

    def silence(self, index: int, wait: float) -> None:
        self._out({"silence": index, "seconds": wait}, f"  no answer within {wait:g} s")

    def fate(self, how: str, reason: str = "", unsent: int = 0) -> None:
        said = reason or ENDINGS.get(how) or STANDING[how]      # the RNIC's words first
        left = f"; {count(unsent, 'message')} not sent" if unsent else ""
        self._out({"connection": how, "reason": said, "unsent": unsent},
                  f"connection: {how}: {said}{left}")

    def _out(self, record: dict[str, Any], text: str) -> None:
        say(json.dumps(record) if self.as_json else text)


@initiator.command()
@click.argument("messages", metavar="HEX|FILE|-", callback=_messages)
@click.option("--wait", type=click.FloatRange(0.05), default=1.0, show_default=True, metavar="SECONDS",
              help="How long to wait for each message's answers; silence after that.")
@click.option("--expect", type=click.IntRange(0), default=1, show_default=True, metavar="N",
              help="Answers a message should get before the next goes (0: whatever comes in --wait).")
@session
async def send(ini: Initiator, o: dict, messages: list[bytes], wait: float, expect: int) -> None:
    """Send crafted octets as requests after the HELLO (one Send per line of hex, or a raw
    file as one), print each answer decoded, then what became of the connection: answered,
    silence, or how it ended (Terminate, DREQ, FIN, reset, the queue pair's error state).

    The answers are decoded as `kbtp decode` shows them (--json: one object a line, keyed by
    display-filter names). --timeout bounds the whole run.

    \b
    Examples (with kbtp target running):
      kbtp initiator roce://127.0.0.1 send 011300000000000000000001000000000000400000000000
      kbtp craft LOAD --kbtp-version 2 --handle 0x4000 | kbtp initiator roce://127.0.0.1 send -
      kbtp craft GOODBYE | kbtp initiator iwarp://127.0.0.1:5420 --json send -
      kbtp craft FREE --handle 0x4000 -o free.raw && kbtp initiator roce://127.0.0.1 send free.raw
    """
    report = _Report(o["as_json"], ini.addr_le)
    quiet = False
    for index, wire in enumerate(messages, 1):
        report.sent(index, wire)
        try:
            answers = await ini.raw(wire, timeout=wait, expect=expect or 1 << 30)
        except SessionEnded as ended:
            for msg in ended.answers:
                report.answer(index, msg)
            report.fate(ended.how, ended.reason, len(messages) - index)
            return
        for msg in answers:
            report.answer(index, msg)
        if len(answers) < max(expect, 1):
            report.silence(index, wait)
            quiet = quiet or not answers
    try:                                  # an answer, then the end: the end is the fate
        await asyncio.wait_for(ini.qp.wait_closed(), LINGER)
    except TimeoutError:
        report.fate("silence" if quiet else "answered")
        return
    report.fate(getattr(ini.qp.error, "how", "lost"), str(ini.qp.error or ""))
