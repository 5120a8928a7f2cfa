"""Why a connection or an operation failed, in words: never an empty reason.

Exceptions from sockets and the soft RNIC often carry no message (a bare ``TimeoutError``
from ``asyncio.wait_for``, a ``ConnectionLost()``); the commands say what such an
exception means and what to try next, as ``kbtp: <what failed>: <why>; <what to do>``.
"""
from __future__ import annotations

import errno
import os

import click

from ..initiator.limits import NoAnswer
from ..rnic.qp import ConnectionLost, RemoteError, foreign
from ..rnic.roce_raw import NEEDS_NET_RAW
from ..wire.address import ROCE_PORT, Address

#: what a command catches from a connection: the soft RNIC's errors and the OS's
CONNECTION_ERRORS = (ConnectionLost, RemoteError, OSError, TimeoutError)


class Exit(click.ClickException):
    """Ends a command with its own exit code and a one-line reason, after its output."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        # click's stubs declare exit_code a ClassVar; click reads it from the instance
        self.exit_code = code  # type: ignore[misc]


def reason(exc: BaseException, timeout: float | None = None) -> str:
    """The exception's own message, or what an exception of its kind means."""
    if isinstance(exc, PermissionError) and exc.strerror == NEEDS_NET_RAW:
        return NEEDS_NET_RAW
    if isinstance(exc, OSError) and exc.errno:
        text = os.strerror(exc.errno)
        if exc.strerror and exc.strerror != text:
            text = f"{text} ({exc.strerror})"      # asyncio's "Connect call failed (...)"
        return text[0].lower() + text[1:]
    text = str(exc).strip()
    if text:
        return text
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s" if timeout else "no answer in time"
    if isinstance(exc, ConnectionLost):
        return "the connection ended and the RNIC gave no reason"
    if isinstance(exc, RemoteError):
        return "the target refused an RDMA operation and gave no reason"
    return type(exc).__name__


def hint(exc: BaseException) -> str:
    """What to try next after ``exc`` (empty when nothing useful can be said)."""
    if isinstance(exc, NoAnswer):          # a session that was up: someone is listening
        return "the target's log may say why it stopped answering (a longer wait: --timeout SECONDS)"
    if isinstance(exc, TimeoutError):
        return "is a KBTP target listening there? (a longer wait: --timeout SECONDS)"
    if isinstance(exc, ConnectionRefusedError):
        return "is a KBTP target listening there? (kbtp target --listen HOST[:PORT])"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "stop whatever holds that address, or pick another with --local ADDR"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL:
        return "give an address of this host with --local ADDR"
    if isinstance(exc, PermissionError) and exc.strerror == NEEDS_NET_RAW:
        return ("run as root, or grant it (setcap cap_net_raw+ep on the Python interpreter, or "
                "in a container --cap-add NET_RAW)")
    if foreign(exc):
        return "give the address and port of a KBTP target (kbtp target --listen HOST[:PORT])"
    if isinstance(exc, ConnectionLost | RemoteError | ConnectionResetError):
        return "the target's log may say why"
    return ""


def line(what: str, why: str, todo: str = "") -> str:
    """``<what failed>: <why>; <what to do>`` (``kbtp: `` is added by the command)."""
    return f"{what}: {why}" + (f"; {todo}" if todo else "")


def describe(what: str, exc: BaseException, timeout: float | None = None) -> str:
    return line(what, reason(exc, timeout), hint(exc))


def local_trouble(exc: BaseException, url: Address, local: str | None) -> str | None:
    """``cannot send from ADDR (UDP port N)`` when ``exc`` is about the initiator's own
    RoCEv2 address (taken, or not this host's), else None: that address is what failed."""
    if url.transport != "roce" or not isinstance(exc, OSError) \
            or exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return None
    from ..rnic.roce import default_local
    local = local or default_local(url.host)
    port = url.port + 1 if local == url.host else ROCE_PORT
    return f"cannot send from {local} (UDP port {port}) to {url}"


class OutputClosed(Exception):
    """Standard output's reader went away (``| head``): stop quietly. Not an OSError, so that
    handlers of connection errors let it through."""


def say(text: str, err: bool = False) -> None:
    """``click.echo``, with a closed standard output raised as ``OutputClosed``."""
    try:
        click.echo(text, err=err)
    except BrokenPipeError:
        raise OutputClosed from None


#: what to do about a file that cannot be opened, by errno
FILE_TODO = {errno.ENOENT: "check the path (its folder must exist)",
             errno.EISDIR: "give the path of a file, not of a folder",
             errno.ENOTDIR: "a part of the path is a file, not a folder",
             errno.EACCES: "pick a path you may use, or fix its permissions",
             errno.EROFS: "pick a path on a writable file system",
             errno.ENOSPC: "free some space or pick another file system"}


def file_line(path: str | os.PathLike, exc: OSError, doing: str = "write", option: str = "") -> str:
    """``cannot write PATH (OPTION): why; what to do``: the path named, not the URL."""
    where = f" ({option})" if option else ""
    return line(f"cannot {doing} {os.fspath(path)}{where}", reason(exc), FILE_TODO.get(exc.errno or 0, ""))


def file_trouble(path: str | os.PathLike, exc: OSError, doing: str = "write",
                 option: str = "") -> click.ClickException:
    """``file_line`` as the command's error (exit 1)."""
    return click.ClickException(file_line(path, exc, doing, option))
