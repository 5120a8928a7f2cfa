"""The ``kbtp`` command: one click group, one module per subcommand."""
from __future__ import annotations

import importlib
import os
import sys

import click

from .errors import FILE_TODO, OutputClosed, line, reason

#: subcommand -> module of this package defining it; imported only when that command runs,
#: so ``kbtp target`` does not pay for Scapy's layers in start-up time and memory.
COMMANDS = {"decode": "decode", "craft": "craft", "demo": "demo", "dissector": "dissector",
            "target": "target", "initiator": "initiator",
            "replay": "replay", "conform": "conform", "fuzz": "fuzz", "bench": "bench",
            "analyze": "analyze"}
#: what ``kbtp --help`` says of each subcommand, so that listing them imports none of them
#: (importing them all cost 0.6 to 1.2 s of CPU; tests/test_cli.py checks there is one per command)
SUMMARIES = {
    "decode": "Decode the KBTP messages of a capture (pcap or pcapng, file or pipe).",
    "craft": "Build one KBTP message, lies included, as hex, octets or a pcap.",
    "demo": "Run every tool once against the reference target, on both bindings.",
    "dissector": "Generate, build and install the Wireshark dissector (C or Lua).",
    "target": "Run the reference KBTP target until interrupted.",
    "initiator": "Talk to a KBTP target: one session per run, every operation.",
    "replay": "Replay a capture's KBTP sessions against a live target and compare.",
    "conform": "Check a KBTP target (or an initiator) against the specification.",
    "fuzz": "Fuzz a KBTP target (or an initiator) statefully, judging every answer.",
    "bench": "Benchmark a KBTP target in perftest's manner: ops/s, MB/s, latency.",
    "analyze": "Statistics and KV-cache hazards of one capture or a fleet's, on DuckDB.",
}
#: subcommands kept in modules of their own, which build on their group's module: imported
#: with it, so that the group's module imports none of them back.
SUBCOMMANDS = {"initiator": ("initiator_script", "send")}


#: click 8.2 and later raise this for a bare group (help, exit 2); 8.1 prints it and exits 0
_NoArgsIsHelp = getattr(click.exceptions, "NoArgsIsHelpError", ())


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        command = getattr(importlib.import_module(f".{COMMANDS[name]}", __name__), name)
        for module in SUBCOMMANDS.get(name, ()):      # they add themselves to its group
            importlib.import_module(f".{module}", __name__)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The list of subcommands, from SUMMARIES: none of them is imported for it."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUMMARIES[name]) for name in COMMANDS])


@click.group(cls=LazyGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kbtp_scapy", prog_name="kbtp")
def cli() -> None:
    """Toolkit for KBTP, the KV Cache Block Transfer Protocol, over iWARP and RoCEv2.

    \b
    Examples:
      kbtp demo                                # every tool against the reference target
      kbtp decode pcaps/roce_session.pcap      # one line per KBTP message
      kbtp decode --json pcaps/iwarp_session.pcap   # JSON Lines keyed by display-filter names
      kbtp craft ALLOC_STORE --handle 0x4001 --inline-data 4b56424c4f434b21
      kbtp craft LOAD --handle 7 --dd-length 4096 --transport roce -o load.pcap
      kbtp dissector install                   # the Wireshark dissector into your plugin folder
      kbtp target --transport roce             # the reference target on 127.0.0.1:4791
      kbtp initiator roce://127.0.0.1 alloc-store 0x4000 --text hello --seal
    """


def main(argv: list[str] | None = None) -> int:
    """Run the command; errors are one line on stderr: exit 2 for usage, 1 for bad input."""
    try:
        status = cli.main(args=argv, prog_name="kbtp", standalone_mode=False)
    except _NoArgsIsHelp as exc:            # bare ``kbtp``: the help on stdout, click's status
        click.echo(exc.format_message())
        return exc.exit_code
    except click.UsageError as exc:
        path = exc.ctx.command_path if exc.ctx else "kbtp"
        click.echo(f"{path}: {exc.format_message()} (see '{path} --help')", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"kbtp: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.Abort:
        click.echo("kbtp: aborted", err=True)
        return 130
    except (BrokenPipeError, OutputClosed):   # ``| head`` has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())     # nor a second complaint at exit's flush
        return 0
    except OSError as exc:    # a report's write that failed at the end (disk full): one line
        what = os.fsdecode(exc.filename) if exc.filename else "the command stopped"
        click.echo(f"kbtp: {line(what, reason(exc), FILE_TODO.get(exc.errno or 0, ''))}", err=True)
        return 1
    # a command's ``click.exceptions.Exit(N)`` (decode's 130 on Ctrl-C) comes back as N
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


def entry() -> None:
    sys.exit(main())
