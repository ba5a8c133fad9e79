"""``distconf swarm``: coverage of a model on a running swarm, and whether a full route exists.

Everything read from the swarm is untrusted: the block count comes from the model's
config when one is known (the swarm's listing is only cross-checked against it), a
listed count is capped (`distconf.dht.MAX_NUM_BLOCKS`), and every table printed is
bounded (rows, columns, hops, listed models).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from distconf.cli.helptext import add_command, initial_peers, join_swarm
from distconf.loader.naming import config_num_blocks


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``swarm`` subcommand."""
    p = add_command(
        subparsers, "swarm", summary="show which peers serve which blocks of a model, and whether a full route exists",
        examples=[
            ("distconf swarm --initial-peers ADDR --model org/model-petals",
             "coverage of a model the swarm lists"),
            ("distconf swarm --initial-peers ADDR --model ./my-model", "block count from the model's config"),
            ("distconf swarm --initial-peers ADDR --model _private --num-blocks 24 --json",
             "a private prefix, as JSON"),
        ],
        description="Join a swarm as a client (through the --initial-peers you give; there is no default) and "
                    "show the coverage of a model: one row per peer span with state, throughput and cache tokens "
                    "left, one column per block (joining servers included), then the route a client would take "
                    "(through online servers, as clients route). MODEL is a DHT prefix (its block count is read "
                    "from the swarm's model listing, or --num-blocks), a shipped preset or a model directory (their "
                    "config gives the block count). Exit 0 if a full route exists, 1 if not, 2 on bad arguments.",
    )
    p.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", default=None,
                   help="multiaddrs of swarm peers, e.g. /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... "
                        "(default: $DISTCONF_INITIAL_PEERS)")
    p.add_argument("--model", required=True, help="DHT prefix, preset hub id, or model directory")
    p.add_argument("--num-blocks", type=int, default=None, help="block count when MODEL is a bare prefix "
                   "that the swarm does not list")
    p.add_argument("--include-joining", action="store_true",
                   help="also route through JOINING servers (still loading their blocks)")
    p.add_argument("--online-only", action="store_true", help="route through ONLINE servers only (the default)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the DHT (default 30)")
    p.add_argument("--json", action="store_true", help="print spans and route as JSON")
    p.set_defaults(func=run)


def _resolve(model: str) -> tuple[str, int | None]:
    """(dht_prefix, block count or None) of a preset, a model directory or a bare prefix."""
    if os.path.isdir(model):
        from distconf.loader.auto import AutoDistributedConfig

        cfg = AutoDistributedConfig.from_pretrained(model)
        if not cfg.dht_prefix:
            raise ValueError(f"{model}/config.json has no dht_prefix; pass the prefix as --model instead")
        return cfg.dht_prefix, config_num_blocks(cfg)
    if "/" in model:
        try:
            from distconf import load_preset
            from distconf.loader.presets import list_presets

            if model in list_presets():
                cfg = load_preset(model)
                return cfg.dht_prefix, config_num_blocks(cfg)
        except ImportError:
            pass
    return model, None


def run(args: argparse.Namespace) -> int:
    """Print the coverage table and route."""
    from distconf.dht import MAX_NUM_BLOCKS

    peers = initial_peers(args, "swarm")
    if peers is None:
        return 2
    if args.num_blocks is not None and not 1 <= args.num_blocks <= MAX_NUM_BLOCKS:
        print(f"distconf swarm: --num-blocks must be in 1..{MAX_NUM_BLOCKS}", file=sys.stderr)
        return 2
    try:
        prefix, config_blocks = _resolve(args.model)
    except (ValueError, LookupError, OSError) as exc:
        print(f"distconf swarm: {exc}", file=sys.stderr)
        return 2
    if config_blocks is not None and not 1 <= config_blocks <= MAX_NUM_BLOCKS:
        print(f"distconf swarm: {args.model} has {config_blocks} blocks; at most {MAX_NUM_BLOCKS} are supported",
              file=sys.stderr)
        return 2

    from distconf.dht import find_servers_by_prefix, read_model_listing

    dht = join_swarm(peers, "swarm")
    if dht is None:
        return 2
    try:
        try:
            models, skipped = read_model_listing(dht, timeout=args.timeout)
        except TimeoutError:
            if config_blocks is None and args.num_blocks is None:
                raise
            models, skipped = {}, {}  # the listing only cross-checks a known block count
        num_blocks = _block_count(prefix, args.num_blocks, config_blocks, models, skipped)
        if num_blocks is None:
            return 1
        state = find_servers_by_prefix(dht, prefix, num_blocks, timeout=args.timeout)
    finally:
        dht.shutdown()
    return 0 if _print_state(state, args) else 1


def _block_count(prefix: str, given: int | None, config_blocks: int | None, models: dict[str, Any],
                 skipped: dict[str, str]) -> int | None:
    """The block count to read: --num-blocks, else the config's, else the listing's (cross-checked)."""
    listed = models.get(prefix)
    if config_blocks is not None:
        if listed is not None and listed.num_blocks != config_blocks:
            print(f"distconf swarm: warning: the swarm lists {prefix!r} with {listed.num_blocks} blocks but its "
                  f"config has {config_blocks}; using the config", file=sys.stderr)
        return given or config_blocks
    if given is not None:
        return given
    if listed is not None:
        return listed.num_blocks
    names = sorted(models)
    known = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "") or "none"
    why = f"; its listing is invalid: {skipped[prefix][:120]}" if prefix in skipped else ""
    print(f"distconf swarm: the swarm lists no model {prefix!r}{why} (listed: {known}); "
          "pass --num-blocks for a private prefix", file=sys.stderr)
    return None


def _route_state(args: argparse.Namespace) -> Any:
    from distconf.dht import ServerState

    return ServerState.JOINING if args.include_joining and not args.online_only else ServerState.ONLINE


def _print_state(state: Any, args: argparse.Namespace) -> bool:
    """Print coverage and route (or JSON); return whether a full route exists."""
    from distconf.dht import ServerState
    from distconf.dht.report import format_coverage, format_route

    min_state = _route_state(args)
    ok, route_text = format_route(state, min_state)
    if not ok and min_state == ServerState.ONLINE and not args.online_only:
        with_joining, text = format_route(state, ServerState.JOINING)
        if with_joining:
            route_text += f"\n(counting joining servers, still loading: {text}; see --include-joining)"
    if args.json:
        print(json.dumps(_as_json(state, ok, route_text), indent=2))
    else:
        print(format_coverage(state))
        print()
        print(route_text)
    return ok


MAX_JSON_SPANS = 1000
"""Most spans listed in ``--json`` output (``spans_not_shown`` counts the rest)."""


def _as_json(state: Any, ok: bool, route_text: str) -> dict[str, Any]:
    return {
        "dht_prefix": state.dht_prefix,
        "num_blocks": state.num_blocks,
        "spans": [{"peer_id": s.peer_id, "start": s.start, "end": s.end, "state": s.state.name.lower(),
                   "throughput": s.throughput, "cache_tokens_left": s.info.cache_tokens_left,
                   "public_name": s.info.public_name} for s in state.spans[:MAX_JSON_SPANS]],
        "spans_not_shown": max(0, len(state.spans) - MAX_JSON_SPANS),
        "uncovered_blocks": state.uncovered_blocks()[:MAX_JSON_SPANS],
        "skipped_records": len(state.skipped),
        "failed_blocks": len(state.failed),
        "route_exists": ok,
        "route": route_text,
    }
