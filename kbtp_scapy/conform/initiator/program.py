"""Running the initiator under test: one process per run, in its own process group.

The command line's placeholders and the environment carry the same things (see
``docs/INITIATOR_CONFORMANCE.md``): ``{url}`` KBTP_TARGET_URL, ``{local}`` KBTP_LOCAL,
``{ops}`` KBTP_OPS, ``{in}`` KBTP_IN, ``{out}`` KBTP_OUT, ``{state}`` KBTP_STATE,
``{timeout}`` KBTP_TIMEOUT (seconds the program has to give up by itself). A run
that outlives the checker's patience (``patience``, re-asked as the run goes: it grows
once the program has shown its pace) is killed with its whole process group, and so is
anything a program leaves running after it exits: the checker leaves no process behind.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...initiator.script import RESULTS, parse_results

PLACEHOLDERS = {"url": "KBTP_TARGET_URL", "local": "KBTP_LOCAL", "ops": "KBTP_OPS",
                "in": "KBTP_IN", "out": "KBTP_OUT", "state": "KBTP_STATE", "timeout": "KBTP_TIMEOUT"}


class ProgramMissing(Exception):
    """The command cannot be started at all."""


@dataclass
class Run:
    argv: list[str]
    exit_code: int | None            # None: killed when the checker's patience ran out
    seconds: float
    out_dir: Path
    stderr: str = ""
    results: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None

    def statuses(self) -> list[str]:
        return [status for _, _, status in self.results]

    def output(self, name: str) -> bytes | None:
        path = self.out_dir / name
        return path.read_bytes() if path.is_file() else None

    def tail(self) -> str:
        """The last line the program wrote on stderr, for a reason."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1][:300] if lines else "(nothing on stderr)"


def command(template: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for arg in template:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


async def run(template: list[str], values: dict[str, str], patience: Callable[[float], float]) -> Run:
    """Run the program once with ``values`` (placeholder name -> text) and wait for it:
    ``patience(started)`` seconds from its start (``time.monotonic``), asked again
    whenever they run out."""
    argv = command(template, values)
    env = {**os.environ, **{PLACEHOLDERS[k]: v for k, v in values.items()}}
    out_dir = Path(values["out"])
    err_path = out_dir.parent / (out_dir.name + ".stderr")
    started = time.monotonic()
    with err_path.open("wb") as err:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                start_new_session=True)
        except FileNotFoundError:
            raise ProgramMissing(f"{argv[0]}: no such program (give its path, or install it)") from None
        except PermissionError:
            raise ProgramMissing(f"{argv[0]}: not executable (chmod +x it)") from None
        except OSError as exc:
            raise ProgramMissing(f"{argv[0]}: cannot be started ({exc.strerror or exc})") from None
        code: int | None = None
        try:
            while (left := started + patience(started) - time.monotonic()) > 0:
                try:
                    code = await asyncio.wait_for(proc.wait(), left)
                    break
                except TimeoutError:
                    continue
            else:
                _kill_group(proc.pid)
                await proc.wait()
        finally:                          # also when the case is cancelled meanwhile
            _kill_group(proc.pid)          # whatever it started and left running
    text = (out_dir / RESULTS).read_text() if (out_dir / RESULTS).is_file() else ""
    return Run(argv, code, time.monotonic() - started, out_dir,
               err_path.read_text(errors="replace"), parse_results(text))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
