"""``kbtp target``: run the reference target until interrupted."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import ipaddress
import logging
import signal
from dataclasses import replace

import click

from ..target import Target, TargetConfig
from ..target.config import LOOPBACK
from ..vocab import Feature
from ..wire.address import resolve
from .errors import file_trouble, hint, line
from .options import BINDINGS, Output, address, feature_names, features, raw_io, raw_io_options

#: What a peer can make the target hold, bounded: (option, TargetConfig field, help).
#: Seconds are floats, counts and octets integers; defaults are TargetConfig's.
LIMITS = (
    ("--probe-interval", "probe_interval_s", "Seconds without traffic from a session's peer "
     "before a liveness probe (a zero-length RDMA Write; iWARP: also TCP keepalive)."),
    ("--probe-timeout", "probe_timeout_s", "Seconds a probe may go unanswered before the "
     "connection ends and its session goes to retention (iWARP: TCP_USER_TIMEOUT too)."),
    ("--max-backlog", "max_backlog", "Octets sent on a connection and not yet taken by its "
     "peer (or 2 x Request Credits answers) before the target stops serving it."),
    ("--backlog-timeout", "backlog_timeout_s", "Seconds a connection may stay over "
     "--max-backlog before it is terminated."),
    ("--max-half-open", "max_half_open", "Connections in set-up or without a session (no "
     "HELLO answered yet) at once; more are refused."),
    ("--max-half-open-per-source", "max_half_open_per_source",
     "The same, per source address."),
    ("--cm-timeout", "cm_timeout_s", "RoCEv2: seconds without RTU before the REP is sent "
     "again."),
    ("--cm-retries", "cm_retries", "RoCEv2: times a REP is sent again before the set-up "
     "fails (a repeated REQ gets its REP on top)."),
    ("--mpa-timeout", "mpa_timeout_s", "iWARP: seconds from the TCP handshake to the end "
     "of the MPA set-up (RTR included)."),
    ("--min-retention", "min_retention_s", "Seconds a departed initiator that holds blocks "
     "keeps them for its reconnect at least; after that, when a new initiator finds no room, "
     "the one retained longest gives way and its blocks are freed (--retention is the most)."),
    ("--idle-timeout", "idle_timeout_s", "Seconds an active session may send nothing; after "
     "that, when a new initiator finds no room, the one silent longest is ended (a live "
     "but idle or frozen peer answers the liveness probes)."),
    ("--min-tenure", "min_tenure_s", "Seconds an active session keeps its slot however "
     "little it does; after that, when a new initiator finds no room and its source holds "
     "fewer sessions than the source holding the most, that source's longest-held session "
     "is ended and gives way (a source that lost one so counts it for this long more, and a "
     "session it opens meanwhile carries on the lost one's tenure)."),
    ("--max-sessions-per-source", "max_sessions_per_source", "Sessions (active or retained) "
     "one source address outside --trust may hold; beyond, its own retained ones give way, "
     "oldest first, and when all are active its HELLO is refused NO_SPACE."),
    ("--hello-timeout", "hello_timeout_s", "Seconds a connection may stay without a session: "
     "its HELLO must have come by then."),
)


def limit_options(func):
    """The LIMITS as options; the command gets them by TargetConfig field name."""
    defaults = {f.name: f.default for f in dataclasses.fields(TargetConfig)}
    for option, field, text in reversed(LIMITS):
        default = defaults[field]
        kind: click.ParamType
        if isinstance(default, float):
            kind, metavar = click.FloatRange(0, min_open=True), "SECONDS"
        else:
            kind = click.IntRange(0 if field == "cm_retries" else 1)
            metavar = "OCTETS" if field == "max_backlog" else "N"
        func = click.option(option, field, type=kind, default=default, show_default=True,
                            metavar=metavar, help=text)(func)
    return func


def _metrics_at(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT``: where the metrics are served (a host name
    resolved as URLs are)."""
    if value is None:
        return None
    host, _, port = value.rpartition(":") if ":" in value else ("127.0.0.1", "", value)
    try:
        number = int(port)
        if not 1 <= number <= 65535:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{value!r}: give PORT or HOST:PORT, PORT 1 to 65535") from None
    host = host.strip("[]") or "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = resolve(host, value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return host, number


@click.command()
@click.option("--transport", type=click.Choice(["iwarp", "roce"]), default="roce", show_default=True,
              help="RDMA binding: iwarp (TCP, MPA rev 2) or roce (UDP 4791, RC).")
@click.option("--listen", "where", default="127.0.0.1", show_default=True, metavar="HOST[:PORT]",
              help="Address to listen on. PORT is iWARP's TCP port (default 5420) or RoCEv2's "
                   "rdma_cm port, the service a CM REQ names (default 4791): RoCEv2 packets "
                   "always use UDP port 4791.")
@raw_io_options("target listens on and")
@click.option("--blocks", "-F", type=click.IntRange(1), default=1024, show_default=True,
              help="Number of blocks in the pool.")
@click.option("--block-size", "-S", type=click.IntRange(8), default=4096, show_default=True,
              help="Block Size in octets (a multiple of 8).")
@click.option("--features", "feature_list", default="all", show_default=True,
              help="Features offered: DIRECT_LOAD,DIRECT_ALLOC,RECORD_COMPLETION, all or none "
                   "(RECORD_COMPLETION is never offered over iWARP).")
@click.option("--addr-le", is_flag=True, help="Select little-endian address fields (ADDR_LE).")
@click.option("--max-initiators", type=click.IntRange(1), default=8, show_default=True,
              help="Sessions (active or retained) the target admits.")
@click.option("--quota", type=click.IntRange(0), default=0,
              help="Allocation Quota per initiator [default: blocks / max-initiators].")
@click.option("--handles", type=click.IntRange(0), default=0,
              help="Handles per initiator range [default: 2 x quota].")
@click.option("--direct-partitions", type=click.IntRange(-1), default=-1,
              help="Pool partitions kept for DIRECT_ALLOC [default: max-initiators / 2]; sessions "
              "without DIRECT_ALLOC (every untrusted one) share the other slots.")
@click.option("--credits", type=click.IntRange(1, 0xFFFF), default=32, show_default=True,
              help="Request Credits: receive buffers posted per connection.")
@click.option("--max-inline", type=click.IntRange(0), default=4096, show_default=True,
              help="Max Inline octets (capped at the Block Size).")
@click.option("--ticket-timeout", type=click.IntRange(1), default=2000, show_default=True,
              help="Ticket Timeout in milliseconds (DIRECT_ALLOC).")
@click.option("--retention", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds a departed initiator's bindings are kept for its reconnect (one "
                   "that holds none only until a new initiator needs its room).")
@limit_options
@click.option("--trust", multiple=True, metavar="CIDR",
              help="Peers offered DIRECT_LOAD and DIRECT_ALLOC, which expose the whole pool "
                   "to their RDMA Reads and atomics; repeat for more; 0.0.0.0/0 and ::/0 for "
                   "everyone. Others get the two-sided operations only.  [default: "
                   "127.0.0.0/8 and ::1, this host]")
@click.option("--execution", type=click.Choice(["software", "chains"]), default="software",
              show_default=True,
              help="chains: LOAD, mapped STORE and ALLOC_STORE run as "
                   "pre-posted work-request chains on the soft RNIC's chain engine, other "
                   "requests in software (docs/CHAINS.md); "
                   "the memory order follows the WQE order (big-endian, or little with --addr-le).")
@click.option("--no-clear", is_flag=True,
              help="Do not clear freed blocks (all initiators share one trust domain).")
@click.option("--pcap", type=Output(), default=None,
              help="Write every frame sent and received to this pcap file.")
@click.option("--metrics", "metrics_at", metavar="[HOST:]PORT", default=None, callback=_metrics_at,
              help="Serve Prometheus metrics over HTTP on HOST:PORT/metrics (HOST 127.0.0.1 when "
                   "not given; 0.0.0.0 or [::] for a Prometheus on another host).")
@click.option("--duration", type=float, default=None,
              help="Stop after this many seconds (default: run until interrupted).")
@click.option("--verbose", "-v", is_flag=True, help="Log each malformed request too.")
def target(transport, where, io, iface, raw_addr, device, blocks, block_size, feature_list, addr_le,
           max_initiators, quota, handles, direct_partitions, credits, max_inline, ticket_timeout, retention, trust,
           execution, no_clear, pcap, metrics_at, duration, verbose, **limits) -> None:
    """Run the reference KBTP target: a pool of BLOCKS blocks in registered memory,
    served over a software RDMA NIC until interrupted (Ctrl-C), then print its counters.

    Every resource a peer can make it hold is bounded in count and in time (the
    --probe-*, --max-*, *-timeout and --cm-retries options; docs/TOOLS.md, "Limits").

    \b
    Examples:
      kbtp target                                   # RoCEv2 on 127.0.0.1:4791
      kbtp target --transport iwarp --listen 127.0.0.1:5420 --blocks 4096 -S 32768
      kbtp target --addr-le --pcap target.pcap --metrics 9464
      kbtp target --listen 127.0.0.1 --trust 127.0.0.1/32   # direct modes for one peer only
      kbtp target --execution chains --duration 5     # LOAD, STORE as work-request chains
      kbtp target --probe-interval 2 --max-backlog 1048576 --hello-timeout 2 --max-half-open 16
    """
    addr = address(transport, where)
    options = raw_io(transport, io, iface, raw_addr, device)
    if io == "raw":
        addr = replace(addr, host=raw_addr.split("/")[0])
    if io == "verbs" and execution == "chains":
        raise click.UsageError("--execution chains runs the soft RNIC's chain engine; an RDMA "
                               "device runs its own work requests: leave out --io verbs")
    if io == "verbs" and pcap:
        raise click.UsageError("--pcap records the soft RNIC's frames; with --io verbs the "
                               "device sends them: capture with tcpdump on its interface")
    try:
        config = TargetConfig(blocks=blocks, block_size=block_size, features=features(feature_list),
                              addr_le=addr_le, max_initiators=max_initiators, quota=quota,
                              handles_per_initiator=handles, direct_partitions=direct_partitions,
                              request_credits=credits, max_inline=max_inline,
                              ticket_timeout_ms=ticket_timeout, retention_s=retention,
                              clear_freed=not no_clear, trust=tuple(trust) or LOOPBACK,
                              execution=execution, **limits)
        config.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    asyncio.run(_run(config, addr, pcap, metrics_at, duration, options))


async def _run(config: TargetConfig, addr, pcap, metrics_at, duration, options) -> None:
    try:
        t = Target(config, addr.transport, options.get("io"))
    except MemoryError as exc:
        raise click.ClickException(f"{exc}; give fewer --blocks (-F) or a smaller --block-size "
                                   "(-S)") from None
    sink = None
    if pcap:
        from ..rnic.pcap import PcapSink  # Scapy's writer: imported only when asked for
        try:
            sink = PcapSink(pcap)
        except OSError as exc:
            await t.close()
            raise file_trouble(pcap, exc, option="--pcap") from None
    if sink:
        t.frame_listeners.append(sink)
    try:
        bound = await t.start(addr, **options)
    except OSError as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        todo = hint(exc) if isinstance(exc, PermissionError) else ""
        if exc.errno == errno.EADDRNOTAVAIL:
            why = f"{addr.host} is not an address of this host"
            todo = "give one of its addresses ('ip address' lists them), or 0.0.0.0 for all"
        raise click.ClickException(line(f"cannot listen on {addr}", why, todo)) from None
    metrics_url = None
    if metrics_at:
        host, port = metrics_at
        metrics_url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        try:
            t.metrics.serve(port, host)
        except OSError as exc:
            await t.close()
            raise click.ClickException(f"cannot serve metrics on {host} port {port}: "
                                       f"{exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):     # before the line that says we are up
        loop.add_signal_handler(sig, stop.set)
    direct = Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC
    withheld = feature_names(config.features & ~t.features & ~Feature.ADDR_LE)
    withheld = f" ({withheld} not offered over {BINDINGS[bound.transport]})" if withheld != "none" else ""
    click.echo(f"kbtp target listening on {bound}: {config.blocks} blocks of {config.block_size} "
               f"octets, quota {config.quota}, features {feature_names(t.features)}{withheld}"
               f"{', ADDR_LE' if config.addr_le else ''}"
               f"{'; direct modes for ' + ', '.join(config.trust) if t.features & direct else ''}"
               f"{f', metrics on {metrics_url}' if metrics_url else ''}",
               err=False)
    try:
        await asyncio.wait_for(stop.wait(), duration)
    except TimeoutError:
        pass
    await t.close()
    if sink:
        sink.close()
    click.echo(t.metrics.table())
