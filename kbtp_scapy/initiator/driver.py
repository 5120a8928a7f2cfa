"""The Python API as a program the initiator checker can run: ``python -m kbtp_scapy.initiator.driver``.

It is the adapter of the driver interface (``docs/INITIATOR_CONFORMANCE.md``) for the
reference initiator's API, and an example for wrapping another library: read the
environment, connect, run the script, write the results, say GOODBYE.

    KBTP_TARGET_URL  the target (iwarp://HOST:PORT or roce://HOST[:PORT])
    KBTP_OPS         the operation script (``script.py``)
    KBTP_IN          directory holding the data of stores
    KBTP_OUT         directory for the data of loads and the ``results`` file
    KBTP_STATE       directory the initiator keeps its Initiator ID in across runs
    KBTP_LOCAL       RoCEv2: the local address to send from (optional)
    KBTP_TIMEOUT     seconds the whole session may take before the driver gives up (default 10)

Exit status 0 when every operation was issued and its status written (whatever the
statuses), 1 when the session failed, 2 for a bad script or environment.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from ..rnic.qp import ConnectionLost, RemoteError
from .client import Initiator
from .results import KbtpError, Result
from .script import RESULTS, Op, Script, ScriptError, parse, result_line

ID_FILE = "initiator_id"


def initiator_id(state: Path) -> bytes:
    """The Initiator ID kept in ``state`` (mode 0600), made from the OS's CSPRNG on first use."""
    path = state / ID_FILE
    if path.exists():
        value = bytes.fromhex(path.read_text().strip())
        if len(value) == 16:
            return value
    state.mkdir(parents=True, exist_ok=True)
    value = secrets.token_bytes(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value.hex() + "\n")
    return value


class Runner:
    """Runs a parsed script on a connected ``Initiator``; returns whether the last
    GOODBYE (if the script has one) asked for RELEASE, and ``None`` when the script had
    none, so the caller ends the session its own way."""

    def __init__(self, ini: Initiator, in_dir: Path, out_dir: Path) -> None:
        self.ini, self.in_dir, self.out_dir = ini, in_dir, out_dir
        self.lines: list[str] = []

    def handle(self, op: Op) -> int:
        assert op.handle is not None
        return self.ini.target.handle_base + op.handle

    def input(self, op: Op) -> bytes:
        assert op.file is not None
        return (self.in_dir / op.file).read_bytes()

    async def run(self, script: Script) -> bool | None:
        results = self.out_dir / RESULTS
        results.write_text("")
        for statement in script:
            for op in statement:
                if op.name == "goodbye":
                    self._write(results, [result_line(op, "OK")])
                    await self.ini.goodbye(release="release" in op.words)
                    return "release" in op.words
            done = await asyncio.gather(*(self.one(op) for op in statement))
            self._write(results, [result_line(op, status) for op, status in zip(statement, done)])
        return None

    def _write(self, results: Path, lines: list[str]) -> None:
        self.lines += lines
        with results.open("a") as f:
            f.write("".join(line + "\n" for line in lines))

    async def one(self, op: Op) -> str:
        """The status name of one operation (``ERROR`` when none came back)."""
        try:
            result = await self._call(op)
        except KbtpError as exc:
            return exc.name
        except (ConnectionLost, RemoteError):
            raise
        if result.data is not None and op.file:
            (self.out_dir / op.file).write_bytes(result.data)
        return result.status_name

    async def _call(self, op: Op) -> Result:
        ini, h, w = self.ini, self.handle(op), op.words
        record = "record" in w
        if op.name in ("alloc_store", "store"):
            data = self.input(op)
            inline = True if "inline" in w else False if "noinline" in w else None
            method = ini.alloc_store if op.name == "alloc_store" else ini.store
            return await method(h, data, seal="seal" in w, inline=inline, record=record)
        if op.name == "load":
            return await ini.load(h, allow_unsealed="unsealed" in w, record=record)
        if op.name == "free":
            return await ini.free(h, record=record)
        if op.name == "direct_load":
            return await ini.direct_load(h)
        return await ini.direct_alloc(h, self.input(op))


async def run_session(url: str, script: Script, in_dir: Path, out_dir: Path, state: Path,
                      local: str | None = None) -> None:
    options: dict[str, Any] = {"local": local} if local else {}
    ini = await Initiator.connect(url, initiator_id=initiator_id(state), **options)
    try:
        said = await Runner(ini, in_dir, out_dir).run(script)
        if said is None:
            await ini.goodbye(release=False)
    finally:
        await ini.close()


def main(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    missing = [k for k in ("KBTP_TARGET_URL", "KBTP_OUT") if not env.get(k)]
    if missing:
        print(f"kbtp driver: {', '.join(missing)} not set; see docs/INITIATOR_CONFORMANCE.md",
              file=sys.stderr)
        return 2
    try:
        script = parse(env.get("KBTP_OPS", ""))
    except ScriptError as exc:
        print(f"kbtp driver: KBTP_OPS: {exc}", file=sys.stderr)
        return 2
    out = Path(env["KBTP_OUT"])
    state = Path(env.get("KBTP_STATE") or out / "state")
    try:
        timeout = float(env.get("KBTP_TIMEOUT") or 10)
    except ValueError:
        print(f"kbtp driver: KBTP_TIMEOUT {env['KBTP_TIMEOUT']!r} is not a number of seconds",
              file=sys.stderr)
        return 2
    try:
        asyncio.run(asyncio.wait_for(run_session(
            env["KBTP_TARGET_URL"], script, Path(env.get("KBTP_IN", ".")), out, state,
            env.get("KBTP_LOCAL") or None), timeout))
    except KbtpError as exc:
        print(f"kbtp driver: HELLO refused: {exc}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"kbtp driver: the session did not end within {timeout:g} s (KBTP_TIMEOUT)",
              file=sys.stderr)
        return 1
    except (ConnectionLost, RemoteError, OSError) as exc:
        print(f"kbtp driver: the session failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
