"""The Wireshark GUI under Xvfb, with the C plugin as ``kbtp dissector install --c`` puts it
into a HOME of the test's own (tests/tshark.py): it opens a capture, goes to a KBTP
frame (``-g``), and the packet details it draws, every item expanded and copied as text
(Edit > Copy > All Visible Items), are the tree ``tshark -V`` prints for that frame with
the same plugin. Wireshark says nothing of plugins, Lua or dissector errors on stderr. A
screenshot of the KBTP tree is what docs/dissector-gui.png shows.

Needs Debian's wireshark-qt, xvfb, xdotool (keys), xclip (the clipboard) and x11-apps +
netpbm (the screenshot), which tools/install.sh installs; skips, saying which is missing,
without them.
"""
from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cplugin import ROOT, TCP_FIRST, needs_toolchain
from tests.tshark import UNPRIVILEGED, Installed, installed_c_plugin, needs_tshark

TOOLS = {"wireshark": "wireshark-qt", "Xvfb": "xvfb", "xdotool": "xdotool", "xclip": "xclip",
         "xwd": "x11-apps", "xwdtopnm": "netpbm"}
MISSING = [f"{tool} (Debian: {package})" for tool, package in TOOLS.items() if shutil.which(tool) is None]
pytestmark = [needs_tshark, needs_toolchain, pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)}")]

PCAP = ROOT / "pcaps" / "roce_session.pcap"
FRAME = 3                              # HELLO_ACK: the tree with a table and its subtrees
WIDTH, HEIGHT = 900, 860
#: Where Wireshark keeps a window's geometry and panes (recent_common, recent): a window of
#: known size at the origin, no bytes pane, a short packet list.
RECENT_COMMON = (f"gui.geometry_main_x: 0\ngui.geometry_main_y: 0\ngui.geometry_main_width: {WIDTH}\n"
                 f"gui.geometry_main_height: {HEIGHT}\ngui.geometry_main_maximized: FALSE\n")
RECENT = "gui.byte_view_show: FALSE\ngui.packet_diagram_show: FALSE\ngui.geometry_main_upper_pane: 180\n"
#: Wireshark 4.0's shortcuts: View > Expand All / Collapse All, Edit > Copy > All Visible
#: Items and Description (the selected item's text).
EXPAND_ALL, COLLAPSE_ALL, EXPAND_SUBTREES = "ctrl+Right", "ctrl+Left", "shift+Right"
COPY_VISIBLE, COPY_DESCRIPTION = "ctrl+alt+shift+a", "ctrl+alt+shift+d"


def x_tool(env: dict[str, str], *args: str) -> str:
    """What an X client (xdotool, xclip) prints on the test's display."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60, env=env)
    return proc.stdout


@pytest.fixture
def display(tmp_path) -> Iterator[str]:
    """An X server of the test's own (the first free display number)."""
    read, write = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "1024x900x24", "-nolisten", "tcp"],
                              pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    with open(read) as pipe:
        number = pipe.readline().strip()
    assert number.isdigit(), "Xvfb did not start"
    try:
        yield f":{number}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def tshark_tree(tshark: str, pcap: Path, frame: int, env: dict[str, str]) -> list[str]:
    """``tshark -V`` for one frame of the whole capture (every frame dissected, as the GUI
    does), as lines."""
    proc = subprocess.run([tshark, "-n", "-r", str(pcap), *TCP_FIRST, "-V"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    blocks = proc.stdout.split("\n\n")
    block = next(b for b in blocks if b.lstrip("\n").startswith(f"Frame {frame}:"))
    return block.strip("\n").splitlines()


def copied(env: dict[str, str], window: str, *keys: str) -> list[str]:
    """What Wireshark puts on the clipboard after ``keys``."""
    subprocess.run(["xdotool", "windowfocus", "--sync", window, "key", "--delay", "100", *keys],
                   capture_output=True, timeout=60, env=env)
    time.sleep(0.5)
    return x_tool(env, "xclip", "-o", "-selection", "clipboard").strip("\n").splitlines()


def test_the_gui_draws_the_tree_tshark_prints(display, tmp_path):
    """Wireshark with the plugin as `kbtp dissector install --c` installs it."""
    with installed_c_plugin() as installed:
        tree_as_shown(installed, display, tmp_path)


def tree_as_shown(installed: Installed, display: str, tmp_path: Path) -> None:
    env = dict(installed.env)
    config = installed.home / ".config/wireshark"
    config.mkdir(parents=True, exist_ok=True)
    (config / "recent_common").write_text(RECENT_COMMON)
    (config / "recent").write_text(RECENT)
    runtime = installed.home / "run"            # Qt wants one of the user's own, mode 0700
    runtime.mkdir(mode=0o700)
    if installed.as_user:
        subprocess.run(["chmod", "-R", "a+rwX", str(config)], check=True, timeout=60)
        os.chown(runtime, int(UNPRIVILEGED), int(UNPRIVILEGED))
    env.update(DISPLAY=display, XDG_RUNTIME_DIR=str(runtime))
    pcap = installed.pcaps / PCAP.name
    want = tshark_tree(installed.tshark, pcap, FRAME, env)
    assert any(line.startswith("KV Cache Block Transfer Protocol, HELLO_ACK") for line in want)

    gui = subprocess.Popen([*installed.as_user, "wireshark", "-n", "-r", str(pcap), *TCP_FIRST, "-g", str(FRAME)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        window, tree = "", []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and tree != want:     # until frame 3 is drawn
            time.sleep(1)
            window = window or x_tool(env, "xdotool", "search", "--name", PCAP.name).split("\n")[0]
            if window:
                tree = copied(env, window, EXPAND_ALL, COPY_VISIBLE)
        assert window, "no Wireshark window"
        assert tree == want, "\n".join(line for line in difflib.unified_diff(want, tree, lineterm=""))

        # The KBTP item alone expanded, selected and photographed: collapse all, a click
        # below the items (the packet details take the keys), down to the last item (one
        # Down per item at most), expand its subtrees.
        subprocess.run(["xdotool", "windowfocus", "--sync", window, "key", COLLAPSE_ALL, "mousemove",
                        str(WIDTH // 2), str(HEIGHT - 100), "click", "1"], capture_output=True, timeout=60, env=env)
        items = sum(not line.startswith(" ") for line in want)
        top = copied(env, window, *["Down"] * items, EXPAND_SUBTREES, COPY_DESCRIPTION)
        assert top == [next(line for line in want if line.startswith("KV Cache Block Transfer Protocol"))]
        shot = tmp_path / "wireshark-kbtp.png"
        xwd = subprocess.run(["xwd", "-root", "-silent"], capture_output=True, timeout=60, env=env).stdout
        pnm = subprocess.run(["xwdtopnm"], input=xwd, capture_output=True, timeout=60).stdout
        cut = subprocess.run(["pamcut", "-left", "0", "-top", "0", "-width", str(WIDTH), "-height", str(HEIGHT)],
                             input=pnm, capture_output=True, timeout=60).stdout
        shot.write_bytes(subprocess.run(["pnmtopng", "-compression", "9"], input=cut, capture_output=True,
                                        timeout=60).stdout)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(set(cut[-WIDTH * 3 * 400:])) > 2, "the lower half of the window is blank"
    finally:
        subprocess.run(["xdotool", "key", "ctrl+q"], capture_output=True, timeout=60, env=env)
        try:
            gui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gui.kill()
        _, stderr = gui.communicate(timeout=30)
    complaints = [line for line in stderr.splitlines()
                  if re.search(r"plugin|kbtp|lua|dissector|error|critical|bug", line, re.IGNORECASE)]
    assert not complaints, stderr
