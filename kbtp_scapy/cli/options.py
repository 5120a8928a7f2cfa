"""Option parsing shared by ``kbtp target``, ``kbtp initiator`` and the other client tools."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

import click

from ..extras import Extra, lacking
from ..initiator.limits import MAX_BLOCK_SIZE, MAX_BLOCKS, Limits
from ..vocab import Feature
from ..wire.address import Address, parse_url
from .errors import file_line, line

BINDINGS = {"iwarp": "iWARP", "roce": "RoCEv2"}
#: the usage error of --local over iWARP (without --io verbs)
LOCAL_IS_ROCE = "--local is for RoCEv2 (and --io verbs): over iWARP the kernel's TCP picks the source address"


def address(transport: str, where: str) -> Address:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or a whole URL, for one transport."""
    if "://" not in where:
        if where.count(":") > 1 and not where.startswith("["):
            where = f"[{where}]"
        where = f"{transport}://{where}"
    try:
        found = parse_url(where)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    say_resolved(found)
    return found


def say_resolved(url: str | Address) -> None:
    """``kbtp: localhost is 127.0.0.1`` on stderr when a URL names its host by name: the
    address the command uses (a bad URL is left for the command to report)."""
    try:
        found = url if isinstance(url, Address) else parse_url(url)
    except ValueError:
        return
    if found.resolved:
        click.echo(f"kbtp: {found.resolved}", err=True)


def features(text: str) -> int:
    """``DIRECT_LOAD,DIRECT_ALLOC``, ``all`` or ``none`` (ADDR_LE has its own option)."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if names in (["ALL"], []):
        return sum(f for f in Feature if f is not Feature.ADDR_LE) if names else 0
    if names == ["NONE"]:
        return 0
    unknown = [n for n in names if n not in Feature.__members__ or n == "ADDR_LE"]
    if unknown:
        raise click.BadParameter(f"unknown feature {', '.join(unknown)}; choose from "
                                 f"{', '.join(n for n in Feature.__members__ if n != 'ADDR_LE')}")
    return sum(Feature[n] for n in names)


def integer(text: str | int) -> int:
    """Decimal or 0x-hex."""
    if isinstance(text, int):
        return text
    try:
        return int(text, 0)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number") from None


def feature_names(value: int) -> str:
    return ",".join(n for n, f in Feature.__members__.items() if value & f) or "none"


def raw_io_options(owner: str, verbs: bool = True):
    """``--io`` with ``--iface`` and ``--addr`` (RoCEv2 raw sockets) and, with ``verbs``,
    ``--device`` (an RDMA device through rdma-core)."""
    def decorate(func):
        if verbs:
            func = click.option("--device", default=None, metavar="DEV",
                                help="--io verbs: the RDMA device (as 'ibv_devices' lists it); "
                                     "its address must be the one given.")(func)
        func = click.option("--addr", "raw_addr", default=None, metavar="IP[/MAC]",
                            help=f"--io raw: the address the {owner} owns (not configured in the "
                                 "kernel); without MAC a locally administered one from the IP.")(func)
        func = click.option("--iface", default=None, metavar="IF", help="Interface of --io raw.")(func)
        return click.option("--io", type=click.Choice(["udp", "raw", "verbs"] if verbs else ["udp", "raw"]),
                            default="udp", show_default=True,
                            help="I/O: the soft RNIC on kernel sockets (udp: a UDP socket for "
                                 "RoCEv2, TCP for iWARP), RoCEv2 as whole frames on --iface as "
                                 "--addr (raw)" + (", or an RDMA device (verbs, with --device)."
                                                   if verbs else "."))(func)
    return decorate


def limit_options(func):
    """``--max-block-size`` and ``--max-blocks``: the tool's own limits on a target's figures
    (``initiator.limits``); a HELLO_ACK past them is the target's fault."""
    func = click.option("--max-blocks", type=click.IntRange(1), default=MAX_BLOCKS, show_default=True,
                        metavar="COUNT", help="The largest Allocation Quota, Partition Count or Ring "
                                              "Count a HELLO_ACK may grant (a larger one is refused).")(func)
    return click.option("--max-block-size", type=click.IntRange(1), default=MAX_BLOCK_SIZE,
                        show_default=True, metavar="OCTETS",
                        help="The largest Block Size or Max Inline a HELLO_ACK may grant: buffers of "
                             "that size are allocated (a larger one is refused).")(func)


#: what to do about a ``PeerLimit``, in the tools that have ``limit_options``
RAISE_LIMITS = "if the target means it, raise --max-block-size or --max-blocks"


def limits(max_block_size: int, max_blocks: int, timeout: float) -> Limits:
    """The ``Limits`` of ``limit_options`` and a tool's ``--timeout``, its wait for each answer."""
    return Limits(max_block_size=max_block_size, max_blocks=max_blocks, wait=timeout)


def raw_io(transport: str, io: str, iface: str | None, raw_addr: str | None,
           device: str | None = None) -> dict:
    """The binding options ``--io`` asks for ({} for the soft RNIC on kernel sockets)."""
    if io == "verbs":
        if iface or raw_addr:
            raise click.UsageError("--iface and --addr are for --io raw; --io verbs takes --device")
        return {"io": "verbs", "device": device}
    if device:
        raise click.UsageError("--device needs --io verbs")
    if io != "raw":
        return {}
    if transport != "roce" or not iface or not raw_addr:
        raise click.UsageError("--io raw needs RoCEv2, --iface and --addr")
    from ..rnic.roce_raw import parse_addr
    try:
        parse_addr(raw_addr)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--addr") from None
    return {"io": "raw", "iface": iface, "addr": raw_addr}


class Output(click.Path):
    """A file the command writes (with ``folder``: a folder it makes as needed and writes
    into), checked as the command line is read, before any work: a path that cannot be
    written is a usage error, not a run lost at its end. With ``dash``, ``-`` is standard
    output; with ``opened`` (a mode), the command gets the file opened lazily, not its path."""

    def __init__(self, *, folder: bool = False, dash: bool = False, opened: str | None = None,
                 path_type: type | None = None) -> None:
        super().__init__(file_okay=not folder, dir_okay=folder, allow_dash=dash, path_type=path_type)
        self.folder, self.opened = folder, opened

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not (self.allow_dash and value == "-"):
            trouble = unwritable(Path(os.fsdecode(value)), self.folder)
            if trouble:
                self.fail(trouble, param, ctx)
        if self.opened:
            return click.File(self.opened).convert(value, param, ctx)
        return super().convert(value, param, ctx)


def unwritable(path: Path, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written (a file; with ``folder``, a folder made as needed), or
    None. Its folder is proved writable by a nameless file made in it and dropped: root passes
    every permission check, and /proc takes no new file whoever asks."""
    try:
        if path.exists():
            if path.is_dir() != folder:
                raise OSError(errno.ENOTDIR if folder else errno.EISDIR, "")
            if not folder:
                if not os.access(path, os.W_OK):
                    raise PermissionError(errno.EACCES, "")
                return None
            probe = path
        elif folder:
            probe = next(p for p in path.absolute().parents if p.exists())
        else:
            probe = path.parent
            if not probe.exists():
                return line(f"cannot write {path}", f"there is no folder {probe}",
                            "create it first, or pick a path in a folder that exists")
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "")
        with tempfile.TemporaryFile(dir=probe):
            return None
    except OSError as exc:
        return file_line(path, exc)


def needs(extra: Extra, *modules: str):
    """A callback that refuses its option, when given, unless ``modules`` of ``extra`` are
    installed: found as the command line is read, not after the run."""
    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None:
            missing = lacking(param.opts[0], extra, *modules)
            if missing:
                raise click.UsageError(missing, ctx)
        return value
    return check
