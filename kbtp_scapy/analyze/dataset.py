"""Rows to Parquet, one folder per capture (``DIR/NAME/part-0.parquet``, the name also in
the ``capture`` column), written in batches, so a capture of any size is written in
bounded memory and a fleet's captures form one dataset (``DIR/*/*.parquet``) that DuckDB,
Spark or pandas read as one table."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .rows import Row, capture_rows
from .schema import arrow_schema

BATCH = 65536           # rows per Arrow record batch


def _partition(out: Path, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return out / safe


def write_capture(rows: Iterable[Row], out: Path, name: str) -> int:
    """Write one capture's rows under ``out``; the number of KBTP messages among them (the
    rest are RDMA operations)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    schema = arrow_schema()
    folder = _partition(out, name)
    folder.mkdir(parents=True, exist_ok=True)
    written = messages = 0
    with pq.ParquetWriter(folder / "part-0.parquet", schema) as writer:
        batch: list[Row] = []
        for row in rows:
            batch.append(row)
            messages += "rdma_op" not in row
            if len(batch) >= BATCH:
                writer.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
                written += len(batch)
                batch.clear()
        if batch or not written:
            writer.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
            written += len(batch)
    return messages


def names(paths: list[Path]) -> list[str]:
    """Each capture's name: its stem, made unique by a suffix where two share one."""
    seen: dict[str, int] = {}
    out = []
    for path in paths:
        n = seen[path.stem] = seen.get(path.stem, 0) + 1
        out.append(path.stem if n == 1 else f"{path.stem}-{n}")
    return out


def write(paths: list[Path], out: Path, progress: Callable[[int, Path, int], None] | None = None,
          damaged: Callable[[Path, str], None] | None = None) -> int:
    """Every capture's rows (KBTP messages and RDMA operations) as a dataset under ``out``;
    the number of KBTP messages among them. ``progress`` hears (captures done, the capture
    being read, octets of it read), ``damaged`` (a capture, why it ended early)."""
    total = 0
    for i, (path, name) in enumerate(zip(paths, names(paths), strict=True)):
        def report(position: int, i: int = i, path: Path = path) -> None:
            if progress is not None:
                progress(i, path, position)

        def hurt(why: str, path: Path = path) -> None:
            if damaged is not None:
                damaged(path, why)
        total += write_capture(capture_rows(path, name, progress=report, damaged=hurt), out, name)
    return total
