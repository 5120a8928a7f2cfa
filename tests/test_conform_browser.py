"""``kbtp conform --html``'s page in a real browser: headless Chromium (Debian's, which
tools/install.sh installs) renders it, its DOM holds every case's row, the capture link and
the summary's link to each case that did not pass, and the screenshot is a drawn page, not a
blank one."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from .test_conform import _Page, html_report

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tools/install.sh installs it)")


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with a profile of its own (root needs --no-sandbox)."""
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


@needs_chromium
@pytest.mark.slow
def test_the_html_report_renders_in_chromium(monkeypatch, tmp_path):
    page, doc = html_report(monkeypatch, tmp_path)
    dom = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Page()
    parsed.feed(dom.stdout)                 # the page as the browser built it, not as written
    rows = {r["id"]: r for r in parsed.rows}
    assert {c["id"]: c["verdict"] for c in doc["cases"]} == {i: r["verdict"] for i, r in rows.items()}
    [link] = rows["security.clear_freed"]["links"]
    assert (page.parent / link).resolve().is_file()
    not_passed = [f"#{c['id']}" for c in doc["cases"] if c["verdict"] != "PASS"]
    assert parsed.summary == not_passed and all(rows[href[1:]]["id"] == href[1:] for href in not_passed)
    shot = tmp_path / "page.png"
    drawn = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    assert drawn.returncode == 0 and shot.is_file(), drawn.stderr[-2000:]
    import matplotlib.image as mpimg
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (900, 1200)
    assert pixels[..., :3].std() > 0.01, "a blank page"       # text and table lines drawn
