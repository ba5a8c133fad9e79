"""``distconf monitor``: a live web page of a swarm's health (plus JSON and Prometheus metrics).

The monitor joins the swarm as a DHT client through the --initial-peers given (there is
no default swarm), reads it every --refresh in a background thread, and serves the last
good snapshot; it listens on 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from distconf.cli.cmd_swarm import _resolve
from distconf.cli.helptext import initial_peers, join_swarm

__all__ = ["parse_duration", "parse_model", "register", "run"]

logger = logging.getLogger(__name__)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in ``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a bare number of seconds (> 0)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or float(match.group(1)) * _UNITS[match.group(2)] <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 10s, 500ms, 2m or 1h")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_model(text: str) -> tuple[str, int, str | None]:
    """``PREFIX:NUM_BLOCKS``, a shipped preset or a model directory -> (dht_prefix, block count, the preset
    named or None)."""
    from distconf.dht import MAX_NUM_BLOCKS
    from distconf.loader.naming import dht_prefix_problem

    head, sep, tail = text.rpartition(":")
    preset = None
    if sep and tail.isdigit():
        prefix, count = head, int(tail)
    else:
        from distconf.loader.presets import list_presets

        preset = text if not os.path.isdir(text) and text in list_presets() else None
        try:
            prefix, found = _resolve(text)
        except (ValueError, LookupError, OSError) as exc:
            raise argparse.ArgumentTypeError(f"{text}: {exc}") from None
        if found is None:
            raise argparse.ArgumentTypeError(f"{text!r}: give the block count of a bare prefix as PREFIX:NUM_BLOCKS")
        count = found
    problem = dht_prefix_problem(prefix)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{prefix!r} is not a DHT prefix: {problem}")
    if not 1 <= count <= MAX_NUM_BLOCKS:
        raise argparse.ArgumentTypeError(f"{text!r}: the block count must be in 1..{MAX_NUM_BLOCKS}")
    return prefix, count, preset


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``monitor`` subcommand."""
    p = subparsers.add_parser(
        "monitor", help="a live web page of a swarm: models, block coverage, servers, routes",
        description="Join a swarm as a DHT client and serve a web page of its health: every model in the swarm's "
                    "listing (and each --model, e.g. private '_' prefixes), its block coverage (by the number of "
                    "online servers per block), its servers and whether a full route exists. The same data is at "
                    "/api/v1/state (JSON, schema at /api/v1/schema) and /metrics (Prometheus). The swarm is read "
                    "in the background every --refresh; pages always answer at once with the last good data and "
                    "its age. Listens on 127.0.0.1 unless --host is given.",
        epilog="example: distconf monitor --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... --refresh 10s",
    )
    p.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", default=None,
                   help="multiaddrs of swarm peers (default: $DISTCONF_INITIAL_PEERS)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; another address exposes the page to the network)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--refresh", type=parse_duration, default=10.0, metavar="DURATION",
                   help="how often to read the swarm, e.g. 10s, 500ms, 2m (default 10s)")
    p.add_argument("--model", type=parse_model, action="append", default=[], metavar="MODEL",
                   help="also show this model: PREFIX:NUM_BLOCKS, a shipped preset or a model directory "
                        "(repeatable; needed for private prefixes, which are not listed)")
    p.add_argument("--max-models", type=int, default=None, help="most models read per refresh (default 64)")
    p.add_argument("--timeout", type=parse_duration, default=30.0, metavar="DURATION",
                   help="longest wait for one DHT read (default 30s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Join the swarm, then serve the page until interrupted."""
    from distconf.monitor import DEFAULT_MAX_MODELS, Monitor, build_app, dht_reader, serve_forever
    from distconf.monitor.app import LOOPBACK_HOSTS
    from distconf.monitor.serve import is_loopback

    peers = initial_peers(args, "monitor")
    if peers is None:
        return 2
    if not 0 <= args.port <= 65535:
        print("distconf monitor: --port must be in 0..65535", file=sys.stderr)
        return 2
    max_models = DEFAULT_MAX_MODELS if args.max_models is None else args.max_models
    if max_models < 1:
        print("distconf monitor: --max-models must be at least 1", file=sys.stderr)
        return 2
    dht = join_swarm(peers, "monitor")
    if dht is None:
        return 2
    try:
        extra = {prefix: count for prefix, count, _ in args.model}
        presets = {prefix: preset for prefix, _, preset in args.model if preset}
        monitor = Monitor(dht_reader(dht, extra, max_models=max_models, timeout=args.timeout, repositories=presets),
                          refresh=args.refresh)
        loopback = is_loopback(args.host)
        if not loopback:
            logger.warning("listening on %s: the page is reachable from the network", args.host)
        app = build_app(monitor, allowed_hosts=LOOPBACK_HOSTS if loopback else None)
        def ready(port: int) -> None:
            print(f"distconf monitor: serving http://{args.host}:{port}/ (Ctrl-C to stop)", file=sys.stderr,
                  flush=True)

        serve_forever(app, args.host, args.port, on_ready=ready)
    finally:
        dht.shutdown()
    return 0
