"""The ``distconf`` command line.

Each subcommand lives in a module ``distconf/cli/cmd_<name>.py`` exposing
``register(subparsers)``; modules are discovered automatically. Heavy imports
(torch, transformers, hivemind) happen inside the handlers only, so
``distconf validate`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

_DESCRIPTION = """\
Declarative model-family configs for peer-to-peer LLM inference.

A family file (families/<name>.yaml) says which Hugging Face config class a family
extends, which decoder layer is a block, where its weights live in a checkpoint,
how many query heads share a KV head, and how the DHT prefix is derived from a model
name. distconf validates those files and synthesizes Distributed<Name>Config classes.
"""

_EPILOG = """\
examples:
  distconf list                               families on the search path
  distconf validate my_families/              check family files (CI / pre-commit)
  distconf check my_families/x.yaml           prove a family file on its tiny model
  distconf new x --from-config config.json    draft a family file for a new model
  distconf show FAMILY --preset ORG/MODEL     a family applied to a shipped real config
  distconf plan ORG/MODEL --memory 24GiB      blocks and cache a server can hold
  distconf swarm --initial-peers ADDR --model PREFIX   coverage of a running swarm
  distconf schema --check                     is schemas/family.schema.json current?

environment:
  DISTCONF_FAMILIES_PATH    extra folders of family files (os.pathsep-separated)
  DISTCONF_TRUSTED_MODULES  extra module prefixes class paths may use
  DISTCONF_INITIAL_PEERS    default initial peers (multiaddrs); none otherwise
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every discovered subcommand."""
    parser = argparse.ArgumentParser(
        prog="distconf", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    package = importlib.import_module(__name__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distconf`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
