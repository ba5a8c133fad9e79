"""The ``distconf`` command line.

Each subcommand lives in a module ``distconf/cli/cmd_<name>.py`` exposing
``register(subparsers)`` and a handler ``run(args) -> int``; `COMMANDS` lists them in the
order ``distconf --help`` shows them. Heavy imports (torch, transformers, hivemind)
happen inside the handlers only, so ``distconf validate`` stays fast.

A user mistake (a family that does not exist, an invalid family file, a bad config value,
a file that cannot be read) ends as one error line on stderr and exit code 1; ``-v``
also prints the traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from collections.abc import Sequence

from distconf.errors import ConfigValueError, FamilyNotFoundError, FamilyValidationError
from distconf.threads import apply_thread_policy

__all__ = ["main", "build_parser", "COMMANDS"]

logger = logging.getLogger(__name__)

COMMANDS: tuple[str, ...] = (
    "list", "validate", "show", "check", "new", "plan", "serve", "manifest", "generate", "chat", "api", "swarm",
    "monitor", "demo", "schema",
)
"""Subcommands, in help order; command ``x`` is the module ``distconf.cli.cmd_x``."""

LOUD_COMMANDS: tuple[str, ...] = ("serve", "api", "monitor")
"""Commands whose log is part of their output (a server's lifecycle, an API's requests): INFO by default. The others
print their results and log warnings only, unless ``-v``."""

SHOWN_LOGGERS: tuple[str, ...] = ("distconf.notices", "distconf.sources.gguf_convert", "distconf.sources.gguf_cache",
                                   "distconf.server.loading")
"""Loggers every command shows at INFO: licence notices, and the progress of long work (a GGUF conversion, loading
blocks)."""

USER_ERRORS: tuple[type[BaseException], ...] = (FamilyValidationError, FamilyNotFoundError, ConfigValueError, OSError)
"""Errors a command may end with that are the user's to fix: reported in one line, no traceback."""

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
  distconf serve ./model --initial-peers ADDR --memory 8GiB   serve blocks to a swarm
  distconf manifest ./model -o model.manifest.json  per-block weight digests clients check servers by
  distconf generate ./model --initial-peers ADDR 'A cat sat'  generate text through a swarm
  distconf chat ./model --initial-peers ADDR  chat with a model on a swarm in the terminal
  distconf api ./model --initial-peers ADDR   an OpenAI-compatible API and a chat page (127.0.0.1:8000)
  distconf swarm --initial-peers ADDR --model PREFIX   coverage of a running swarm
  distconf monitor --initial-peers ADDR        a live web page of the swarm (127.0.0.1:8000)
  distconf demo                               built-in families, presets and a local swarm
  distconf schema --check                     is schemas/family.schema.json current?
  distconf COMMAND --help                     what a command does, with examples

environment:
  DISTCONF_FAMILIES_PATH    extra folders of family files (os.pathsep-separated)
  DISTCONF_TRUSTED_MODULES  extra module prefixes class paths may use
  DISTCONF_INITIAL_PEERS    default initial peers (multiaddrs); none otherwise
  DISTCONF_THREADS          compute threads: auto (servers half the cores, PASSIVE waits), N, or off
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand of `COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="distconf", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log debug messages, and print the traceback of an error")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.cmd_{name}").register(subparsers)
    return parser


def error_message(exc: BaseException) -> str:
    """The text a user sees for one of `USER_ERRORS` (file-located problems one per line)."""
    if isinstance(exc, FamilyValidationError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    if isinstance(exc, LookupError) and len(exc.args) == 1:
        return str(exc.args[0])  # str() of a KeyError-like error would add quotes
    return str(exc) or type(exc).__name__


HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "urllib3", "filelock")
"""Third-party loggers that log every HTTP request at INFO: WARNING unless ``-v``."""


def configure_logging(command: str | None, *, verbose: bool = False) -> None:
    """Logging to stderr: DEBUG with ``-v``; INFO for `LOUD_COMMANDS`; otherwise WARNING, with `SHOWN_LOGGERS` at
    INFO."""
    level = logging.DEBUG if verbose else logging.INFO if command in LOUD_COMMANDS else logging.WARNING
    stamp = "%(asctime)s " if command == "serve" else ""  # a server's log is read later, by time
    logging.basicConfig(level=level, format=f"{stamp}%(levelname)s %(name)s: %(message)s")
    if level > logging.INFO:
        for name in SHOWN_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
    if not verbose:  # a line per HTTP request of a hub download is noise, also in a server's log
        for name in HTTP_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distconf`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # this process's own command line (in-process callers keep their environment)
        apply_thread_policy("server" if args.command == "serve" else "process")
    configure_logging(args.command, verbose=args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    code = _run(args)
    if argv is None:
        # The process ends next. Its last garbage collection would visit every object torch and transformers
        # made at import, a second or so of CPU for nothing (measured in benchmarks/bench_cli_exit.py); frozen,
        # they are left to the process's end. Files and loggers are closed as before (by refcount, atexit).
        gc.freeze()
    return code


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; a user mistake or Ctrl-C is one line on stderr and its exit code."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        logger.debug("distconf %s failed", args.command, exc_info=True)
        print(f"distconf {args.command}: {error_message(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
