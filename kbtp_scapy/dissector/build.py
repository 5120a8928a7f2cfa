"""Build the generated C dissector as a Wireshark plugin, out of tree, with pkg-config.

As Wireshark's out-of-tree plugin template does: ``pkg-config wireshark`` gives the
compiler flags and the plugin folder (``plugindir``, whose last part is the ``4.0``
that the personal plugin folder repeats). The build is one gcc call, warnings on.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from . import REPO_DISSECTOR
from .generate_c import outputs as c_outputs

SOURCES = ("packet-kbtp.c", "plugin.c")
#: The plugin file, as Wireshark names epan plugins.
PLUGIN_NAME = "kbtp.so"
WARNINGS = ("-Wall", "-Wextra", "-Werror")
SANITIZERS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined")

#: For LD_PRELOAD: registers the plugin when the library is loaded, for a tshark that
#: reads no personal plugin folder (run as root, Wireshark ignores them) and for the
#: sanitizer runs. Not part of the plugin that `kbtp dissector install` installs.
PRELOAD_NAME = "kbtp-preload.so"
_PRELOAD_C = ("void plugin_register(void);\n"
              "__attribute__((constructor)) static void kbtp_preload(void) { plugin_register(); }\n")

#: config.h of the template build: what plugin sources include first.
_CONFIG_H = '#include <ws_version.h>\n#define WS_LOG_DOMAIN "kbtp"\n'


class BuildError(Exception):
    """The plugin cannot be built here; the message says why and what to install."""


def _pkg_config(*args: str) -> str:
    proc = subprocess.run(["pkg-config", *args, "wireshark"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines()
        raise BuildError(f"pkg-config wireshark failed: {said[-1] if said else 'no output'}"
                         " (Debian: apt-get install libwireshark-dev libglib2.0-dev)")
    return proc.stdout.strip()


def toolchain_missing() -> str | None:
    """Why the C plugin cannot be built here, or None when gcc, pkg-config and the
    Wireshark headers are all present."""
    for tool in ("gcc", "pkg-config"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install {tool})"
    try:
        _pkg_config("--cflags")
    except BuildError as exc:
        return str(exc)
    return None


def version_folder() -> str:
    """The ``X.Y`` folder Wireshark looks in for plugins of its version (4.0)."""
    return Path(_pkg_config("--variable=plugindir")).name


def build(outdir: Path, sanitize: bool = False, preload: bool = False, srcdir: Path = REPO_DISSECTOR) -> Path:
    """Compile the committed sources (or ones generated afresh when the checkout has none)
    into ``outdir/kbtp.so`` (``kbtp-preload.so`` with ``preload``; ``-asan`` before ``.so``
    with ``sanitize``); returns its path."""
    missing = toolchain_missing()
    if missing:
        raise BuildError(missing)
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kbtp-build-") as tmp:
        inc = Path(tmp)
        (inc / "config.h").write_text(_CONFIG_H)
        sources = [srcdir / s for s in SOURCES]
        if not all(s.exists() for s in sources):
            for path, text in c_outputs(inc).items():
                path.write_text(text)
            sources = [inc / s for s in SOURCES]
        if preload:
            (inc / "preload.c").write_text(_PRELOAD_C)
            sources.append(inc / "preload.c")
        target = outdir / (PRELOAD_NAME if preload else PLUGIN_NAME)
        if sanitize:
            target = target.with_name(target.stem + "-asan.so")
        cmd = ["gcc", "-shared", "-fPIC", "-O2", "-g", *WARNINGS, *(SANITIZERS if sanitize else ()),
               f"-I{inc}", *_pkg_config("--cflags").split(), *map(str, sources), "-o", str(target),
               *_pkg_config("--libs").split()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise BuildError("gcc failed: " + (proc.stderr.strip() or "no output"))
    return target


def sanitizer_preload(plugin: Path) -> str:
    """LD_PRELOAD for a sanitized plugin in Debian's (unsanitized) tshark: the ASan and
    UBSan runtimes first, as ASan requires, then the plugin."""
    runtimes = []
    for lib in ("libasan.so", "libubsan.so"):
        proc = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True, timeout=60)
        runtimes.append(str(Path(proc.stdout.strip()).resolve()))
    return " ".join([*runtimes, str(plugin)])
