"""``distconf plan``: how many blocks of a model a server with given memory can hold."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from distconf.blocks.device import DTYPE_CHOICES
from distconf.blocks.quant import QUANT_TYPES
from distconf.cli.helptext import add_command, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    p = add_command(
        subparsers, "plan", summary="capacity plan: blocks, cache tokens and bytes for a server with given memory",
        description="Plan a server for a model (a shipped preset, see `distconf demo`, or a local "
                    "model directory): how many blocks fit in MEMORY, how many attention-cache tokens they hold, "
                    "and the bytes of each part, with the correct KV geometry. Shown side by side with what the "
                    "Petals 2.x formula (2 * hidden_size / num_key_value_groups values per token) reserves. "
                    "Exit 1 if not one block fits.",
        examples=[("distconf plan ORG/MODEL --memory 24GiB", "a shipped preset, bfloat16"),
                  ("distconf plan ~/models/my-model --memory 80GB --quant nf4", "a local model, 4-bit weights"),
                  ("distconf plan ORG/MODEL --memory 48GiB --num-devices 2 --json", "two devices, as JSON"),
                  ("distconf plan ~/models/my-model --memory 8GiB --adapters ./my-lora",
                   "with a LoRA adapter beside every block")],
    )
    p.add_argument("model", metavar="PRESET_OR_DIR", help="a preset hub id (see `distconf demo`) or a model directory")
    p.add_argument("--memory", required=True, help="memory for the server, e.g. 24GiB, 80GB, 512MiB")
    p.add_argument("--dtype", "--torch-dtype", "--torch_dtype", dest="dtype", default="bf16", choices=DTYPE_CHOICES,
                   help="compute and cache dtype (default bf16; auto: what `distconf serve --dtype auto` takes on "
                        "CPU, the checkpoint's dtype with float16 computed in float32)")
    p.add_argument("--quant", "--quant-type", "--quant_type", dest="quant", default="none", choices=QUANT_TYPES,
                   help="weight quantization (the same rule `distconf serve --quant` loads with)")
    p.add_argument("--attn-cache-tokens", type=int, default=None,
                   help="cache tokens per block (default 16384 for grouped-query models, else 4096)")
    p.add_argument("--num-devices", type=positive_int, default=1,
                   help="devices sharing the blocks (tensor parallel; default 1)")
    p.add_argument("--adapters", nargs="+", default=(), metavar="FOLDER",
                   help="LoRA adapter folders served beside the blocks (distconf serve --adapters): their bytes "
                        "count with each block's weights")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def load_model_config(name: str) -> Any:
    """A distributed config from a local directory or a shipped preset."""
    if os.path.isdir(name):
        from distconf.loader.auto import AutoDistributedConfig

        return AutoDistributedConfig.from_pretrained(name)
    from distconf import load_preset

    return load_preset(name)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _adapter_bytes(args: argparse.Namespace, config: Any, dtype: Any) -> int:
    """Bytes of ``--adapters`` beside each block (their largest layer), in the plan's dtype."""
    if not args.adapters:
        return 0
    import torch

    from distconf.blocks.lora import lora_bytes_per_block
    from distconf.planning import resolve_dtype
    from distconf.server.adapters import parse_adapters

    torch_dtype = getattr(torch, resolve_dtype(dtype))
    return sum(lora_bytes_per_block(s.folder(), config, torch_dtype) for s in parse_adapters(args.adapters))


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 1 on a bad argument or if not one block fits."""
    from distconf.cli.table import format_table
    from distconf.planning import parse_memory, plan_server

    try:
        memory = parse_memory(args.memory)
        config = load_model_config(args.model)
        dtype = args.dtype
        if dtype == "auto":
            import torch

            from distconf.blocks.device import resolve_compute_dtype

            dtype = resolve_compute_dtype("auto", config, torch.device("cpu"))[0]
        plan = plan_server(config, memory, dtype, args.quant, args.attn_cache_tokens,
                           num_devices=args.num_devices, adapter_bytes_per_block=_adapter_bytes(args, config, dtype))
    except (ValueError, LookupError, OSError) as exc:
        print(f"distconf plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"model": args.model, "dht_prefix": config.dht_prefix, **plan.to_dict()}, indent=2))
        return 0 if plan.num_blocks else 1

    quant = plan.quant or "none"
    wire = f" (wire width {config.wire_width})" if config.wire_width != config.hidden_size else ""
    print(f"{args.model}: {type(config).__name__}, {plan.max_blocks} blocks, hidden_size {config.hidden_size}{wire}, "
          f"KV groups {config.num_key_value_groups}")
    print(f"server: {_gib(memory)} memory, dtype {plan.dtype}, quant {quant}, "
          f"{args.num_devices} device(s)\n")
    o_tok = plan.petals_default_attn_cache_tokens
    rows = [
        ["KV bytes/token/block", f"{plan.kv_bytes_per_token:,}", f"{plan.petals_kv_bytes_per_token:,}",
         f"{plan.petals_kv_bytes_per_token:,}"],
        *([["state bytes/sequence/block", f"{plan.state_bytes_per_sequence:,}", "-", "-"],
           ["state sequences", f"{plan.state_sequences:,}", "-", "-"]] if plan.state_blocks else []),
        ["attention cache tokens", f"{plan.attn_cache_tokens:,}", f"{plan.attn_cache_tokens:,}", f"{o_tok:,}"],
        ["cache per block", _mib(plan.cache_bytes_per_block), _mib(plan.petals_cache_bytes_per_block),
         _mib(plan.petals_default_cache_bytes_per_block)],
        ["block weights", _mib(plan.block_bytes), _mib(plan.block_bytes), _mib(plan.block_bytes)],
        *([["of which adapters", _mib(plan.adapter_bytes_per_block), "-", "-"]]
          if plan.adapter_bytes_per_block else []),
        ["autograd reserve", _mib(plan.autograd_reserve_bytes), _mib(plan.autograd_reserve_bytes),
         _mib(plan.autograd_reserve_bytes)],
        ["blocks that fit", f"{plan.num_blocks} / {plan.max_blocks}",
         f"{plan.petals_num_blocks} / {plan.max_blocks}", f"{plan.petals_default_num_blocks} / {plan.max_blocks}"],
        ["weights total", _gib(plan.total_block_bytes), _gib(plan.block_bytes * plan.petals_num_blocks),
         _gib(plan.block_bytes * plan.petals_default_num_blocks)],
        ["cache total", _gib(plan.total_cache_bytes),
         _gib(plan.petals_cache_bytes_per_block * plan.petals_num_blocks),
         _gib(plan.petals_default_cache_bytes_per_block * plan.petals_default_num_blocks)],
    ]
    print(format_table(
        ["", "distconf (real KV geometry)", "Petals 2.x formula, same tokens",
         f"Petals 2.x formula, its default ({o_tok} tokens)"], rows))
    print()
    ratio = plan.petals_over_reservation
    groups = plan.petals_kv_groups
    if plan.state_blocks:
        _print_state_rule(plan)
    elif abs(ratio - 1.0) > 1e-9:
        print(f"Petals 2.x's formula 2 * hidden_size / num_key_value_groups (groups = {groups}) reserves "
              f"{ratio:.2f}x the cache this block really keeps per token.")
    else:
        print("Petals 2.x's formula agrees with the real KV geometry for this model.")
    if plan.num_blocks == 0:
        print(f"Not even one block fits in {_gib(memory)}.", file=sys.stderr)
        return 1
    if plan.state_blocks and plan.kv_blocks:
        print(f"Plan: serve {plan.num_blocks} block(s), {_gib(plan.used_bytes)} used; a K/V block caches "
              f"{plan.cache_tokens:,} tokens, a state block holds the state of {plan.state_sequences:,} sequences.")
        return 0
    if plan.state_blocks:  # a recurrent state per sequence, not K/V per token
        print(f"Plan: serve {plan.num_blocks} block(s), {_gib(plan.used_bytes)} used; each block keeps a state of "
              f"{plan.state_bytes_per_sequence:,} bytes per sequence instead of K/V, room for "
              f"{plan.state_sequences:,} sequences (the memory {plan.attn_cache_tokens:,} tokens of K/V would take).")
        return 0
    print(f"Plan: serve {plan.num_blocks} block(s), {_gib(plan.used_bytes)} used; the attention cache holds "
          f"{plan.cache_tokens:,} tokens for each block (max batch size / inference length {plan.max_length}).")
    return 0


def _print_state_rule(plan: Any) -> None:
    """How the cache of blocks keeping a per-sequence state is counted (Petals 2.x's formula has no state)."""
    kv_part = plan.kv_bytes_per_token * plan.attn_cache_tokens
    state_part = plan.state_bytes_per_sequence * plan.state_sequences
    both = "" if plan.kv_blocks + plan.state_blocks <= plan.max_blocks else " (some keep both)"
    print(f"{plan.kv_blocks} of {plan.max_blocks} blocks keep K/V ({plan.kv_bytes_per_token:,} bytes/token), "
          f"{plan.state_blocks} keep a state ({plan.state_bytes_per_sequence:,} bytes/sequence){both}.")
    if plan.kv_blocks:
        print(f"The span is not chosen yet, so every block is reserved the cache of the largest block: "
              f"{_mib(plan.cache_bytes_per_block)} (K/V of {plan.attn_cache_tokens:,} tokens: {_mib(kv_part)}; "
              f"state of {plan.state_sequences:,} sequences: {_mib(state_part)}).")
    print("Petals 2.x's formula (2 * hidden_size / num_key_value_groups values per token) reserves no state.")
