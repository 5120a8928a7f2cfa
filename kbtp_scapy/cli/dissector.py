"""``kbtp dissector``: generate, check, build, locate, install and uninstall the Wireshark
dissector, in either form: the C plugin (native speed) or the Lua plugin (no compiler)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import click

from ..dissector import REPO_DISSECTOR, generate_core, lua_path as _lua_path, outputs
from ..dissector.build import PLUGIN_NAME, BuildError, build as _build, toolchain_missing, version_folder
from ..dissector.generate import HEADER_LINE
from ..tables import generate as vocab
from .errors import file_trouble
from .options import Output

#: Marks a compiled plugin as this dissector's: the protocol it registers.
_C_MARK = b"KV Cache Block Transfer Protocol\0"


def _outputs(outdir: Path, vocab_path: Path, core_path: Path) -> dict[Path, str]:
    """Every file generated from the tables: the dissector's, the Python vocabulary and
    the tables of the compiled decoder core."""
    return {**outputs(outdir), **vocab.outputs(vocab_path), **generate_core.outputs(core_path)}


def _stale(outdir: Path, vocab_path: Path, core_path: Path) -> list[Path]:
    return [p for p, text in _outputs(outdir, vocab_path, core_path).items()
            if not p.exists() or p.read_text() != text]


@click.group()
def dissector() -> None:
    """The KBTP Wireshark dissector (Wireshark 4.0 and newer), generated from the field
    tables in two forms: a C plugin (packet-kbtp.c, native speed) and a Lua plugin
    (kbtp.lua, no compiler needed). Both show the same fields, tree and Info column.

    \b
    Examples:
      kbtp dissector generate            # rewrite dissector/ (kbtp.lua, packet-kbtp.c, plugin.c,
                                         # FIELDS.md), kbtp_scapy/vocab.py and decode/_core_tables.h
      kbtp dissector generate --check    # exit 1 if the committed files are stale
      kbtp dissector build --out /tmp/kbtp-plugin   # compile the C plugin (gcc, pkg-config, libwireshark-dev)
      kbtp dissector install             # the C plugin if it builds here (kbtp.lua as root)
      kbtp dissector install --lua       # kbtp.lua into your personal Lua plugin folder
      kbtp dissector uninstall           # remove whichever is installed
      tshark -X lua_script:$(kbtp dissector path) -r pcaps/roce_session.pcap

    With both installed, the C plugin registers first and kbtp.lua steps aside: the
    protocol is registered once. The installed copy and -X lua_script: may be given
    together too: the Lua plugin loads once.
    """


@dissector.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the files differ from the tables.")
@click.option("--out", "outdir", type=click.Path(file_okay=False, path_type=Path), default=REPO_DISSECTOR,
              show_default=True, help="Folder for kbtp.lua, packet-kbtp.c, plugin.c and FIELDS.md.")
@click.option("--vocab", "vocab_path", type=click.Path(dir_okay=False, path_type=Path),
              default=vocab.VOCAB_PATH, show_default=True,
              help="The Python vocabulary: enums and message records.")
@click.option("--core", "core_path", type=click.Path(dir_okay=False, path_type=Path),
              default=generate_core.CORE_TABLES, show_default=True,
              help="The KBTP tables of kbtp decode's compiled core (a C header).")
def generate(check: bool, outdir: Path, vocab_path: Path, core_path: Path) -> None:
    """Write kbtp.lua, packet-kbtp.c, plugin.c, FIELDS.md, the Python vocabulary and the
    compiled decoder core's tables from the field tables."""
    if check:
        stale = _stale(outdir, vocab_path, core_path)
        if stale:
            raise click.ClickException("stale: " + ", ".join(str(p) for p in stale)
                                       + " (run 'kbtp dissector generate')")
        click.echo(f"{outdir}, {vocab_path}, {core_path}: up to date")
        return
    for path, text in _outputs(outdir, vocab_path, core_path).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        click.echo(f"wrote {path}")


@dissector.command()
def path() -> None:
    """Print the path of kbtp.lua (for tshark -X lua_script:PATH)."""
    click.echo(_lua_path())


@dissector.command(name="build")
@click.option("--out", "outdir", type=Output(folder=True, path_type=Path), required=True,
              help="Folder to write kbtp.so into.")
@click.option("--sanitize", is_flag=True, help="With AddressSanitizer and UBSan (for the fuzz test).")
def build_cmd(outdir: Path, sanitize: bool) -> None:
    """Compile the C plugin (kbtp.so) with gcc and pkg-config wireshark, warnings as errors."""
    try:
        click.echo(f"built {_build(outdir, sanitize=sanitize)}")
    except BuildError as exc:
        raise click.ClickException(f"cannot build the C plugin: {exc}") from None
    except OSError as exc:                 # --out where no folder can be made
        raise file_trouble(exc.filename or outdir, exc, option="--out") from None


def _folders() -> dict[str, Path]:
    tshark = shutil.which("tshark")
    if tshark is None:
        raise click.ClickException("tshark is not installed (Debian: apt-get install tshark)")
    proc = subprocess.run([tshark, "-G", "folders"], capture_output=True, text=True, timeout=60)
    out = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(":")
        if value.strip():
            out[name.strip()] = Path(value.strip())
    return out


#: the folders ``tshark -G folders`` names for each form, personal and global (the C
#: plugins' folder ends in the version folder, 4.0; dissectors go in its epan/)
_FOLDERS = {("lua", False): "Personal Lua Plugins", ("lua", True): "Global Lua Plugins",
            ("c", False): "Personal Plugins", ("c", True): "Global Plugins"}


def _plugin_folder(form: str, system: bool) -> Path:
    """Where Wireshark looks for plugins of ``form`` (lua, c), the user's own or the
    system's, as tshark itself reports it."""
    kind = _FOLDERS[(form, system)]
    folder = _folders().get(kind)
    if folder is None:
        raise click.ClickException(f"tshark -G folders names no {kind} folder")
    return folder / "epan" if form == "c" else folder


def _loaded() -> str:
    """Which form of this dissector tshark loads now, from its own plugin list."""
    tshark = shutil.which("tshark")
    if tshark is None:
        return "tshark is not installed"
    proc = subprocess.run([tshark, "-G", "plugins"], capture_output=True, text=True, timeout=120)
    found = [line.split("\t")[-1].strip() for line in proc.stdout.splitlines()
             if line.split(maxsplit=1)[:1] in ([PLUGIN_NAME], ["kbtp.lua"])]
    so = [f for f in found if f.endswith(PLUGIN_NAME)]
    if so:
        return f"tshark loads the C plugin {so[0]}" + (
            " (kbtp.lua is loaded too and steps aside)" if len(found) > len(so) else "")
    if found:
        return f"tshark loads the Lua plugin {found[0]}"
    return "tshark loads neither form of the KBTP dissector"


def _copy(source: Path, target: Path, ours: Callable[[Path], bool]) -> str:
    if target.exists() and not ours(target):
        raise click.ClickException(f"{target} exists and is not this dissector; move it away "
                                   "or install with --folder")
    replaced = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    except OSError as exc:
        raise click.ClickException(f"cannot write {target}: {exc.strerror}") from None
    return f"{'updated' if replaced else 'installed'} {target}"


def _ours_c(path: Path) -> bool:
    """Whether ``path`` is a kbtp.so that registers KBTP (as the one this command builds)."""
    try:
        return _C_MARK in path.read_bytes()
    except OSError:
        return False


@dissector.command()
@click.option("--c", "form", flag_value="c", help="The C plugin (builds it; needs gcc, pkg-config, libwireshark-dev).")
@click.option("--lua", "form", flag_value="lua", help="The Lua plugin.")
@click.option("--folder", type=Output(folder=True, path_type=Path), default=None,
              help="Install here instead of the folder 'tshark -G folders' reports "
                   "(for --c: the folder that holds the epan plugins).")
@click.option("--global", "system", is_flag=True,
              help="Into the system's plugin folder that 'tshark -G folders' reports (Global "
                   "Plugins, Global Lua Plugins), which Wireshark loads for every user, root too.")
def install(form: str | None, folder: Path | None, system: bool) -> None:
    """Install the dissector where Wireshark and tshark load it: the C plugin when a compiler
    and the Wireshark headers are here, else kbtp.lua (--c and --lua choose), then say
    which form tshark loads. As root, Wireshark 4.0 reads no personal plugin folder: use
    --global (the system's folder, the C plugin and its statistics load there), or kbtp.lua
    is installed (Lua plugins do load)."""
    if system and folder is not None:
        raise click.UsageError("give --global or --folder, not both")
    missing = toolchain_missing()
    if form is None:
        as_root = os.geteuid() == 0 and folder is None and not system
        form = "lua" if missing or as_root else "c"
        why = (f"the C plugin cannot be built here: {missing}" if missing
               else f"Wireshark {version_folder()} reads no personal plugin folder when run as root, so the "
                    "C plugin would not load (--global installs it where it does)" if as_root
               else "gcc and the Wireshark headers are here, so the C plugin (native speed)")
        click.echo(f"installing the {'Lua' if form == 'lua' else 'C'} plugin: {why}")
    if form == "lua":
        target = (folder or _plugin_folder("lua", system)) / "kbtp.lua"
        click.echo(_copy(_lua_path(), target, _ours))
        c_target = None if folder else _plugin_folder("c", system) / PLUGIN_NAME
        if c_target is not None and c_target.exists() and _ours_c(c_target):
            click.echo(f"note: the C plugin {c_target} is installed too; it registers first and kbtp.lua "
                       f"steps aside ('kbtp dissector uninstall --c{' --global' if system else ''}' removes it)")
        if folder is None:
            click.echo(_loaded())
        return
    if missing:
        raise click.ClickException(f"cannot build the C plugin: {missing}")
    target = (folder or _plugin_folder("c", system)) / PLUGIN_NAME
    with tempfile.TemporaryDirectory(prefix="kbtp-plugin-") as tmp:
        try:
            built = _build(Path(tmp))
        except BuildError as exc:
            raise click.ClickException(f"cannot build the C plugin: {exc}") from None
        click.echo(_copy(built, target, _ours_c))
    lua = None if folder else _plugin_folder("lua", system) / "kbtp.lua"
    if lua is not None and lua.exists() and _ours(lua):
        click.echo(f"note: kbtp.lua is installed too ({lua}); the C plugin registers first and kbtp.lua "
                   f"steps aside ('kbtp dissector uninstall --lua{' --global' if system else ''}' removes it)")
    if os.geteuid() == 0 and folder is None and not system:
        click.echo(f"note: Wireshark {version_folder()} reads no personal plugin folder when run as root; "
                   "run it as your own user, or install with --global")
    if folder is None:
        click.echo(_loaded())


def _ours(path: Path) -> bool:
    """Whether ``path`` is a kbtp.lua this command wrote (its generated first line)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == HEADER_LINE
    except OSError:
        return False


@dissector.command()
@click.option("--c", "form", flag_value="c", help="Only the C plugin.")
@click.option("--lua", "form", flag_value="lua", help="Only the Lua plugin.")
@click.option("--folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Uninstall from here instead of the folders 'tshark -G folders' reports.")
@click.option("--global", "system", is_flag=True, help="From the system's plugin folders (install --global).")
def uninstall(form: str | None, folder: Path | None, system: bool) -> None:
    """Remove what 'kbtp dissector install' put in the personal (or --global) plugin folders."""
    targets: list[tuple[Path, Callable[[Path], bool]]] = []
    if form in (None, "lua"):
        targets.append(((folder or _plugin_folder("lua", system)) / "kbtp.lua", _ours))
    if form in (None, "c"):
        targets.append(((folder or _plugin_folder("c", system)) / PLUGIN_NAME, _ours_c))
    for target, ours in targets:
        if not target.exists():
            click.echo(f"not installed: no {target}")
            continue
        if not ours(target):
            raise click.ClickException(f"{target} is not this dissector; left it alone")
        try:
            target.unlink()
        except OSError as exc:
            raise click.ClickException(f"cannot remove {target}: {exc.strerror}") from None
        click.echo(f"removed {target}")
