"""``distconf demo``: the main job of ``make demo`` on built-in data, offline."""

from __future__ import annotations

import argparse
import importlib
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = subparsers.add_parser(
        "demo", help="validate the built-in families and summarize every preset (and run a local swarm)",
        description="Validate the built-in families, then load every shipped preset through its family's "
                    "from_pretrained and print one row per model: family, class, DHT prefix, blocks, KV groups, "
                    "block size and KV bytes per token. Then, unless --no-swarm, start a small swarm on "
                    "127.0.0.1 (servers loading real weights of a tiny local model) and route through it.",
    )
    p.add_argument("--no-swarm", action="store_true", help="skip the local swarm part")
    p.add_argument("--swarm-family", metavar="FAMILY", default=None,
                   help="family of the tiny model the swarm serves (default: the first built-in family "
                        "with a tiny_config); any family works, the servers use only its family file")
    p.add_argument("--servers", type=int, default=3, help="server processes in the swarm (default: 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 1 if anything fails."""
    from distconf import load_preset
    from distconf.cli.table import format_table
    from distconf.errors import FamilyNotFoundError, FamilyValidationError
    from distconf.family.data import builtin_families_dir
    from distconf.family.presets import list_presets
    from distconf.family.source import validate_paths

    print("== 1. validate the built-in family files")
    try:
        sources = validate_paths([builtin_families_dir()])
    except FamilyValidationError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{len(sources)} family files valid: {', '.join(s.spec.family for s in sources)}\n")

    print("== 2. every preset through its family's from_pretrained (offline copies of real configs)")
    sizing = _optional("distconf.sizing")
    rows = []
    skipped = []
    for hub_id in list_presets():
        try:
            cfg = load_preset(hub_id)
        except FamilyNotFoundError:
            skipped.append(hub_id)
            continue
        row = [type(cfg).family_spec.family, hub_id, type(cfg).__name__, cfg.dht_prefix,
               cfg.num_hidden_layers, cfg.num_key_value_groups]
        if sizing is not None:
            import torch

            row.append(f"{sizing.block_size_bytes(cfg, dtype=torch.bfloat16) / 2**20:,.0f}")
            row.append(f"{sizing.block_size_bytes(cfg, dtype=torch.bfloat16, quant='nf4') / 2**20:,.0f}")
            row.append(f"{sizing.kv_cache_bytes_per_token(cfg, torch.bfloat16):,}")
        rows.append(row)
    rows.sort(key=lambda row: (row[0], row[1]))
    headers = ["family", "model", "class", "DHT prefix", "blocks", "KV groups"]
    if sizing is not None:
        headers += ["block MiB bf16", "block MiB nf4", "KV B/token/block"]
    print(format_table(headers, rows))
    if skipped:
        print(f"(no family file serves these presets: {', '.join(skipped)})")
    if args.no_swarm:
        return 0
    swarm = _optional("distconf.tools.swarm_demo")
    if swarm is None:
        return 0
    print("\n== 3. a local swarm on 127.0.0.1")
    return int(swarm.run_swarm_demo(args.servers, family=args.swarm_family) or 0)


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
