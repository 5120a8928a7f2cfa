"""How the tests stop a long run as users do: Ctrl-C, or a CI job's timeout
(``timeout 300 kbtp ...``, which sends SIGTERM to the command and then to its process
group: twice)."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

#: (signals, the exit status they give, the name the run's messages use)
STOPS = pytest.mark.parametrize(("sigs", "code", "name"), [
    ((signal.SIGINT,), 130, "Ctrl-C"), ((signal.SIGTERM,), 143, "SIGTERM"),
    ((signal.SIGTERM, signal.SIGTERM), 143, "SIGTERM")], ids=["ctrl-c", "sigterm", "timeout"])


def stop(proc: subprocess.Popen, sigs: tuple[int, ...]) -> None:
    """Send ``sigs`` a moment apart, as timeout(1) signals the command and then its group."""
    for i, sig in enumerate(sigs):
        if i:
            time.sleep(0.05)
        proc.send_signal(sig)
