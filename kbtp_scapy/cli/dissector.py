"""``kbtp dissector``: generate, check, locate and install the Wireshark Lua dissector."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click

from ..dissector.generate import outputs

REPO_DISSECTOR = Path(__file__).resolve().parents[2] / "dissector"


def _stale(outdir: Path) -> list[Path]:
    return [p for p, text in outputs(outdir).items()
            if not p.exists() or p.read_text() != text]


@click.group()
def dissector() -> None:
    """The KBTP Wireshark dissector (Lua, Wireshark 4.0 and newer), generated from the
    field tables.

    \b
    Examples:
      kbtp dissector generate            rewrite dissector/kbtp.lua and dissector/FIELDS.md
      kbtp dissector generate --check    exit 1 if the committed files are stale
      kbtp dissector install             copy kbtp.lua into your personal Lua plugin folder
      tshark -X lua_script:$(kbtp dissector path) -r capture.pcap
    """


@dissector.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the files differ from the tables.")
@click.option("--out", "outdir", type=click.Path(file_okay=False, path_type=Path), default=REPO_DISSECTOR,
              show_default=True, help="Folder for kbtp.lua and FIELDS.md.")
def generate(check: bool, outdir: Path) -> None:
    """Write kbtp.lua and FIELDS.md from the field tables."""
    if check:
        stale = _stale(outdir)
        if stale:
            raise click.ClickException("stale: " + ", ".join(str(p) for p in stale)
                                       + " (run 'kbtp dissector generate')")
        click.echo(f"{outdir}: up to date")
        return
    outdir.mkdir(parents=True, exist_ok=True)
    for path, text in outputs(outdir).items():
        path.write_text(text)
        click.echo(f"wrote {path}")


def _lua_path() -> Path:
    """The committed dissector of this checkout, or a freshly generated one beside the
    user's cache when the package was installed without the repository."""
    path = REPO_DISSECTOR / "kbtp.lua"
    if path.exists():
        return path
    cache = Path.home() / ".cache" / "kbtp_scapy"
    cache.mkdir(parents=True, exist_ok=True)
    for out, text in outputs(cache).items():
        out.write_text(text)
    return cache / "kbtp.lua"


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
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "kbtp.lua"
    shutil.copyfile(_lua_path(), target)
    click.echo(f"installed {target}")
