"""tools/bench_dissector.py and tools/bench_decode.py time tshark with its own HOME: a KBTP
plugin the user installed does not load into "plain tshark", and every configuration is
checked to load what it is named for before it is timed."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .tshark import needs_tshark

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "dissector" / "kbtp.lua"
sys.path.insert(0, str(ROOT / "tools"))

import bench_dissector  # noqa: E402 - a tool, not a package

pytestmark = [needs_tshark, pytest.mark.slow]     # tshark starts in seconds here


def _install_lua(home: Path) -> None:
    """kbtp.lua where 'kbtp dissector install --lua' puts it for a user with this HOME."""
    folder = home / ".local/lib/wireshark/plugins"
    folder.mkdir(parents=True)
    shutil.copyfile(LUA, folder / "kbtp.lua")


def test_the_users_plugin_does_not_load_into_plain_tshark(tmp_path, monkeypatch):
    _install_lua(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    mine = subprocess.run(["tshark", "-G", "plugins"], capture_output=True, text=True, timeout=120).stdout
    assert "kbtp.lua" in mine                     # the user's tshark loads it
    bench_dissector.check_plugins("tshark", [])   # the benchmark's does not
    env = bench_dissector.tshark_env()
    assert env["HOME"] != str(tmp_path) and not any(k.startswith("WIRESHARK_") for k in env)


def test_a_configuration_that_loads_more_than_its_name_stops_the_run(tmp_path, monkeypatch):
    _install_lua(tmp_path)
    for sub in (".config", ".local/share", ".cache"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(bench_dissector, "_home", lambda: tmp_path)
    with pytest.raises(SystemExit, match=r"tshark: tshark loads \[.*kbtp\.lua'\]"):
        bench_dissector.check_plugins("tshark", [])


def test_the_lua_configuration_loads_its_script():
    bench_dissector.check_plugins("tshark + kbtp.lua", ["-X", f"lua_script:{LUA}"])
    with pytest.raises(SystemExit, match="KBTP not registered"):
        bench_dissector.check_plugins("tshark + C plugin", [], preload=Path("/nonexistent.so"))
