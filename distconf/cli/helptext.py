"""Subcommand parsers with a wrapped description and a verbatim block of examples."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["add_command", "positive_int", "seconds"]

_WIDTH = 88


def add_command(subparsers: argparse._SubParsersAction, name: str, *, summary: str, description: str,
                examples: Sequence[tuple[str, str]]) -> argparse.ArgumentParser:
    """Add subcommand ``name``: ``summary`` in ``distconf --help``, and in ``distconf NAME --help`` the
    ``description`` (paragraphs separated by blank lines, each wrapped) followed by ``examples``
    ((command line, what it does) pairs, shown verbatim)."""
    text = "\n\n".join(textwrap.fill(" ".join(p.split()), _WIDTH) for p in description.split("\n\n"))
    width = max(len(command) for command, _ in examples)
    lines = [f"  {command.ljust(width)}  {what}".rstrip() for command, what in examples]
    return subparsers.add_parser(name, help=summary, description=text, epilog="examples:\n" + "\n".join(lines),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def positive_int(text: str) -> int:
    """Argparse type: an integer >= 1 (argparse reports the message and exits 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {value}")
    return value


def seconds(text: str) -> float:
    """Argparse type: a number of seconds from 0 to 10 (argparse reports the message and exits 2 otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 10:
        raise argparse.ArgumentTypeError(f"must be between 0 and 10 seconds, got {value:g}")
    return value


def initial_peers(args: argparse.Namespace, command: str) -> list[str] | None:
    """``--initial-peers``, else ``DISTCONF_INITIAL_PEERS``; None (after saying why on stderr) when neither is set.

    There is deliberately no default swarm: a command that joins one needs an address.
    """
    from distconf.loader.mixins import default_initial_peers

    peers = list(args.initial_peers or default_initial_peers())
    if not peers:
        print(f"distconf {command}: give --initial-peers (or set DISTCONF_INITIAL_PEERS); there is no default swarm",
              file=sys.stderr)
        return None
    return peers


def join_swarm(peers: list[str], command: str) -> Any:
    """A client-mode DHT node joined through ``peers``; None (after saying why on stderr) if it cannot join."""
    from distconf.dht import start_local_dht
    from distconf.errors import SwarmJoinError

    try:
        return start_local_dht(peers, client_mode=True)
    except SwarmJoinError as exc:
        print(f"distconf {command}: {exc}", file=sys.stderr)
        return None
    except Exception as exc:  # hivemind raises several types for invalid peers
        print(f"distconf {command}: cannot join the swarm through {' '.join(peers)}: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return None
