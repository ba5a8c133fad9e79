"""``distconf swarm``: coverage of a model on a running swarm, and whether a full route exists."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``swarm`` subcommand."""
    p = subparsers.add_parser(
        "swarm", help="show which peers serve which blocks of a model, and whether a full route exists",
        description="Join a swarm as a client (through the --initial-peers you give; there is no default) and "
                    "show the coverage of a model: one row per peer span with state, throughput and cache tokens "
                    "left, one column per block, then the route a client would take. MODEL is a DHT prefix "
                    "(its block count is read from the swarm's model listing, or --num-blocks), a shipped preset "
                    "or a model directory. Exit 0 if a full route exists, 1 if not, 2 on bad arguments.",
    )
    p.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", default=None,
                   help="multiaddrs of swarm peers, e.g. /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... "
                        "(default: $DISTCONF_INITIAL_PEERS)")
    p.add_argument("--model", required=True, help="DHT prefix, preset hub id, or model directory")
    p.add_argument("--num-blocks", type=int, default=None, help="block count when MODEL is a bare prefix "
                   "that the swarm does not list")
    p.add_argument("--online-only", action="store_true", help="route through ONLINE servers only")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the DHT (default 30)")
    p.add_argument("--json", action="store_true", help="print spans and route as JSON")
    p.set_defaults(func=run)


def _resolve(model: str) -> tuple[str, int | None]:
    """(dht_prefix, block count or None) of a preset, a model directory or a bare prefix."""
    if os.path.isdir(model):
        from distconf.family.auto import AutoDistributedConfig

        cfg = AutoDistributedConfig.from_pretrained(model)
        if not cfg.dht_prefix:
            raise ValueError(f"{model}/config.json has no dht_prefix; pass the prefix as --model instead")
        return cfg.dht_prefix, cfg.num_hidden_layers
    if "/" in model:
        try:
            from distconf import load_preset
            from distconf.family.presets import list_presets

            if model in list_presets():
                cfg = load_preset(model)
                return cfg.dht_prefix, cfg.num_hidden_layers
        except ImportError:
            pass
    return model, None


def run(args: argparse.Namespace) -> int:
    """Print the coverage table and route."""
    from distconf.family.mixins import default_initial_peers

    peers = args.initial_peers or default_initial_peers()
    if not peers:
        print("distconf swarm: give --initial-peers (or set DISTCONF_INITIAL_PEERS); there is no default swarm",
              file=sys.stderr)
        return 2
    try:
        prefix, num_blocks = _resolve(args.model)
    except (ValueError, LookupError, OSError) as exc:
        print(f"distconf swarm: {exc}", file=sys.stderr)
        return 2
    num_blocks = args.num_blocks or num_blocks

    from distconf.dht import ServerState, find_models, find_servers_by_prefix, start_local_dht
    from distconf.dht.report import format_coverage, format_route

    try:
        dht = start_local_dht(peers, client_mode=True, await_ready=True)
    except Exception as exc:  # hivemind raises several types for unreachable/invalid peers
        print(f"distconf swarm: cannot join the swarm through {peers}: {exc}", file=sys.stderr)
        return 2
    try:
        if num_blocks is None:
            models = find_models(dht, timeout=args.timeout)
            if prefix not in models:
                known = ", ".join(sorted(models)) or "none"
                print(f"distconf swarm: the swarm lists no model {prefix!r} (listed: {known}); "
                      "pass --num-blocks for a private prefix", file=sys.stderr)
                return 1
            num_blocks = models[prefix].num_blocks
        state = find_servers_by_prefix(dht, prefix, num_blocks, timeout=args.timeout)
    finally:
        dht.shutdown()
    min_state = ServerState.ONLINE if args.online_only else ServerState.JOINING
    ok, route_text = format_route(state, min_state)
    if args.json:
        print(json.dumps(_as_json(state, ok, route_text), indent=2))
    else:
        print(format_coverage(state))
        print()
        print(route_text)
    return 0 if ok else 1


def _as_json(state: Any, ok: bool, route_text: str) -> dict[str, Any]:
    return {
        "dht_prefix": state.dht_prefix,
        "num_blocks": state.num_blocks,
        "spans": [{"peer_id": s.peer_id, "start": s.start, "end": s.end, "state": s.state.name.lower(),
                   "throughput": s.throughput, "cache_tokens_left": s.info.cache_tokens_left,
                   "public_name": s.info.public_name} for s in state.spans],
        "uncovered_blocks": state.uncovered_blocks(),
        "skipped_records": len(state.skipped),
        "route_exists": ok,
        "route": route_text,
    }
