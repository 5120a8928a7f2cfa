#!/usr/bin/env python
"""A floor for LOAD over iWARP: how close can any Python data path come to the baseline?

``bench_target.py`` finds the reference target well below half the baseline's rate. This
script measures the least work a Python KBTP LOAD over iWARP can do, so the gap can be
split into what the reference target adds and what Python itself costs. Its "floor"
target and initiator do only the wire work every LOAD needs, with the project's own
pieces: MPA framing and CRC32c (``wire.iwarp``), the request and the COMPLETION
through the codec, one entry read from a ``BlockTable`` in registered-memory format, the
block sent as RDMA Write FPDUs no longer than the MULPDU, and writes batched as the soft
RNIC batches them (``FLUSH_MESSAGES``, through the baseline's ``TcpPeer``). It leaves
out everything else the specification and the RNIC require: no MPA set-up, no STag
rights, bounds or validity, no MSN or credit checks, no validation order or status
codes, no invalidation, no Terminate. It is a measuring stick, not a target: never point
it at anything but itself.

For each block size, in one run: the reference target (``bench_target.run_case``: KBTP
and its baseline), then the floor, then the baseline again with the floor's own octets
per operation. Human progress goes to stderr, the table to stdout (``--markdown`` as
Markdown too; ``--write-docs`` writes that into its section of docs/PERFORMANCE.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import Any

import bench_target as bt
import perf_docs

from kbtp_scapy import codec
from kbtp_scapy.tables import memory as M
from kbtp_scapy.target.table import BlockTable
from kbtp_scapy.vocab import Opcode
from kbtp_scapy.wire import iwarp as w
from kbtp_scapy.wire.iwarp_defs import (
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    FPDU_OVERHEAD,
    Op,
    mulpdu,
)

BLOCKS = 256                    # handles 0 .. BLOCKS-1, each bound to its own block
SEND_QUEUE = 0                  # DDP queue number of Send messages (RFC 5040 s5.1)
LISTENING = re.compile(r"floor listening on ([\d.]+):(\d+)")


def block_bytes(handle: int, size: int) -> bytes:
    """What block ``handle`` holds: distinct per handle, so a misplaced block shows."""
    return bytes((handle + k) & 0xFF for k in range(256)) * (size // 256) + bytes(size % 256)


class FloorPeer(bt.TcpPeer):
    """MPA FPDUs in and out, CRC32c on, no markers; written as the baseline writes its
    chunks, which is as the soft RNIC's iWARP transport writes."""

    def __init__(self) -> None:
        super().__init__(lambda _op: None)
        self.msn = 0
        self.mulpdu = 0
        self.bytes_rx = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self.mulpdu = mulpdu(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))

    def put(self, head: bytes, payload: bytes) -> None:
        self.tx += head
        self.tx += payload
        self.tx += w.fpdu_tail(head, payload, True)

    def send_message(self, message: bytes) -> None:
        self.msn += 1
        self.put(w.untagged_head(True, Op.SEND, SEND_QUEUE, self.msn, 0, len(message)), message)
        self.message_queued()

    def write(self, stag: int, data: bytes) -> None:
        room = self.mulpdu - DDP_TAGGED_LEN
        for at in range(0, len(data), room):
            part = data[at:at + room]
            self.put(w.tagged_head(at + room >= len(data), Op.WRITE, stag, at, len(part)), part)
        self.message_queued()

    def data_received(self, data: bytes) -> None:
        self.bytes_rx += len(data)
        rx = self.rx
        rx += data
        at = 0
        while len(rx) - at >= 2:
            ulpdu = rx[at] << 8 | rx[at + 1]
            end = at + ulpdu + FPDU_OVERHEAD + w.fpdu_pad_len(ulpdu)
            if end > len(rx):
                break
            fpdu = bytes(rx[at:end])
            if not w.crc_ok(fpdu):
                raise ValueError("FPDU with a bad CRC")
            self.on_fpdu(fpdu, ulpdu)
            at = end
        del rx[:at]

    def on_fpdu(self, fpdu: bytes, ulpdu: int) -> None:
        raise NotImplementedError


class FloorTarget(FloorPeer):
    """Answers each LOAD with the block and a COMPLETION, and checks nothing."""

    def __init__(self, pool: memoryview, table: BlockTable) -> None:
        super().__init__()
        self.pool, self.table = pool, table

    def on_fpdu(self, fpdu: bytes, ulpdu: int) -> None:
        req = codec.decode(fpdu[2 + DDP_UNTAGGED_LEN:2 + ulpdu])
        entry = self.table.read(req["handle"])
        self.write(req["dd.stag"], bytes(self.pool[entry.block_offset:
                                                   entry.block_offset + entry.data_length]))
        self.send_message(codec.encode({
            "opcode": Opcode.COMPLETION, "request_id": req["request_id"], "handle": req["handle"],
            "generation": entry.generation, "status": 0,
            "completion.data_length": entry.data_length, "completion.reserved": 0,
            "completion.block_offset": entry.block_offset}))


class FloorInitiator(FloorPeer):
    """LOADs into a fresh buffer per request, placed by STag, completed by request ID."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.buffers: dict[int, bytearray] = {}
        self.waiting: dict[int, asyncio.Future] = {}
        self.next_id = 0

    async def load(self, handle: int) -> bytes:
        self.next_id += 1
        rid = stag = self.next_id
        buf = self.buffers[stag] = bytearray(self.size)
        done = self.waiting[rid] = asyncio.get_running_loop().create_future()
        self.send_message(codec.encode({
            "opcode": Opcode.LOAD, "request_id": rid, "handle": handle, "generation": 0,
            "flags": 0, "dd.stag": stag, "dd.offset": 0, "dd.length": self.size}))
        length = await done
        del self.buffers[stag]
        return bytes(buf[:length])

    def on_fpdu(self, fpdu: bytes, ulpdu: int) -> None:
        if fpdu[2] & 0x80:          # tagged: an RDMA Write part
            _, _, _, stag, to = w.TAGGED.unpack_from(fpdu)
            length = ulpdu - DDP_TAGGED_LEN
            self.buffers[stag][to:to + length] = memoryview(fpdu)[2 + DDP_TAGGED_LEN:
                                                                  2 + ulpdu]
        else:
            done = codec.decode(fpdu[2 + DDP_UNTAGGED_LEN:2 + ulpdu])
            self.waiting.pop(done["request_id"]).set_result(done["completion.data_length"])


async def serve(size: int, lifetime: float) -> None:
    """The floor target process: BLOCKS sealed blocks, until killed or ``lifetime`` ends."""
    pool = memoryview(bytearray(BLOCKS * size))
    table = BlockTable(memoryview(bytearray(BLOCKS * M.ENTRY_SIZE)), 0, BLOCKS, False)
    for handle in range(BLOCKS):
        pool[handle * size:(handle + 1) * size] = block_bytes(handle, size)
        table.bind(handle, handle * size, size, sealed=True)
    server = await asyncio.get_running_loop().create_server(
        lambda: FloorTarget(pool, table), bt.TARGET_HOST, 0)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"floor listening on {host}:{port}", flush=True)
    await asyncio.sleep(lifetime)


async def bench_floor(size: int, o: bt.Opts,
                      check: Callable[[int, bytes], None] | None = None) -> dict[str, Any]:
    """The floor initiator against a fresh floor target subprocess; ``check`` sees every
    loaded block."""
    server = await bt.Child.start([sys.executable, os.path.abspath(__file__), "--serve",
                                   json.dumps([size, 4 * (o.seconds + o.warmup) + 60])],
                                  LISTENING)
    pid = server.proc.pid
    try:
        loop = asyncio.get_running_loop()
        _, ini = await loop.create_connection(lambda: FloorInitiator(size), server.ready[1],
                                              int(server.ready[2]),
                                              local_addr=(bt.INITIATOR_HOST, 0))

        async def one(i: int) -> None:
            data = await ini.load(i % BLOCKS)
            if check is not None:
                check(i % BLOCKS, data)
            elif len(data) != size:
                raise RuntimeError("LOAD returned a short block")

        def counters() -> dict[str, int]:
            return {"bytes_tx": ini.bytes_tx, "bytes_rx": ini.bytes_rx, **bt.cpu_us(),
                    **bt.cpu_us(pid)}
        await bt.drive(one, o.window, o.warmup, o.round_ops, bt.Meter(counters))
        meter = bt.Meter(counters)
        ops, secs = await bt.drive(one, o.window, o.seconds, o.round_ops, meter)
        ini.tp.close()
    finally:
        await server.stop()
    per_op = {k: v / max(1, ops) for k, v in meter.total.items()}
    return {"ops": ops, "seconds": secs, "ops_per_s": ops / secs, "per_op": per_op,
            "wire": {d: per_op[f"bytes_{d}"] for d in ("tx", "rx")}}


async def run_size(size: int, o: bt.Opts) -> dict[str, Any]:
    """Reference target and its baseline, then the floor and its baseline, in that order."""
    row: dict[str, Any] = {"size": size, "reference": await bt.run_case("iwarp", "LOAD", size, o)}
    bt.log(f"floor LOAD {size}: for {o.seconds} s")
    try:
        row["floor"] = await bench_floor(size, o)
        row["floor_baseline"] = await bt.bench_baseline("iwarp", size, row["floor"]["wire"],
                                                        o.round_ops, o)
    except Exception as exc:
        row["error"] = f"floor: {type(exc).__name__}: {exc}"
        bt.log(f"floor LOAD {size}: FAILED: {row['error']}")
    return row


HEADER = ["size", "KBTP ops/s", "its baseline", "KBTP/baseline", "floor ops/s", "its baseline",
          "floor/baseline", "CPU us/op: KBTP t+i / floor t+i / base s+c", "floor wire per op"]


def rows(results: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in results:
        ref, floor, base = r["reference"], r.get("floor"), r.get("floor_baseline")
        if "ratio" not in ref or floor is None or base is None:
            out.append([str(r["size"]), "FAILED"] + [""] * (len(HEADER) - 2))
            continue
        out.append([str(r["size"]), f"{ref['kbtp']['ops_per_s']:.0f}",
                    f"{ref['baseline']['ops_per_s']:.0f}", f"{ref['ratio']:.2f}",
                    f"{floor['ops_per_s']:.0f}", f"{base['ops_per_s']:.0f}",
                    f"{floor['ops_per_s'] / base['ops_per_s']:.2f}",
                    f"{bt.cpu(ref['kbtp'])} / {bt.cpu(floor)} / {bt.cpu(base)}",
                    f"{floor['wire']['tx']:.0f}/{floor['wire']['rx']:.0f} B"])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Targets listen on {bt.TARGET_HOST}; initiators and baseline clients use "
               f"{bt.INITIATOR_HOST}. Exit status 1 if any case failed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per side and case")
    p.add_argument("--warmup", type=float, default=0.5, help="untimed seconds before each")
    p.add_argument("--sizes", default="4096,32768", help="block sizes in octets")
    p.add_argument("--window", type=int, default=16, help="requests in flight")
    p.add_argument("--pool-mib", type=int, default=1024, help="the reference target's pool")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    perf_docs.add_write_docs(p)
    p.add_argument("--json", metavar="FILE", help="write every result and counter here")
    p.add_argument("--serve", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sizes {args.sizes}: not a list of integers")
    if any(s < 256 or s % 256 for s in args.sizes):
        p.error("sizes must be multiples of 256")
    if args.window < 1 or args.seconds <= 0 or args.warmup <= 0:
        p.error("--window must be at least 1, --seconds and --warmup positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        size, lifetime = json.loads(args.serve)
        asyncio.run(serve(size, lifetime))
        return 0
    o = bt.Opts(args.seconds, args.window, 1 << 30, args.pool_mib, args.warmup, None)
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_floor")

    async def run_all() -> list[dict[str, Any]]:
        return [await run_size(size, o) for size in args.sizes]
    results = asyncio.run(run_all())
    table = [HEADER] + rows(results)
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    print("\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in table))
    markdown = "\n".join("| " + " | ".join(r) + " |" for r in [HEADER, ["---"] * len(HEADER), *table[1:]])
    if args.markdown:
        print("\n" + markdown)
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_floor", markdown)
    failures = [f"{r['size']} FAILED: {error}" for r in results
                for error in (r["reference"].get("error"), r.get("error")) if error]
    if failures:
        print("\n" + "\n".join(failures))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"options": vars(o), "results": results}, out, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
