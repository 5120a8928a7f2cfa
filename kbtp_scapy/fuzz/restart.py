"""The restart hook (AFL's and boofuzz's): a target that went away is started again by the
user's command and the run goes on, instead of ending at the first crash."""
from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from ..initiator.presence import absent
from .trouble import describe


@dataclass
class Restart:
    """``--restart-cmd`` and ``--restart-timeout``."""

    cmd: str
    timeout: float = 30.0


async def restart(hook: Restart, url: str, options: dict[str, Any], timeout: float) -> str | None:
    """Run the command through the shell, not waiting for it to end (it may be the target
    itself, left running), until the target answers a HELLO again: None once it does, else
    why not within ``hook.timeout`` seconds (or the command failed first)."""
    proc = subprocess.Popen(hook.cmd, shell=True, stdin=subprocess.DEVNULL,
                            stdout=2, start_new_session=True)   # its output on stderr: stdout is the report's
    deadline = time.monotonic() + hook.timeout
    why = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        exc = await absent(url, options, max(0.1, min(timeout, left)), pause=min(0.2, left))
        if exc is None:
            return None
        why = describe(exc, timeout)
        if proc.poll():
            return f"the restart command exited with status {proc.returncode} ({why})"
        await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return f"it did not answer a HELLO within --restart-timeout {hook.timeout:g} s after the restart command ({why})"
