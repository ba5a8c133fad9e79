"""Arguments of the commands that talk to a model on a swarm: MODEL, --initial-peers, --dht-prefix, a PROMPT anywhere.

`add_verify_arguments` adds the spot-check options (``--verify-fraction``,
``--verify-tolerance``, ``--weights-manifest``) and `verify_fields` turns them into the
client config fields of the same names.

``--initial-peers`` takes one or more multiaddrs, so plain argparse lets it swallow whatever
follows it: ``distconf generate ./model --initial-peers ADDR 'A cat sat'`` would read the prompt
as a second address. Here the addresses are the leading values that look like multiaddrs
(they start with ``/``); the first value that does not ends the list. That value, and any
positional argparse could not place because it came after other options, fill the command's
positionals still empty, in order (`PositionalsAnywhere`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["InitialPeersAction", "PositionalsAnywhere", "add_swarm_arguments", "add_verify_arguments",
           "verify_fields"]

_SPILLED = "_positional_words"
"""Namespace attribute collecting the words that are not multiaddrs, for `PositionalsAnywhere`."""


class InitialPeersAction(argparse.Action):
    """``--initial-peers ADDR [ADDR ...]``: the leading multiaddrs; the values after them are kept as positionals."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        """Store the leading multiaddrs in ``dest``; keep the rest for `PositionalsAnywhere`."""
        values = list(values)
        count = next((i for i, value in enumerate(values) if not value.startswith("/")), len(values))
        if count == 0:
            parser.error(f"{option_string}: expected a multiaddr such as /ip4/127.0.0.1/tcp/31337/p2p/<id>, "
                         f"got {values[0]!r}")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *values[:count]])
        setattr(namespace, _SPILLED, [*getattr(namespace, _SPILLED, []), *values[count:]])


class PositionalsAnywhere(argparse.ArgumentParser):
    """A subcommand parser whose optional positionals (``nargs="?"``) may stand anywhere among the options.

    Argparse places positionals at the first run of non-option words (filling later ones with
    their default when that run is short), so a PROMPT after ``--max-new-tokens 8`` would be
    "unrecognized". This parser gives such leftover words, and those `InitialPeersAction` kept,
    to the positionals still unset, in order; the ``required_positionals`` (by dest) must be set
    in the end, else it reports the usage error argparse would.
    """

    required_positionals: tuple[str, ...] = ()

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Parse as argparse does, then place the leftover words (see the class docstring)."""
        namespace, extras = super().parse_known_args(args, namespace)
        words = [*getattr(namespace, _SPILLED, []), *(e for e in extras if not e.startswith("-"))]
        extras = [e for e in extras if e.startswith("-")]
        if hasattr(namespace, _SPILLED):
            delattr(namespace, _SPILLED)
        for action in self._positionals._group_actions:
            if words and action.nargs == "?" and getattr(namespace, action.dest, None) is None:
                setattr(namespace, action.dest, words.pop(0))
        missing = [a.metavar or a.dest for a in self._positionals._group_actions
                   if a.dest in self.required_positionals and getattr(namespace, a.dest, None) is None]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return namespace, [*words, *extras]


def add_swarm_arguments(parser: argparse.ArgumentParser, *, prompt: bool = False) -> None:
    """Add MODEL (and PROMPT when ``prompt``), ``--initial-peers`` and ``--dht-prefix`` to a subcommand ``parser``.

    The parser becomes a `PositionalsAnywhere` (MODEL required), so the positionals may come
    before, between or after the options.
    """
    parser.__class__ = PositionalsAnywhere  # same state, one method more: argparse builds subparsers itself
    parser.required_positionals = ("model",)  # type: ignore[attr-defined]
    parser.usage = "%(prog)s MODEL" + (" [PROMPT]" if prompt else "") + " [options]"
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="model folder, .gguf file (or a folder holding one), or a cached hub id")
    if prompt:
        parser.add_argument("prompt", metavar="PROMPT", nargs="?", default=None,
                            help="prompt text (needs a tokenizer in MODEL); may stand anywhere on the line")
    parser.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", default=None, action=InitialPeersAction,
                        help="multiaddrs of swarm peers, each starting with / (default: $DISTCONF_INITIAL_PEERS)")
    parser.add_argument("--dht-prefix", default=None, metavar="PREFIX",
                        help="prefix of the model's blocks on the DHT (default: config.json's, else derived from the "
                             "model's name by the family's rule)")
    add_hub_arguments(parser, "MODEL may be a Hugging Face hub id: only the client's part is downloaded (config, "
                              "tokenizer, the shards outside the blocks)")


def add_hub_arguments(parser: argparse.ArgumentParser, about: str) -> Any:
    """Add the hub-id group (Petals' ``--revision``, ``--token``, ``--cache_dir``) described by ``about``; returns
    the group (a server adds ``--max-disk-space`` to it)."""
    hub = parser.add_argument_group("hub ids (Petals' flags)", about)
    hub.add_argument("--revision", default=None, metavar="REV", help="branch, tag or commit of MODEL (default main)")
    hub.add_argument("--token", default=None, metavar="TOKEN",
                     help="for a private or gated repository (default: $HF_TOKEN or your huggingface_hub login)")
    hub.add_argument("--cache-dir", "--cache_dir", dest="cache_dir", default=None, metavar="DIR",
                     help="the Hugging Face cache to download into (default: $HF_HUB_CACHE, else "
                          "~/.cache/huggingface)")
    return hub


def _config_number(field: str) -> Any:
    """Argparse type: a number that the config field ``field`` accepts (its type is the one home of the rule)."""
    from distconf.errors import ConfigValueError
    from distconf.loader.mixins import check_field

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        try:
            check_field(field, value)
        except ConfigValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(" is invalid: ", 1)[-1]) from None
        return value

    return parse


def _manifest(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file (write one with: distconf manifest MODEL)")
    return text


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--verify-fraction``, ``--verify-tolerance`` and ``--weights-manifest`` (client config fields)."""
    group = parser.add_argument_group(
        "verification", "spot checks: an independent server recomputes a share of the steps; a server\n"
                        "caught computing wrong is banned, the answer keeps the honest results, and the\n"
                        "detection is reported (and published on the swarm's DHT for distconf monitor)")
    group.add_argument("--verify-fraction", type=_config_number("verify_fraction"), default=None, metavar="F",
                       help="share of steps (0..1) an independent server recomputes and compares; a server's "
                            "first step is always checked (default 0: off; 0.1 is a good start)")
    group.add_argument("--verify-tolerance", type=_config_number("verify_tolerance"), default=None, metavar="T",
                       help="largest relative difference of a span's result taken as honest rounding "
                            "(default: the measured one for the model's dtype)")
    group.add_argument("--weights-manifest", type=_manifest, default=None, metavar="FILE",
                       help="refuse servers whose announced per-block weight digests differ from this file "
                            "(written by distconf manifest MODEL); a digest is the server's claim, the spot "
                            "checks are what catch a liar")


def verify_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The client config fields the verification options set (only those given)."""
    fields: dict[str, Any] = {}
    if args.verify_fraction is not None:
        fields["verify_fraction"] = args.verify_fraction
    if args.verify_tolerance is not None:
        fields["verify_tolerance"] = args.verify_tolerance
    if args.weights_manifest is not None:
        fields["weights_manifest"] = os.path.abspath(args.weights_manifest)
    return fields


def hub_options(args: argparse.Namespace) -> Any:
    """The `distconf.sources.hub_fetch.HubOptions` of a command's hub flags."""
    from distconf.sources.hub_fetch import HubOptions

    return HubOptions(revision=args.revision, token=args.token, cache_dir=args.cache_dir)


def add_adapter_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--adapter NAME``: the LoRA adapter the servers apply (Petals' ``active_adapter``)."""
    parser.add_argument("--adapter", default=None, metavar="NAME",
                        help="a LoRA adapter the servers serve (distconf serve --adapters), by the name they "
                             "announce; only servers serving it are used (default: the base model)")


def adapter_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The client config field ``--adapter`` sets (``active_adapter``), when given."""
    return {"active_adapter": args.adapter} if args.adapter else {}
