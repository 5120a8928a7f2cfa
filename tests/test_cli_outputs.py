"""Where the tools write: every option that names an output file or folder is checked as the
command line is read (a usage error of one line, exit 2, before any connection or file), an
optional extra that an option needs is looked for then too, and a write that fails at the end
(a full disk) is one line, never a traceback. In process, through ``kbtp``'s own ``main``."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy.cli import main

from .kbtp_harness import fresh_hosts
from .live_capture import free_port

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = str(ROOT / "pcaps" / "roce_session.pcap")
KBTP = [sys.executable, "-m", "kbtp_scapy"]
PATH = "PATH"                  # where a command line below takes the path under test


@pytest.fixture
def listener():
    """A TCP listener that accepts and says nothing, with a check that nobody connected."""
    host = fresh_hosts(1)[0]
    port = free_port(host)
    with socket.create_server((host, port)) as server:
        server.setblocking(False)

        def untouched() -> bool:
            try:
                server.accept()[0].close()
            except BlockingIOError:
                return True
            return False
        yield f"iwarp://{host}:{port}", untouched


def kbtp(capsys, *args: str) -> tuple[int, str]:
    """``kbtp ARGS`` in this process: its exit status and its stderr."""
    code = main(list(args))
    return code, capsys.readouterr().err


def one_line(code: int, err: str, status: int = 2) -> str:
    assert code == status and len(err.splitlines()) == 1 and "Traceback" not in err, (code, err)
    return err


#: every option naming a file a tool writes, in a command line that would start work at once
#: (URL: a listener that never answers; the capture: a sample)
FILES = [
    ["conform", "--target", "URL", "--timeout", "1", "--json-file", PATH],
    ["conform", "--target", "URL", "--timeout", "1", "--junit", PATH],
    ["conform", "--target", "URL", "--timeout", "1", "--html", PATH],
    ["fuzz", "--target", "URL", "--timeout", "1", "--cases", "1", "--json-file", PATH],
    ["replay", SAMPLE, "--target", "URL", "--timeout", "1", "--json-file", PATH],
    ["bench", "URL", "--timeout", "1", "-n", "1", "--pcap", PATH],
    ["bench", "URL", "--timeout", "1", "-n", "1", "--csv", PATH],
    ["bench", "URL", "--timeout", "1", "-n", "1", "--kpi", PATH],
    ["bench", "URL", "--timeout", "1", "-n", "1", "--plot", PATH],
    ["initiator", "URL", "--timeout", "1", "--pcap", PATH, "hello"],
    ["initiator", "URL", "--timeout", "1", "load", "0x4000", "-o", PATH],
    ["initiator", "URL", "--timeout", "1", "direct-load", "0x4000", "-o", PATH],
    ["target", "--listen", "LISTEN", "--duration", "1", "--pcap", PATH],
    ["decode", "--json-file", PATH, SAMPLE],
    ["craft", "LOAD", "-o", PATH],
]
#: every option naming a folder a tool makes (with its parents) and writes into
FOLDERS = [
    ["conform", "--target", "URL", "--timeout", "1", "--pcap-dir", PATH],
    ["conform", "--role", "initiator", "--listen", "URL", "--keep", PATH, "--", "true"],
    ["fuzz", "--target", "URL", "--timeout", "1", "--cases", "1", "--out", PATH],
    ["decode", "--parquet", PATH, SAMPLE],
    ["analyze", "--report", PATH, SAMPLE],
    ["analyze", "--parquet", PATH, SAMPLE],
    ["demo", "--transport", "roce", "--fuzz-cases", "0", "--out", PATH],
    ["dissector", "build", "--out", PATH],
    ["dissector", "install", "--lua", "--folder", PATH],
    ["initiator", "URL", "--timeout", "1", "script", "--ops", "load 0 @x", "--out", PATH],
]
#: (name, path under the test's folder or absolute, what the error says)
BAD_FILES = [("no folder", "none/x.png", "there is no folder"),
             ("a folder", "adir", "is a directory"),
             ("under a file", "afile/x.png", "not a directory"),
             ("under /proc", "/proc/kbtp-nope.png", "")]
BAD_FOLDERS = [("a file", "afile", "not a directory"),
               ("under a file", "afile/d", "not a directory"),
               ("under /proc", "/proc/kbtp-nope/d", "")]


def _cases(commands: list[list[str]], bad: list[tuple[str, str, str]]) -> list:
    return [pytest.param(cmd, path, says, id=f"{cmd[0]} {cmd[cmd.index(PATH) - 1]}, {name}")
            for cmd in commands for name, path, says in bad]


@pytest.mark.parametrize(("command", "where", "says"),
                         _cases(FILES, BAD_FILES) + _cases(FOLDERS, BAD_FOLDERS))
def test_an_output_that_cannot_be_written_is_a_usage_error_before_any_work(
        tmp_path, capsys, listener, command, where, says):
    url, untouched = listener
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    path = where if where.startswith("/") else str(tmp_path / where)
    host = fresh_hosts(1)[0]
    listen = f"{host}:{free_port(host)}"
    args = [path if a == PATH else url if a == "URL" else listen if a == "LISTEN" else a for a in command]
    option = command[command.index(PATH) - 1]
    err = one_line(*kbtp(capsys, *args))
    assert err.startswith(f"kbtp {command[0]}") and f"'{option}'" in err, err
    assert f"cannot write {path}: {says}" in err and url not in err, err
    assert untouched() and not (tmp_path / "none").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]


def test_outputs_that_can_be_written_are_taken(tmp_path, capsys):
    """A special file (/dev/null), and a folder whose parents are made as it is ('-' for
    stdout: tests/test_decode.py, test_fuzz.py, test_bench.py)."""
    assert kbtp(capsys, "decode", "--json-file", "/dev/null", SAMPLE)[0] == 0
    pytest.importorskip("pyarrow")
    deep = tmp_path / "a" / "b"
    assert kbtp(capsys, "decode", "--parquet", str(deep), SAMPLE)[0] == 0
    assert list(deep.glob("*/part-0.parquet"))


@pytest.mark.slow
def test_decode_json_file_is_opened_as_given(tmp_path):
    """decode's --json-file, checked and then opened lazily: a file gets the JSON Lines beside
    the text on stdout, '-' makes stdout JSON Lines (as --json)."""
    lines = tmp_path / "d.json"
    text = subprocess.run([*KBTP, "decode", "--json-file", str(lines), SAMPLE], capture_output=True,
                          text=True, timeout=60)
    dash = subprocess.run([*KBTP, "decode", "--json-file", "-", SAMPLE], capture_output=True, text=True,
                          timeout=60)
    assert text.returncode == 0 and dash.returncode == 0, text.stderr + dash.stderr
    assert "HELLO" in text.stdout.splitlines()[0]
    assert [json.loads(x) for x in lines.read_text().splitlines()] == \
        [json.loads(x) for x in dash.stdout.splitlines()] != []


@pytest.mark.parametrize(("args", "hidden", "extra"), [
    (["bench", "URL", "--timeout", "1", "-n", "1", "--plot", "OUT/b.png"], "matplotlib", "plot"),
    (["analyze", "--report", "OUT/report", SAMPLE], "matplotlib", "plot"),
    (["decode", "--parquet", "OUT/dataset", SAMPLE], "pyarrow", "analyze"),
    (["analyze", "--dask", "local", "--parquet", "OUT/dataset", SAMPLE], "distributed", "analyze"),
], ids=["bench --plot", "analyze --report", "decode --parquet", "analyze --dask"])
def test_a_missing_extra_is_found_before_the_run(tmp_path, capsys, monkeypatch, listener, args, hidden, extra):
    """Without the module an option needs: one line naming the checkout's extra, before any
    connection, and nothing written (analyze --report made its folder first)."""
    url, untouched = listener
    monkeypatch.setitem(sys.modules, hidden, None)          # as if not installed
    args = [url if a == "URL" else a.replace("OUT", str(tmp_path)) for a in args]
    err = one_line(*kbtp(capsys, *args))
    assert f"needs {hidden}: pip install '.[{extra}]' in the checkout" in err, err
    assert untouched() and list(tmp_path.iterdir()) == []


def test_no_message_names_an_extra_of_a_package_index():
    """The README installs from the checkout: ``pip install '.[plot]'``, never
    ``'kbtp_scapy[plot]'`` (which pip looks for on PyPI)."""
    named = [f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "kbtp_scapy").rglob("*.py")
             for m in re.findall(r"pip install \S*kbtp_scapy\[\w+\]", p.read_text())]
    assert named == []


@pytest.mark.parametrize("outputs", [["--csv", "-", "--json"], ["--kpi", "-", "--json"],
                                     ["--csv", "-", "--kpi", "-"], ["--csv", "-", "--kpi", "-", "--json"]])
def test_bench_writes_one_output_to_stdout(capsys, listener, outputs):
    """--csv - with --json printed the CSV alone and exit 0: the JSON was lost."""
    url, untouched = listener
    err = one_line(*kbtp(capsys, "bench", url, "--timeout", "1", "-n", "1", *outputs))
    given = [" ".join(outputs[i:i + 2]) if outputs[i] != "--json" else "--json"
             for i in range(len(outputs)) if outputs[i].startswith("--")]
    assert all(g in err for g in given) and "only one can write to stdout" in err, err
    assert untouched()


def test_a_write_that_fails_at_the_end_is_one_line(capsys):
    """/dev/full takes the open and refuses the write (no space left on device): the check
    passes, the write fails after the work, and says so in one line."""
    code, err = kbtp(capsys, "decode", "--json-file", "/dev/full", SAMPLE)
    assert "no space left on device" in one_line(code, err, 1)
    host = fresh_hosts(1)[0]
    code, err = kbtp(capsys, "conform", "--target", f"iwarp://{host}:{free_port(host)}", "--junit", "/dev/full")
    assert "no space left on device" in one_line(code, err, 1)
