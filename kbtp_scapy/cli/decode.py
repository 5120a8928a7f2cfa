"""``kbtp decode``: every KBTP message in a capture (file or standard input) or a hex string."""
from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import click

from .. import codec, tables as T, words
from ..capture import Found, KbtpSessions, ResponseTimes, endpoints, kbtp_messages, to_json
from ..decode import CaptureError, Reader, Stats, core, rdma_messages, rdma_operations
from ..decode.frames import SUPPORTED, linktype_name
from ..extras import Extra, install
from ..summary import describe
from . import interrupt
from .options import Output, needs

PROGRESS_MIN_SIZE = 4 << 20           # files smaller than this decode before progress matters
PROGRESS_EVERY = 0.2                  # seconds between progress updates


def _names(enum: T.Enumeration, what: str, values: tuple[str, ...]) -> frozenset[int]:
    """Enumeration names or numbers given on the command line."""
    by_name = enum.by_name()
    out = set()
    for text in (v for value in values for v in value.split(",") if v.strip()):
        text = text.strip()
        if text.upper() in by_name:
            out.add(by_name[text.upper()])
            continue
        try:
            out.add(int(text, 0))
        except ValueError:
            raise click.BadParameter(f"{text!r} is not {'an' if what[0] in 'aeiou' else 'a'} {what}; choose from "
                                     f"{', '.join(by_name)} or give a number",
                                     param_hint=f"--{what}") from None
    return frozenset(out)


def _hex(text: str) -> bytes:
    """Octets of ``--hex``: two digits per octet; spaces, colons and 0x prefixes allowed."""
    digits = "".join(t[2:] if t[:2].lower() == "0x" else t for t in re.split(r"[\s:]+", text))
    bad = re.search(r"[^0-9a-fA-F]", digits)
    if bad:
        raise click.ClickException(f"--hex: {bad.group()!r} is not a hex digit; give the message "
                                   "as hex digits, two per octet (0x, spaces and colons are allowed)")
    if len(digits) % 2:
        raise click.ClickException(f"--hex: odd number of hex digits ({len(digits)}); give two "
                                   "digits per octet")
    return bytes.fromhex(digits)


class _Progress:
    """One line on a terminal's stderr, rewritten in place; nothing anywhere else."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self.enabled, self.total = enabled, total
        self.shown = False
        self._next = time.monotonic() + PROGRESS_EVERY

    def update(self, done: int, messages: int) -> None:
        if not self.enabled or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + PROGRESS_EVERY
        mb = done / 1e6
        where = (f"{100 * done / self.total:3.0f}% of {self.total / 1e6:,.0f} MB" if self.total
                 else f"{mb:,.0f} MB")
        sys.stderr.write(f"\rkbtp decode: {where}, {messages:,} KBTP messages\033[K")
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


def _open(file: str) -> tuple[BinaryIO, int | None]:
    """The capture's stream and its size (None for a pipe)."""
    if file == "-":
        stream = sys.stdin.buffer
    else:
        try:
            stream = open(file, "rb")  # noqa: SIM115 - closed by the caller
        except FileNotFoundError:
            raise click.ClickException(f"{file}: no such file; give a pcap or pcapng capture, "
                                       "or - to read one from standard input") from None
        except IsADirectoryError:
            raise click.ClickException(f"{file}: is a directory; give a capture file") from None
        except OSError as exc:
            raise click.ClickException(f"{file}: cannot read it ({exc.strerror})") from None
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return stream, None
    return stream, info.st_size if stat.S_ISREG(info.st_mode) else None


def _line(found: Found, origin: float) -> str:
    """Frame, time since the first frame, transport, connection, endpoints, summary."""
    ends = endpoints(found)
    if found.transport == "iwarp":
        fmt = "[{}]:{}" if ":" in ends["src"] else "{}:{}"
        where = f"{fmt.format(ends['src'], ends['src_port'])} -> {fmt.format(ends['dst'], ends['dst_port'])}"
    else:
        where = f"{ends['src']} -> {ends['dst']} QP 0x{ends['dst_qp']:06x}"
    text = describe(found.fields)
    if found.error:
        text += f" [malformed: {found.error}]"
    if found.icrc_bad:
        text += f" [bad ICRC in frame {', '.join(map(str, found.icrc_bad))}: the receiving NIC dropped it]"
    elapsed = (found.time or origin) - origin
    return (f"{found.frame:>7} {elapsed:11.6f} {found.transport:<5} #{found.connection:<3} "
            f"{where}  {text}\n")


def _layers(found: Found) -> str:
    """The message as the Scapy layers show it (Scapy's own warnings silenced)."""
    import logging
    logging.getLogger("scapy").setLevel(logging.ERROR)
    from ..layers.kbtp import KBTP
    return KBTP(found.payload, addr_le=found.addr_le).show(dump=True) or ""   # Scapy types it Optional


class _Output:
    """Where lines go: stdout (text or JSON), and JSON Lines to a file with --json-file."""

    def __init__(self, as_json: bool, json_file: TextIO | None, layers: bool,
                 progress: _Progress, origin: float) -> None:
        self.as_json, self.json_file, self.layers = as_json, json_file, layers
        self.progress, self.origin = progress, origin
        self.clear = progress.enabled and sys.stdout.isatty()
        self.write = sys.stdout.write

    def __call__(self, found: Found) -> None:
        if self.clear:
            self.progress.clear()
        if self.as_json:
            self.write(json.dumps(to_json(found)) + "\n")
            return
        self.write(_line(found, self.origin))
        if self.layers:
            self.write(_layers(found))
        if self.json_file is not None:
            self.json_file.write(json.dumps(to_json(found)) + "\n")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class _Where:
    """--conn, --addr, --qp, --from and --to: which connections, endpoints and stretch of
    the capture's time (seconds since its first frame) a message must be in. An address
    or a network matches either end; a QP selects the RoCEv2 connections with it at either
    end, so a request and its answer (which goes to the peer's QP) are both in."""

    conns: frozenset[int] = frozenset()
    nets: frozenset[Network] = frozenset()
    qps: frozenset[int] = frozenset()
    start: float | None = None
    end: float | None = None
    chosen: set[int | None] = field(default_factory=set)     # connections a QP selected

    def __bool__(self) -> bool:
        return bool(self.conns or self.nets or self.qps) or self.start is not None or self.end is not None

    def matches(self, found: Found, origin: float) -> bool:
        ends = endpoints(found)
        return ((not self.conns or found.connection in self.conns)
                and (not self.nets or self._near(ends.get("src")) or self._near(ends.get("dst")))
                and (not self.qps or self._qp(found, ends.get("dst_qp")))
                and self.within(found.time, origin))

    def within(self, time: float | None, origin: float) -> bool:
        """Whether a moment (seconds since the epoch) is in --from and --to."""
        at = (time or origin) - origin
        return (self.start is None or at >= self.start) and (self.end is None or at <= self.end)

    def _near(self, text: str | None) -> bool:
        return text is not None and any(_ip(text) in net for net in self.nets)

    def _qp(self, found: Found, dst_qp: int | None) -> bool:
        """Whether the message's connection has a QP asked for: its destination QP, or its
        source QP once the decoder has tied the connection's QPs (``decode.connections``)."""
        if found.connection in self.chosen:
            return True
        if dst_qp in self.qps or found.src_qp in self.qps:
            self.chosen.add(found.connection)
            return True
        return False


@lru_cache(maxsize=4096)
def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def _network(text: str) -> Network:
    """An --addr: an address (one host) or a network, IPv4 or IPv6."""
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an IP address or network (192.0.2.1, 192.0.2.0/24, "
                                 "fd00::/64)", param_hint="--addr") from None


def _seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """--from and --to: seconds since the capture's first frame, none before it."""
    if value is not None and not 0 <= value < math.inf:
        raise click.BadParameter(f"{value:g} is not a time in the capture; give seconds since its first "
                                 "frame (0 or more)")
    return value


def _matches(fields: Mapping[str, Any], opcodes, statuses, handles) -> bool:
    return ((not opcodes or fields.get("opcode") in opcodes)
            and (not statuses or fields.get("status") in statuses)
            and (not handles or fields.get("handle") in handles))


@click.command()
@click.argument("file", required=False)
@click.option("--hex", "hex_", metavar="HEX", help="Decode one KBTP message given as hex (0x, "
              "spaces and colons allowed) instead of a capture.")
@click.option("--json", "as_json", is_flag=True, help="JSON Lines on stdout: one object per "
              "message with frame, time, transport, conn and endpoints, then the fields keyed by "
              "display-filter names (kbtp.opcode, kbtp.dd.stag, ...).")
@click.option("--json-file", metavar="FILE", type=Output(dash=True, opened="w"), default=None,
              help="Write the JSON Lines to FILE and the text lines to stdout ('-': as --json).")
@click.option("--addr-le/--no-addr-le", default=None,
              help="Force the byte order of address fields for sessions whose HELLO_ACK is not "
                   "in the capture (default: follow each session's HELLO_ACK).")
@click.option("-c", "--count", type=click.IntRange(min=1), default=None, metavar="N",
              help="Stop after N messages (those the filters let through).")
@click.option("--opcode", "opcodes", multiple=True, metavar="NAME",
              help="Only messages with this opcode (name or number; repeat or comma-separate).")
@click.option("--status", "statuses", multiple=True, metavar="NAME",
              help="Only messages with this status (name or number, e.g. NOT_VALID).")
@click.option("--handle", "handles", multiple=True, metavar="H",
              help="Only messages naming this handle (decimal or 0x hex).")
@click.option("--conn", "conns", multiple=True, type=click.IntRange(0), metavar="N",
              help="Only messages of connection N (the #N of each line; repeatable).")
@click.option("--addr", "addrs", multiple=True, metavar="IP[/LEN]",
              help="Only messages from or to this address or network, either end (192.0.2.1, "
                   "192.0.2.0/24, fd00::/64; repeatable).")
@click.option("--qp", "qps", multiple=True, metavar="QPN",
              help="RoCEv2: only the connections with this QP at either end, requests and answers "
                   "alike (decimal or 0x hex; repeatable). The QPs of a connection are tied by the CM's "
                   "REQ and REP, else by the first ACK: a message before either matches by its "
                   "destination QP.")
@click.option("--from", "start", type=float, default=None, metavar="SECONDS", callback=_seconds,
              help="Only messages at or after SECONDS since the capture's first frame.")
@click.option("--to", "end", type=float, default=None, metavar="SECONDS", callback=_seconds,
              help="Only messages at or before SECONDS since the capture's first frame.")
@click.option("--layers", is_flag=True, help="Also show each message as the Scapy layers "
              "dissect it (slow: a Scapy packet per message).")
@click.option("--stats", is_flag=True,
              help="Instead of the messages, the response times per request opcode and per opcode "
                   "and status of the answer (calls, min, max, average, sum), as tshark's -z kbtp,srt "
                   "gives them with the C plugin; with --json as one JSON document.")
@click.option("--parquet", type=Output(folder=True, path_type=Path), metavar="DIR",
              callback=needs(Extra.ANALYZE, "pyarrow"),
              help="Write the messages as Parquet instead, one row each with typed columns from the "
                   "tables and derived ones (session, answer, latency): DIR/NAME/part-0.parquet, so "
                   "many captures form one dataset (kbtp analyze DIR reads it).")
@click.option("-q", "--quiet", is_flag=True, help="No progress display; results and the summary only.")
def decode(file: str | None, hex_: str | None, as_json: bool, json_file: TextIO | None,
           addr_le: bool | None, count: int | None, opcodes: tuple[str, ...],
           statuses: tuple[str, ...], handles: tuple[str, ...], conns: tuple[int, ...],
           addrs: tuple[str, ...], qps: tuple[str, ...], start: float | None, end: float | None,
           layers: bool, stats: bool, parquet: Path | None, quiet: bool) -> None:
    """Decode the KBTP messages in FILE (pcap or pcapng; '-' reads standard input).

    iWARP connections (TCP/MPA/DDP/RDMAP, found by their MPA Request and Reply; markers
    and CRC as negotiated) and RoCE packets (RoCEv2 on UDP 4791, RoCEv1) are reassembled
    as the capture is read, in bounded memory, and every Send that carries KBTP gives one
    line as soon as its last frame is read: frame, time since the first frame, transport,
    connection number, source and destination, then the message as Wireshark's Info
    column shows it. A malformed message is shown as far as it decodes, with the reason.
    At the end one line on stderr sums up what was found. Reading from a pipe works as
    the capture is written: tcpdump -i IF -w - udp port 4791 | kbtp decode -

    Ctrl-C (exit status 130) or SIGTERM (143) stops the reading: the messages found until
    then are kept, the summary line says how far it got; a second signal aborts.

    \b
    Examples:
      kbtp decode pcaps/roce_session.pcap
      kbtp decode --json pcaps/iwarp_session.pcap
      kbtp decode --opcode COMPLETION --status NOT_VALID,TOO_LARGE pcaps/roce_session.pcap
      kbtp decode -c 3 --layers pcaps/iwarp_session.pcap
      kbtp decode --no-addr-le pcaps/roce_addr_le_ipv6_session.pcap
      kbtp decode --stats pcaps/roce_session.pcap
      kbtp decode --addr 192.0.2.1 --from 0.00001 --to 0.0001 pcaps/roce_session.pcap
      cat pcaps/iwarp_session.pcap | kbtp decode --json - | head -1
      kbtp decode --hex 0x011200010000000000000007000000000000400100000000000000000000000000000000000000084b56424c4f434b21
      kbtp decode --parquet dataset pcaps/iwarp_session.pcap
    """
    if (file is None) == (hex_ is None):
        raise click.UsageError("give a capture FILE (- for standard input) or --hex HEX, "
                               "not both and not neither")
    if json_file is not None and json_file.name == "<stdout>":
        as_json, json_file = True, None
    if layers and as_json:
        raise click.UsageError("--layers shows text; it does not go with --json")
    if stats and (opcodes or statuses or handles or count or layers or json_file or hex_):
        raise click.UsageError("--stats counts every request of a capture: it does not go with "
                               "--opcode, --status, --handle, -c, --layers, --json-file or --hex")
    if start is not None and end is not None and start > end:
        raise click.UsageError(f"--from {start:g} is after --to {end:g}: no message can be in between")
    filters = (_names(T.OPCODES, "opcode", opcodes), _names(T.STATUS, "status", statuses),
               frozenset(_handle(h) for h in handles))
    where = _Where(frozenset(conns), frozenset(_network(a) for a in addrs),
                   frozenset(_integer(q, "--qp", "a QP number") for q in qps), start, end)
    if parquet is not None:
        _parquet(file, parquet)
        return
    try:
        if hex_ is not None:
            _decode_hex(_hex(hex_), addr_le, as_json, json_file, layers)
        elif file is not None:
            _decode_capture(file, addr_le, as_json, json_file, layers, quiet, count, filters, where,
                            ResponseTimes() if stats else None)
    except BrokenPipeError:
        _stdout_closed()


def _parquet(file: str | None, out: Path) -> None:
    """``--parquet``: the capture's rows as one folder of the dataset under ``out``."""
    if file is None or file == "-":
        raise click.UsageError("--parquet reads a capture file, not --hex or standard input")
    try:
        from ..analyze import dataset
        rows = dataset.write([Path(file)], out)
    except ImportError:
        raise click.ClickException(f"--parquet needs pyarrow: {install(Extra.ANALYZE)}") from None
    except CaptureError as exc:
        raise click.ClickException(f"{exc}; give a pcap or pcapng capture") from None
    except OSError as exc:
        raise click.ClickException(f"--parquet {out}: {exc.strerror or exc}") from None
    click.echo(f"{rows} KBTP messages, and the RDMA operations beside them, written to "
               f"{out / dataset.names([Path(file)])[0]}")


def _handle(text: str) -> int:
    return _integer(text, "--handle", "a handle")


def _integer(text: str, option: str, what: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not {what} (decimal or 0x hex)", param_hint=option) from None


def _decode_hex(data: bytes, addr_le: bool | None, as_json: bool, json_file: TextIO | None,
                layers: bool) -> None:
    try:
        found = Found(0, "none", (), codec.decode(data, addr_le=bool(addr_le)), payload=data,
                      addr_le=bool(addr_le))
    except codec.Malformed as exc:
        found = Found(0, "none", (), exc.fields, exc.reason, payload=data, addr_le=bool(addr_le))
    if as_json or json_file is not None:
        (json_file or sys.stdout).write(json.dumps(to_json(found)) + "\n")
    if not as_json:
        text = describe(found.fields) + (f" [malformed: {found.error}]" if found.error else "")
        sys.stdout.write(text + "\n" + (_layers(found) if layers else ""))


def _decode_capture(file: str, addr_le: bool | None, as_json: bool, json_file: TextIO | None,
                    layers: bool, quiet: bool, count: int | None, filters, where: _Where,
                    times: ResponseTimes | None = None) -> None:
    stream, size = _open(file)
    name = "standard input" if file == "-" else file
    progress = _Progress(not quiet and sys.stderr.isatty() and (size is None or size >= PROGRESS_MIN_SIZE),
                         size)
    stats, totals, shown, conns = Stats(), core.Totals(), 0, set()
    reader = None
    # the compiled core: the lines alone, JSON or text (decode/core.py says what it hands back)
    fast = (core.wanted() and json_file is None and not layers and count is None and not any(filters)
            and not where and times is None and addr_le is None)

    def waiting() -> None:
        sys.stdout.flush()
        if reader is not None:
            progress.update(reader.position, totals.messages)

    interrupt.terminate_as_interrupt()
    try:
        reader = Reader(stream, name, before_wait=waiting)
        if reader.linktype is not None and reader.linktype not in SUPPORTED:
            raise click.ClickException(
                f"{name}: {linktype_name(reader.linktype)} cannot be decoded: kbtp decode reads "
                "Ethernet, Linux cooked, loopback and raw IP captures")
        out = None
        stopped = False
        if fast:
            _core_run(reader, stream, progress, stats, totals, as_json)
            shown = totals.messages
        else:
            for found in _found(reader, stats, addr_le, where, times):
                if out is None:
                    out = _Output(as_json, json_file, layers, progress, stats.first_time or 0.0)
                totals.messages += 1
                totals.malformed += found.error is not None
                conns.add((found.transport, found.connection))
                totals.conns = len(conns)
                if where and not where.matches(found, stats.first_time or 0.0):
                    continue
                if times is not None:
                    times.add(found)
                elif _matches(found.fields, *filters):
                    out(found)
                    shown += 1
                    if count is not None and shown >= count:
                        stopped = True
                        break
        sys.stdout.flush()
    except CaptureError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        progress.clear()
        sys.stdout.flush()
        if json_file is not None:
            json_file.flush()
        if times is not None:
            _times(times, as_json)
        _summary(stats, totals, totals.messages if fast else shown, any(filters) or bool(where), None, name)
        click.echo(f"kbtp: decode of {name} interrupted ({interrupt.how()}): the lines above are the "
                   "messages found until then", err=True)
        raise click.exceptions.Exit(interrupt.status()) from None
    finally:
        progress.clear()
        if stream is not sys.stdin.buffer:
            stream.close()
    if json_file is not None:
        json_file.flush()
    for linktype, n in sorted(stats.unsupported.items()):
        if n == stats.frames:
            raise click.ClickException(
                f"{name}: every frame is of {linktype_name(linktype)}, which kbtp decode cannot "
                "read (it reads Ethernet, Linux cooked, loopback and raw IP frames)")
        click.echo(f"kbtp: {name}: {words.count(n, 'frame')} of {linktype_name(linktype)} skipped: "
                   "kbtp decode reads Ethernet, Linux cooked, loopback and raw IP frames", err=True)
    if times is not None:
        _times(times, as_json)
    if where.qps and not stopped and all(transport != "roce" for transport, _ in conns):
        click.echo(f"kbtp: --qp applies to RoCEv2 only, and {name} has no RoCEv2 KBTP message", err=True)
    _summary(stats, totals, shown, any(filters) or bool(where), count if stopped else None, name)
    if not stopped and (reader.cut_short or reader.problem):
        why = reader.problem or f"the capture ends in the middle of frame {reader.cut_short}"
        raise click.ClickException(f"{name}: {why}; the frames before "
                                   f"{'and after it' if reader.resumed else 'it'} were decoded")


def _found(reader: Reader, stats: Stats, addr_le: bool | None, where: _Where,
           times: ResponseTimes | None) -> Iterator[Found]:
    """The KBTP messages of the capture. With --stats, the RDMA Writes beside them go to
    ``times`` as well: a completion record answers the request that asked for it, paired
    as ``kbtp analyze`` pairs it (its operations and ``capture.completion_record``)."""
    if times is None:
        yield from kbtp_messages(rdma_messages(reader, stats), addr_le)
        return
    from ..analyze.operations import Pairing, RdmaOp
    sessions, pairing = KbtpSessions(addr_le), Pairing()
    for msg in rdma_operations(reader, stats):
        found = sessions.decode(msg)
        if found is not None:
            yield found
            continue
        number = sessions.numbered(msg)
        if number is None:                  # no KBTP message on its connection yet
            continue
        for op in pairing.feed(msg):
            if op.op == RdmaOp.WRITE and where.within(op.time, stats.first_time or 0.0):
                times.written(op.transport, number, op.stag, op.offset, op.data, op.time)


def _core_run(reader: Reader, stream: BinaryIO, progress: _Progress, stats: Stats, totals: core.Totals,
              as_json: bool) -> None:
    """The records of ``reader`` through the compiled core, its lines to stdout."""
    sys.stdout.flush()
    binary = getattr(sys.stdout, "buffer", None)
    clear = progress.enabled and sys.stdout.isatty()

    def sink(lines: bytes) -> None:
        """Lines as the core writes them: before each read, so a pipe's reader sees
        every message while the capture is still being written."""
        if clear:
            progress.clear()
        if binary is not None:
            binary.write(lines)
            binary.flush()
        else:
            sys.stdout.write(lines.decode())
            sys.stdout.flush()

    core.run(reader, stream, sink, progress.update if progress.enabled else None,
             _malformed_json if as_json else _malformed_text, stats, totals, not as_json)


def _malformed(payload: bytes, le: bool, frame: int, time: float, transport: str, conn: tuple, number: int,
               icrc_bad: tuple[int, ...]) -> Found:
    """A message the codec finds malformed, as the compiled core found it."""
    try:
        fields, error = codec.decode(payload, addr_le=le), None
    except codec.Malformed as exc:
        fields, error = exc.fields, exc.reason
    return Found(frame, transport, conn, fields, error, time, number, payload, le, icrc_bad)


def _malformed_json(*args: Any) -> str:
    """The JSON line of a malformed message, for the compiled core (``core.MalformedLine``)."""
    return json.dumps(to_json(_malformed(*args[:-1])))


def _malformed_text(*args: Any) -> str:
    """The text line of a malformed message, for the compiled core (``core.MalformedLine``:
    the last argument is the time of the first frame)."""
    return _line(_malformed(*args[:-1]), args[-1]).rstrip("\n")


def _times(times: ResponseTimes, as_json: bool) -> None:
    """The response-time tables of --stats, or their JSON document."""
    click.echo(json.dumps(times.as_json(), indent=1) if as_json else "\n".join(times.text()))


def _summary(stats: Stats, totals: core.Totals, shown: int, filtered: bool, stopped: int | None,
             name: str) -> None:
    """The one line on stderr: what was found in how many frames."""
    frames = words.count(stats.frames, "frame")
    where = f"the first {frames}" if stopped else frames
    if not totals.messages:
        text = f"no KBTP message in {where}"
    else:
        text = f"{words.count(totals.messages, 'KBTP message')} in {where}, {words.count(totals.conns, 'connection')}"
        if totals.malformed:
            text += f", {totals.malformed:,} malformed"
        if filtered:
            text += f", {shown:,} shown"
    text += stats.cut_note()
    if stopped:
        text += f" (stopped after -c {stopped})"
    click.echo(text, err=True)


def _stdout_closed() -> None:
    """The reader of stdout went away (``| head``): stop quietly, exit 0."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
