"""``distconf show``: what a family (and optionally a concrete config) resolves to."""

from __future__ import annotations

import argparse
import sys

from distconf.cli.helptext import add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``show`` subcommand."""
    p = add_command(
        subparsers, "show", summary="show a family's class, block metadata and, with a config, its DHT prefix and uids",
        description="Show the synthesized class of a family: file, bases, block and attention classes, state-dict "
                    "prefix, KV groups. With --config or --preset also the loaded config's KV groups, derived DHT "
                    "prefix, block uid range and block/KV sizes; --name derives the DHT prefix as if the config "
                    "came from that hub id.",
        examples=[("distconf show FAMILY", "the class a family file synthesizes"),
                  ("distconf show --preset ORG/MODEL", "a shipped real config (family from its model_type)"),
                  ("distconf show --config ~/models/my-model/", "a local model folder or config.json"),
                  ("distconf show --preset ORG/MODEL --name ORG/MODEL-chat", "DHT prefix of another hub id")],
    )
    p.add_argument("family", nargs="?", help="family name or family file (inferred from --config/--preset if omitted)")
    p.add_argument("--config", metavar="DIR_OR_FILE", help="a local model folder or config.json")
    p.add_argument("--preset", metavar="HUB_ID", help="a shipped real-model config (see `distconf demo` for the list)")
    p.add_argument("--name", metavar="HUB_ID",
                   help="derive the DHT prefix as if the config was loaded from this hub id")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print a two-column description."""
    from distconf.errors import ConfigValueError, FamilyNotFoundError, FamilyValidationError
    from distconf.loader import load_family
    from distconf.loader.auto import AutoDistributedConfig
    from distconf.loader.naming import derive_dht_prefix
    from distconf.tools.describe import describe_class, describe_config

    if args.config and args.preset:
        print("distconf show: give --config or --preset, not both", file=sys.stderr)
        return 2
    try:
        config = None
        if args.preset or args.config:
            source = args.preset or args.config
            kwargs = {"preset": True} if args.preset else {}
            cls = load_family(args.family) if args.family else None
            if args.name:
                rule = (cls or AutoDistributedConfig.family_class(_model_type(args))).family_spec.dht_prefix
                kwargs["dht_prefix"] = derive_dht_prefix(rule, args.name)
            config = (cls.from_pretrained(source, **kwargs) if cls
                      else AutoDistributedConfig.from_pretrained(source, **kwargs))
            cls = type(config)
        elif args.family:
            cls = load_family(args.family)
        else:
            print("distconf show: name a FAMILY, or give --config or --preset", file=sys.stderr)
            return 2
        rows = describe_class(cls)
        if config is not None:
            rows += describe_config(config)
    except (FamilyValidationError, FamilyNotFoundError, ConfigValueError, OSError, ValueError) as exc:
        print(f"distconf show: {exc}", file=sys.stderr)
        return 1
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}")
    return 0


def _model_type(args: argparse.Namespace) -> str:
    from distconf.loader.auto import read_model_type as _read_model_type

    return _read_model_type(args.preset or args.config, bool(args.preset), {})
