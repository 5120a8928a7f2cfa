"""The package's optional extras (pyproject.toml): whether the modules an option needs are
installed, and the command that installs them. The README installs from the checkout, not
from a package index, so the command names the checkout's extra (``pip install '.[plot]'``).
Looking a module up does not import it: a tool checks before it starts, and stays quick."""
from __future__ import annotations

from enum import StrEnum
from importlib.util import find_spec


class Extra(StrEnum):
    """An optional extra of pyproject.toml."""

    PLOT = "plot"          # matplotlib: kbtp bench --plot, kbtp analyze --report
    ANALYZE = "analyze"    # DuckDB, pyarrow, Dask distributed: kbtp analyze, decode --parquet


def install(extra: Extra) -> str:
    """The command that installs ``extra``."""
    return f"pip install '.[{extra}]' in the checkout (tools/install.sh installs it)"


def lacking(what: str, extra: Extra, *modules: str) -> str | None:
    """``--plot needs matplotlib: pip install '.[plot]' ...`` when a module of ``modules`` is
    not installed, else None."""
    absent = [m for m in modules if find_spec(m) is None]
    return f"{what} needs {' and '.join(absent)}: {install(extra)}" if absent else None
