"""``kbtp initiator URL OP ...``: one session with a target, one operation, human or JSON output.

Each run connects, says HELLO with a persistent Initiator ID (kept in a file readable
only by its owner, since it gives access to the bindings), performs one operation and
says GOODBYE without RELEASE, so the next run finds its handle range and bindings.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from functools import update_wrapper
from pathlib import Path
from typing import Any

import click

from .. import tables as T
from ..initiator import Initiator, KbtpError, PeerLimit, Result
from ..initiator.limits import connect_deadline
from ..vocab import Feature
from ..words import count
from .errors import (
    CONNECTION_ERRORS,
    OutputClosed,
    file_trouble,
    hint,
    line,
    local_trouble,
    reason,
    say,
)
from .options import (
    LOCAL_IS_ROCE,
    RAISE_LIMITS,
    Output,
    address,
    feature_names,
    features,
    integer,
    limit_options,
    limits,
    raw_io,
    raw_io_options,
)

DEFAULT_ID_FILE = Path("~/.config/kbtp/initiator_id")
#: the Feature a command (or --record) needs the HELLO_ACK to grant
NEEDS = {"direct-load": "DIRECT_LOAD", "direct-alloc": "DIRECT_ALLOC", "--record": "RECORD_COMPLETION"}
STATUS_DOC = {v.value: v.doc[0].lower() + v.doc[1:] for v in T.STATUS.values}
#: HELLO_ACK fields shown in hex (handles, STags, offsets), as the tables mark them
HEX_KEYS = {f.key.split(".", 1)[1] for f in T.flatten(T.BY_NAME["HELLO_ACK"].body) if f.field.hex}


def _initiator_id(id_hex: str | None, id_file: str) -> bytes:
    if id_hex:
        try:
            value = bytes.fromhex(id_hex)
        except ValueError:
            value = b""
        if len(value) != 16:
            raise click.BadParameter("must be 32 hex digits (128 bits)", param_hint="--id")
        return value
    path = Path(id_file).expanduser()
    try:
        if path.exists():
            try:
                value = bytes.fromhex(path.read_text().strip())
            except (ValueError, UnicodeDecodeError):
                raise click.BadParameter(f"{path} does not hold an Initiator ID (32 hex digits); "
                                         "give another file, or remove this one for a new ID",
                                         param_hint="--id-file") from None
            if len(value) == 16:
                return value
        path.parent.mkdir(parents=True, exist_ok=True)
        value = secrets.token_bytes(16)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value.hex() + "\n")
    except OSError as exc:
        raise file_trouble(path, exc, "keep the Initiator ID in", "--id-file") from None
    return value


class _UrlFirst(click.Group):
    """``kbtp initiator URL [OPTIONS] OP ...``: options may follow the URL."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        op = self._operation(args)
        if op and not args[0].startswith("-"):
            args = [*args[1:op], args[0], *args[op:]]
        return super().parse_args(ctx, args)

    def _operation(self, args: list[str]) -> int | None:
        """Where the operation is in ``URL [OPTIONS] OP ...``: the first word after the URL
        that is neither an option nor an option's value, known or not, so that an unknown
        operation is what click blames."""
        takes_value = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag
                       for name in p.opts}
        i = 1
        while i < len(args):
            word = args[i]
            if not word.startswith("-") or word == "-":
                return i
            i += 2 if word in takes_value else 1
        return None


@click.group(cls=_UrlFirst)
@click.argument("url")
@click.option("--id", "id_hex", default=None, metavar="HEX", help="Initiator ID (32 hex digits).")
@click.option("--id-file", default=str(DEFAULT_ID_FILE), show_default=True,
              help="File holding the Initiator ID, created (mode 0600) if missing; runs at the same "
                   "time need one each.")
@click.option("--features", "feature_list", default="all", show_default=True,
              help="Requested Features: DIRECT_LOAD,DIRECT_ALLOC,RECORD_COMPLETION, all or none.")
@click.option("--credits", type=click.IntRange(1, 0xFFFF), default=32, show_default=True,
              help="Completion Credits (receive buffers posted for completions).")
@click.option("--no-invalidate", is_flag=True, help="Do not ask for Send with Invalidate.")
@click.option("--local", default=None, metavar="ADDR", help="RoCEv2: local address to send from.")
@raw_io_options("initiator")
@click.option("--mtu", type=click.Choice(["256", "512", "1024", "2048", "4096"]), default=None,
              help="RoCEv2 path MTU, which the CM REQ sets for both ends "
                   "[default: the largest the route's link MTU allows].")
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              metavar="SECONDS", help="How long to wait for the connection and for each answer.")
@limit_options
@click.option("--pcap", type=Output(), default=None,
              help="Write every frame sent and received to this pcap file.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per result on stdout, also when the request fails.")
@click.pass_context
def initiator(ctx, url, id_hex, id_file, feature_list, credits, no_invalidate, local, io, iface,
              raw_addr, device, mtu, timeout, max_block_size, max_blocks, pcap, as_json) -> None:
    """Talk to a KBTP target at URL (roce://HOST[:PORT] or iwarp://HOST:PORT): one
    session per run, with the Initiator ID of --id-file so bindings carry over.

    Exit status: 0 every request completed OK; 1 a request failed (a status other than
    OK, no answer) or the connection could not be made or was lost; 2 usage error.

    \b
    Examples (with kbtp target running on each binding):
      kbtp initiator roce://127.0.0.1 hello
      head -c 4096 /dev/urandom > kv.bin
      kbtp initiator roce://127.0.0.1 alloc-store 0x4000 --data-file kv.bin --seal
      kbtp initiator roce://127.0.0.1 load 0x4000 -o out.bin
      kbtp initiator roce://127.0.0.1 --json direct-load 0x4000
      kbtp initiator roce://127.0.0.1 goodbye --release
      kbtp initiator iwarp://127.0.0.1:5420 --json alloc-store 0x4000 --text "KV block"
      kbtp initiator iwarp://127.0.0.1:5420 free 0x4000
    """
    transport = url.split("://", 1)[0] if "://" in url else ""
    if transport not in ("iwarp", "roce"):
        raise click.BadParameter("must start with roce:// or iwarp://", param_hint="URL")
    options = {"connect_timeout": timeout}
    if transport == "roce" and io != "verbs":
        options.update((k, v) for k, v in (("local", local), ("mtu", int(mtu) if mtu else None)) if v)
    elif local and io != "verbs":
        raise click.UsageError(LOCAL_IS_ROCE)
    elif local:
        options["local"] = local
    options.update(raw_io(transport, io, iface, raw_addr, device))
    if io == "verbs" and pcap:
        raise click.UsageError("--pcap records the soft RNIC's frames; with --io verbs the "
                               "device sends them: capture with tcpdump on its interface")
    ctx.obj = dict(url=address(transport, url), initiator_id=_initiator_id(id_hex, id_file),
                   id_source=f"--id {id_hex}" if id_hex else id_file,
                   features=features(feature_list), credits=credits, timeout=timeout,
                   invalidate=not no_invalidate, pcap=pcap, as_json=as_json, options=options,
                   limits=limits(max_block_size, max_blocks, timeout))


class _Failed(click.ClickException):
    """A request or the session failed: exit 1, after the JSON record with --json."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def session(func):
    """Run ``func(initiator, **kwargs)`` inside a connected session, then GOODBYE."""
    @click.pass_context
    def run(ctx, **kwargs):
        o = ctx.obj
        name = ctx.command.name
        op = name.upper().replace("-", "_")
        if kwargs.get("record") and o["url"].transport == "iwarp":
            raise click.UsageError("--record: iWARP targets never grant RECORD_COMPLETION (RDMAP "
                                   "has no RDMA Write with Immediate); leave --record out")
        try:
            asyncio.run(_session(o, name, func, kwargs))
        except _Failed as exc:
            if o["as_json"]:
                handle = kwargs.get("handle")
                click.echo(json.dumps({"op": op, **({"handle": handle} if handle is not None else {}),
                                       "status": None, **exc.record, "error": exc.message}))
            raise
    return update_wrapper(run, func)


async def _session(o: dict, name: str, func, kwargs: dict) -> None:
    sink = None
    if o["pcap"]:
        from ..rnic.pcap import PcapSink  # Scapy's writer: imported only when asked for
        try:
            sink = PcapSink(o["pcap"])
        except OSError as exc:
            raise file_trouble(o["pcap"], exc, option="--pcap") from None
    url, timeout = o["url"], o["timeout"]
    try:
        try:
            ini = await asyncio.wait_for(Initiator.connect(
                url, initiator_id=o["initiator_id"], features=o["features"], credits=o["credits"],
                invalidate=o["invalidate"], frame_listeners=[sink] if sink else None,
                limits=o["limits"], **o["options"]), connect_deadline(timeout))
        except PeerLimit as exc:
            raise _failure(f"{url}: HELLO_ACK not usable", exc, why=exc.detail,
                           todo=RAISE_LIMITS) from None
        except KbtpError as exc:
            raise _failure(f"{url}: HELLO refused", exc, **_hello_hint(exc, o)) from None
        except CONNECTION_ERRORS as exc:
            raise _failure(_connect_what(exc, o), exc, todo=hint(exc),
                           why=reason(exc, timeout)) from None
        release = False
        try:
            asked = "--record" if kwargs.get("record") else name
            needs = NEEDS.get(asked)
            if needs and not ini.target.feature(Feature[needs]):
                todo = (f"ask for it with --features {needs} (a target that does not offer it "
                        "never grants it)" if not o["features"] & Feature[needs] else
                        "the target grants it while it has a partition free: all may be held by "
                        "other sessions (its log says so); they give one back with GOODBYE "
                        "--release" if needs == "DIRECT_ALLOC" else
                        f"{url} may not offer it (its start-up line lists what it offers)")
                raise _failure(asked, why=f"{url} did not grant {needs}", todo=todo)
            release = await ini.within(func(ini, o, **kwargs), "complete answer")   # all of it: --timeout
        except KbtpError as exc:
            raise _failure(_what(name, kwargs), exc, **_status_hint(exc, ini, o, kwargs)) from None
        except CONNECTION_ERRORS as exc:
            raise _failure(f"{_what(name, kwargs)} at {url}", exc, todo=hint(exc),
                           why=reason(exc, timeout)) from None
        finally:
            await ini.end(release=bool(release))
    finally:
        if sink:
            sink.close()


def _failure(what: str, exc: BaseException | None = None, *, context: str = "", todo: str = "",
             why: str = "") -> _Failed:
    """The one-line error, and the fields a --json record of it carries."""
    record: dict = {}
    if isinstance(exc, KbtpError):
        meaning = STATUS_DOC.get(exc.status, "a Private Use or unknown status")
        context = exc.detail or context
        why = why or f"{exc.name} ({meaning}{': ' + context if context else ''})"
        record = exc.result.as_dict() if exc.result else {"status": exc.name}
    return _Failed(line(what, why or "refused", todo), record)


def _what(name: str, kwargs: dict) -> str:
    return f"{name} {kwargs['handle']:#x}" if kwargs.get("handle") is not None else name


def _connect_what(exc: BaseException, o: dict) -> str:
    local = o["options"].get("local") or o["options"].get("addr", "").split("/")[0]
    return local_trouble(exc, o["url"], local) or f"cannot connect to {o['url']}"


def _hello_hint(exc: KbtpError, o: dict) -> dict[str, str]:
    """Why a HELLO was refused and what to do: its statuses mean other things there."""
    if exc.name == "ALREADY_BOUND":
        return {"why": f"ALREADY_BOUND: another session is using the Initiator ID of "
                       f"{o['id_source']}",
                "todo": "give runs at the same time an --id-file each (or --id HEX)"}
    if exc.name == "NO_SPACE":
        return {"why": "NO_SPACE: the target admits no more initiators",
                "todo": "end other sessions (goodbye --release) or start the target with more "
                        "--max-initiators"}
    return {}


def _status_hint(exc: KbtpError, ini: Initiator, o: dict, kwargs: dict) -> dict[str, str]:
    """What a status means for the request the user gave (context), and what to change."""
    t, name, r = ini.target, exc.name, exc.result
    handle = kwargs.get("handle")
    size = o.get("data_length")
    hints = {
        "TOO_LARGE": (f"{size} octets of data, the target's Block Size is {t.block_size}"
                      if size is not None else f"the target's Block Size is {t.block_size}",
                      f"store at most {t.block_size} octets per block"),
        "NOT_SEALED": ("", "store the block with --seal" + (
            "" if kwargs.get("allow_unsealed") is None else ", or load it with --allow-unsealed")),
        "SEALED": ("", "a sealed block does not change: free it and alloc-store it again"),
        "NOT_VALID": ("", f"alloc-store {handle:#x} first" if handle is not None else ""),
        "ALREADY_BOUND": ("", "overwrite it with store, or free it first"),
        "INVALID_HANDLE": (f"this initiator's handles are {t.handle_base:#x} to "
                           f"{t.handle_base + t.handle_count - 1:#x}", ""),
        "STALE_GENERATION": (f"the entry's Generation is {r.generation if r else '?'}, "
                             f"not {kwargs.get('generation')}",
                             f"give --generation {r.generation if r else 0}, or 0 for any"),
        "NO_SPACE": (f"the quota is {t.quota} blocks, or the target's ring is empty",
                     "free blocks first"),
        "TICKET_ABANDONED": (f"the Ticket Timeout is {t.ticket_timeout_ms} ms",
                             "bind within it"),
        "MALFORMED": ("", "the target's log may say why"),
        "INTERNAL": ("", "the target's log may say why"),
    }
    context, todo = hints.get(name, ("", ""))
    return {"context": context, "todo": todo}


def emit(o: dict, op: str, handle: int | None, result: Result | None, to_stderr: bool = False,
         **extra) -> None:
    """One line per result: JSON, or text (on stderr when stdout carries the data)."""
    if o["as_json"]:
        record = {"op": op, **({"handle": handle} if handle is not None else {}),
                  **(result.as_dict() if result else {}), **extra}
        say(json.dumps(record), err=to_stderr)
        return
    if result is None:
        say(f"{op}: " + ", ".join(f"{k} {v}" for k, v in extra.items()), err=to_stderr)
        return
    say(f"{op} 0x{handle:x}: {result.status_name}, generation {result.generation}, "
               f"{count(result.data_length, 'octet')} at block offset 0x{result.block_offset:x}"
               + "".join(f", {k} {v}" for k, v in extra.items()), err=to_stderr)


def _data(o: dict, data_file: str | None, data_hex: str | None, text: str | None) -> bytes:
    """The block's data from the one option that gives it; its size is kept for errors."""
    given = [x for x in (data_file, data_hex, text) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give the data with exactly one of --data-file, --data or --text")
    if data_file is not None:
        try:
            data = sys.stdin.buffer.read() if data_file == "-" else Path(data_file).read_bytes()
        except OSError as exc:
            raise click.BadParameter(f"{data_file}: {reason(exc)}", param_hint="--data-file") from None
    elif text is not None:
        data = text.encode()
    else:
        assert data_hex is not None         # the one given
        try:
            data = bytes.fromhex(data_hex)
        except ValueError:
            raise click.BadParameter("not hex", param_hint="--data") from None
    o["data_length"] = len(data)
    return data


def data_options(func):
    func = click.option("--data-file", type=click.Path(dir_okay=False, allow_dash=True),
                        help="File with the block's data (- for standard input).")(func)
    func = click.option("--data", "data_hex", metavar="HEX", help="The data as hex.")(func)
    func = click.option("--text", help="The data as UTF-8 text.")(func)
    return func


def _output(path: str | None, data: bytes, o: dict) -> dict:
    if path == "-":
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            raise OutputClosed from None
        return {}
    if path:
        try:
            Path(path).write_bytes(data)
        except OSError as exc:
            raise file_trouble(path, exc, option="-o") from None
        return {"written": path}
    return {} if o["as_json"] else {"data": data[:32].hex() + ("..." if len(data) > 32 else "")}


HANDLE = click.argument("handle", type=integer)
GENERATION = click.option("--generation", type=integer, default=0, help="Expected Generation (0: any).")
RECORD = click.option("--record", is_flag=True, help="Ask for a completion record (RoCEv2 only).")


@initiator.command()
@session
async def hello(ini: Initiator, o: dict) -> None:
    """Show what the target grants this initiator (its HELLO_ACK)."""
    t = ini.target
    info = {"features": feature_names(t.features), "request_credits": t.request_credits,
            "block_size": t.block_size, "max_inline": t.max_inline, "quota": t.quota,
            "handle_base": t.handle_base, "handle_count": t.handle_count,
            "ticket_timeout_ms": t.ticket_timeout_ms, **t.fields}
    if o["as_json"]:
        say(json.dumps({"op": "HELLO", **info}))
        return
    for key, value in info.items():
        shown = f"{value:#x}" if key in HEX_KEYS and key != "features" else value
        say(f"{key:>18}: {shown}")


@initiator.command()
@HANDLE
@click.option("-o", "--output", type=Output(dash=True), default=None,
              help="Write the block's data here (- for standard output).")
@GENERATION
@click.option("--allow-unsealed", is_flag=True, help="Load even if the block is not sealed.")
@RECORD
@session
async def load(ini, o, handle, output, generation, allow_unsealed, record):
    """Block Load: read HANDLE's block into a fresh buffer."""
    r = await ini.load(handle, generation=generation, allow_unsealed=allow_unsealed, record=record)
    emit(o, "LOAD", handle, r, output == "-", **_output(output, r.data, o))


def _store_command(name: str, opcode: str, method: str, doc: str):
    @initiator.command(name=name, help=doc)
    @HANDLE
    @data_options
    @GENERATION
    @click.option("--seal", is_flag=True, help="Seal the block after the store.")
    @click.option("--inline/--no-inline", default=None,
                  help="Send the data in the request [default: when it fits Max Inline] "
                       "or let the target RDMA-Read it.")
    @RECORD
    @session
    async def command(ini, o, handle, data_file, data_hex, text, generation, seal, inline, record):
        data = _data(o, data_file, data_hex, text)
        r = await getattr(ini, method)(handle, data, generation=generation, seal=seal,
                                       inline=inline, record=record)
        emit(o, opcode, handle, r)
    return command


_store_command("store", "STORE", "store", "Block Mapped Store: overwrite HANDLE's bound block.")
_store_command("alloc-store", "ALLOC_STORE", "alloc_store",
               "Block Unmapped Store: allocate a block for HANDLE and store the data.")


@initiator.command()
@HANDLE
@GENERATION
@RECORD
@session
async def free(ini, o, handle, generation, record):
    """Block Free: unbind HANDLE and return its block."""
    emit(o, "FREE", handle, await ini.free(handle, generation=generation, record=record))


@initiator.command(name="direct-load")
@HANDLE
@click.option("-o", "--output", type=Output(dash=True), default=None,
              help="Write the block's data here (- for standard output).")
@session
async def direct_load(ini, o, handle, output):
    """DIRECT_LOAD: RDMA-read the entry, the block, and the entry again."""
    r = await ini.direct_load(handle)
    emit(o, "DIRECT_LOAD", handle, r, output == "-", **_output(output, r.data, o))


@initiator.command(name="direct-alloc")
@HANDLE
@data_options
@session
async def direct_alloc(ini, o, handle, data_file, data_hex, text):
    """DIRECT_ALLOC: FetchAdd on the Head, read the slot, write the block, BIND."""
    emit(o, "DIRECT_ALLOC", handle, await ini.direct_alloc(handle, _data(o, data_file, data_hex, text)))


@initiator.command()
@HANDLE
@click.option("--ticket", type=integer, required=True)
@click.option("--length", type=integer, required=True, help="Data Length.")
@click.option("--block-offset", type=integer, required=True)
@GENERATION
@session
async def bind(ini, o, handle, ticket, length, block_offset, generation):
    """BIND a ticket's block (taken with FetchAdd) to HANDLE."""
    emit(o, "BIND", handle, await ini.bind(handle, ticket, length, block_offset, generation=generation))


@initiator.command()
@click.option("--release", is_flag=True, help="Free every block this initiator has bound.")
@session
async def goodbye(ini, o, release):
    """End the session now; with --release the target frees all our bindings."""
    emit(o, "GOODBYE", None, None, release=release)
    return release
