"""``kbtp dissector``: generate, check, locate, install and uninstall the Wireshark Lua dissector."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click

from ..dissector import REPO_DISSECTOR, lua_path as _lua_path
from ..dissector.generate import HEADER_LINE, outputs
from ..tables import generate as vocab


def _outputs(outdir: Path, vocab_path: Path) -> dict[Path, str]:
    """Every file generated from the tables: the dissector's and the Python vocabulary."""
    return {**outputs(outdir), **vocab.outputs(vocab_path)}


def _stale(outdir: Path, vocab_path: Path) -> list[Path]:
    return [p for p, text in _outputs(outdir, vocab_path).items()
            if not p.exists() or p.read_text() != text]


@click.group()
def dissector() -> None:
    """The KBTP Wireshark dissector (Lua, Wireshark 4.0 and newer), generated from the
    field tables.

    \b
    Examples:
      kbtp dissector generate            # rewrite dissector/kbtp.lua, FIELDS.md, kbtp_scapy/vocab.py
      kbtp dissector generate --check    # exit 1 if the committed files are stale
      kbtp dissector install             # copy kbtp.lua into your personal Lua plugin folder
      kbtp dissector uninstall           # remove it from there
      tshark -X lua_script:$(kbtp dissector path) -r pcaps/roce_session.pcap

    The installed copy and -X lua_script: may be given together: the plugin loads once.
    """


@dissector.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the files differ from the tables.")
@click.option("--out", "outdir", type=click.Path(file_okay=False, path_type=Path), default=REPO_DISSECTOR,
              show_default=True, help="Folder for kbtp.lua and FIELDS.md.")
@click.option("--vocab", "vocab_path", type=click.Path(dir_okay=False, path_type=Path),
              default=vocab.VOCAB_PATH, show_default=True,
              help="The Python vocabulary: enums and message records.")
def generate(check: bool, outdir: Path, vocab_path: Path) -> None:
    """Write kbtp.lua, FIELDS.md and the Python vocabulary from the field tables."""
    if check:
        stale = _stale(outdir, vocab_path)
        if stale:
            raise click.ClickException("stale: " + ", ".join(str(p) for p in stale)
                                       + " (run 'kbtp dissector generate')")
        click.echo(f"{outdir}, {vocab_path}: up to date")
        return
    for path, text in _outputs(outdir, vocab_path).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        click.echo(f"wrote {path}")


@dissector.command()
def path() -> None:
    """Print the path of kbtp.lua (for tshark -X lua_script:PATH)."""
    click.echo(_lua_path())


def _personal_plugin_folder() -> Path:
    tshark = shutil.which("tshark")
    if tshark is None:
        raise click.ClickException("tshark is not installed (Debian: apt-get install tshark)")
    proc = subprocess.run([tshark, "-G", "folders"], capture_output=True, text=True, timeout=60)
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "Personal Lua Plugins":
            return Path(value.strip())
    raise click.ClickException("tshark -G folders names no personal Lua plugin folder")


@dissector.command()
@click.option("--folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Install here instead of the folder 'tshark -G folders' reports.")
def install(folder: Path | None) -> None:
    """Copy kbtp.lua into the personal Lua plugin folder, so Wireshark and tshark load it."""
    folder = folder or _personal_plugin_folder()
    target = folder / "kbtp.lua"
    if target.exists() and not _ours(target):
        raise click.ClickException(f"{target} exists and is not this dissector; move it away "
                                   "or install with --folder")
    replaced = target.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_lua_path(), target)
    except OSError as exc:
        raise click.ClickException(f"cannot write {target}: {exc.strerror}") from None
    click.echo(f"{'updated' if replaced else 'installed'} {target}")


def _ours(path: Path) -> bool:
    """Whether ``path`` is a kbtp.lua this command wrote (its generated first line)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == HEADER_LINE
    except OSError:
        return False


@dissector.command()
@click.option("--folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Uninstall from here instead of the folder 'tshark -G folders' reports.")
def uninstall(folder: Path | None) -> None:
    """Remove the kbtp.lua that 'kbtp dissector install' put in the personal plugin folder."""
    folder = folder or _personal_plugin_folder()
    target = folder / "kbtp.lua"
    if not target.exists():
        click.echo(f"not installed: no {target}")
        return
    if not _ours(target):
        raise click.ClickException(f"{target} is not this dissector; left it alone")
    try:
        target.unlink()
    except OSError as exc:
        raise click.ClickException(f"cannot remove {target}: {exc.strerror}") from None
    click.echo(f"removed {target}")
