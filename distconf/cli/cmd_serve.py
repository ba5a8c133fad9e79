"""``distconf serve``: serve blocks of a model to a swarm over the Petals 2.x protocol."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
from typing import Any

from distconf.blocks.device import DEVICE_HELP, DTYPE_CHOICES, DTYPE_HELP
from distconf.blocks.quant import QUANT_TYPES
from distconf.cli.helptext import add_command, positive_int, seconds
from distconf.cli.swarm_args import add_hub_arguments
from distconf.server.ready import READY_TAG, parse_ready_line, ready_line, ready_record

__all__ = ["register", "run", "main", "parse_blocks", "READY_TAG", "ready_record", "ready_line", "parse_ready_line"]

logger = logging.getLogger(__name__)

COMPRESSION_NAMES = ("NONE", "FLOAT16", "MEANSTD_16BIT", "QUANTILE_8BIT", "UNIFORM_8BIT", "BLOCKWISE_8BIT")
"""``--compression`` choices: hivemind's ``CompressionType`` names (`distconf.rpc.protocol.COMPRESSIONS`, which a
test compares; written here so that ``--help`` does not import hivemind)."""

def parse_blocks(text: str) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)`` (B exclusive)."""
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
        raise argparse.ArgumentTypeError(f"--blocks must be START:END with START < END, got {text!r}")
    return int(start), int(end)


def _share(text: str) -> float:
    """A fraction in (0, 1] (``--max-peer-cache-share``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _memory(text: str) -> int:
    """Argparse type: bytes, or a size such as 20GiB or 512MB."""
    from distconf.planning import parse_memory

    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = add_command(
        subparsers, "serve", summary="serve blocks of a model to a swarm (Petals 2.x protocol)",
        description="Load blocks of MODEL (a Hugging Face model folder as it is, a .gguf file or a folder holding "
                    "one, or a hub id in the local Hugging Face cache) and serve them on the swarm reached through "
                    "--initial-peers (or a new swarm with --new-swarm, whose address is printed). The DHT prefix is "
                    "config.json's dht_prefix, else derived from the model's name (--dht-prefix overrides it). "
                    "Without --blocks the server sizes itself with the planner: for --memory, else from the memory "
                    "available on its device (RAM minus max(10%, 1 GiB) on CPU, free memory minus 5% on CUDA), "
                    "and takes the weakest part of the chain. Each block is loaded in --dtype, moved to --device "
                    "and quantized with --quant. It announces JOINING while loading, ONLINE with its measured "
                    "throughput, and OFFLINE on Ctrl-C / SIGTERM. Petals 2.x clients can use it. "
                    f"Once ONLINE it prints a SERVING line for people and a '{READY_TAG} {{json}}' line for "
                    "programs (peer_id, addresses, blocks [start, end), dht_prefix, throughput, parameters, dtype, "
                    "quant_type, device). A MODEL that cannot be served: one line on stderr and exit code 2.",
        examples=[("distconf serve ./model --new-swarm --num-blocks 4 --dtype fp32", "first server of a new swarm"),
                  ("distconf serve ./model --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... --memory 8GiB",
                   "join a swarm, sized by the planner"),
                  ("distconf serve ./SmolLM2-135M-Instruct.Q4_1.gguf --new-swarm --dtype float32",
                   "a GGUF file, converted once into a cache, sized from available memory"),
                  ("distconf serve ./model --initial-peers ADDR --blocks 4:8 --quant int8", "blocks 4..7, int8"),
                  ("distconf serve ./model --new-swarm --public-ip 203.0.113.5 --port 31337",
                   "first server of a swarm across machines (port 31337 reachable at that address)"),
                  ("distconf serve ./model --initial-peers ADDR --identity-path server.key",
                   "join from anywhere (behind NAT: through a relay), same peer id on every start"),
                  ("distconf serve ./model --new-swarm --adapters ./my-lora support=./support-lora",
                   "serve two LoRA adapters beside the blocks (clients pick one: --adapter ./my-lora or support)")],
    )
    p.add_argument("model_dir", metavar="MODEL",
                   help="a model folder (safetensors; dht_prefix optional), a .gguf file or a folder holding one, "
                        "or a hub id in the local Hugging Face cache")
    p.add_argument("--dht-prefix", "--dht_prefix", dest="dht_prefix", default=None,
                   help="prefix of the block uids on the DHT (default: config.json's, else derived from the name)")
    p.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", default=None,
                   help="multiaddrs of swarm peers (default: $DISTCONF_INITIAL_PEERS)")
    p.add_argument("--new-swarm", action="store_true", help="start a new swarm (prints its address)")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--blocks", type=parse_blocks, default=None, metavar="A:B", help="serve blocks A..B-1")
    span.add_argument("--num-blocks", type=positive_int, default=None, help="serve N blocks, placed by the swarm")
    p.add_argument("--memory", default=None, help="memory for blocks and cache, e.g. 24GiB (sizes the server)")
    p.add_argument("--dtype", "--torch-dtype", "--torch_dtype", dest="dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"compute and cache dtype: {DTYPE_HELP}")
    p.add_argument("--device", default="auto", help=f"where blocks live and compute: {DEVICE_HELP}")
    p.add_argument("--quant", "--quant-type", "--quant_type", dest="quant", default=None, choices=QUANT_TYPES,
                   help="weight quantization of the served blocks (default: nf4 on CUDA as Petals, none on CPU); "
                        "announced as the record's quant_type")
    p.add_argument("--public-name", default=None, help="name shown in swarm listings")
    p.add_argument("--attn-cache-tokens", type=int, default=None,
                   help="cache tokens per block (default 16384 for grouped-query models, else 4096)")
    p.add_argument("--inference-max-length", type=positive_int, default=None,
                   help="longest inference session (default 8192 for grouped-query models, else 2048)")
    p.add_argument("--update-period", type=float, default=None, help="seconds between DHT refreshes")
    p.add_argument("--request-timeout", type=float, default=180.0, help="forward/backward time limit (s)")
    p.add_argument("--session-timeout", type=float, default=1800.0, help="inference session time limit (s)")
    p.add_argument("--step-timeout", type=float, default=300.0, help="wait for an inference step at most (s)")
    p.add_argument("--max-alloc-timeout", type=float, default=600.0, help="cap on a request's alloc_timeout (s)")
    p.add_argument("--max-forward-tokens", type=positive_int, default=None, metavar="T",
                   help="refuse a forward/backward request of more than T tokens (batch x length), before "
                        "decoding it (default: 8192 for grouped-query models, else 2048, as Petals' "
                        "max_batch_size; fewer, down to 128, if the throughput measured at start says they would "
                        "take more than half of --request-timeout; rpc_info reports it as max_forward_tokens)")
    p.add_argument("--max-peer-cache-share", type=_share, default=0.5, metavar="F",
                   help="the sessions of one peer may hold at most this fraction of the cache budget together; "
                        "its further sessions are refused (default 0.5: one peer never locks the others out; "
                        "1 turns the limit off)")
    p.add_argument("--repository", default=None, help="repository URL announced with the model")
    hub = add_hub_arguments(
        p, "MODEL may be a Hugging Face hub id: the server downloads its config and only the checkpoint shards "
           "holding its blocks (resumed when cut short), into the Hugging Face cache. HF_ENDPOINT points at another "
           "hub; HF_HUB_OFFLINE=1 reads the cache only.")
    hub.add_argument("--max-disk-space", "--max_disk_space", dest="max_disk_space", type=_memory, default=None,
                     metavar="SIZE", help="most the cache may hold, e.g. 20GiB: before each download the least "
                                          "recently used files of other models are deleted, never one in use")
    p.add_argument("--adapters", nargs="+", default=(), metavar="ADAPTER",
                   help="PEFT LoRA adapters served beside the blocks (Petals' --adapters): folders or hub ids, each "
                        "served under the name given (NAME=SOURCE to choose one); a client picks one per request "
                        "with --adapter NAME / active_adapter. Each is checked against the model before any block "
                        "is loaded (safetensors, LoRA only)")
    p.add_argument("--verify-weights", action="store_true",
                   help="hash the served blocks' weights after loading and again at shutdown, and log whether "
                        "they are unchanged (the load-time sha256 is also reported by rpc_info)")
    p.add_argument("--no-block-digests", dest="block_digests", action="store_false",
                   help="do not hash each served block's weights at load (by default rpc_info announces them as "
                        "block_sha256, which clients given a `distconf manifest` check; see docs/security.md)")
    p.add_argument("--balance-quality", type=float, default=0.75, metavar="Q",
                   help="move to other blocks when that makes the swarm more than 1/Q times faster (Petals' "
                        "--balance_quality; 0 never moves; a span given with --blocks never moves)")
    p.add_argument("--mean-balance-check-period", type=float, default=60.0, metavar="S",
                   help="mean seconds between balance checks (each wait is random in 0..2S, as Petals)")
    net = p.add_argument_group(
        "network (Petals' flags; see docs/networking.md)",
        "By default a server listens on 127.0.0.1 only, unless --initial-peers (or the flags below) point at a "
        "network: then on every interface, announcing this machine's addresses but never loopback. At start it "
        "asks peers to dial it back (Petals' reachability check); if they cannot (NAT, a firewall), it serves "
        "through a libp2p relay (an initial peer), announces using_relay and a throughput x 0.2, or, when no "
        "relay carries a session, exits with code 2 saying why.")
    net.add_argument("--host", default=None, metavar="IP",
                     help="one address to listen on (default: 127.0.0.1, or every interface when the swarm is on "
                          "a network)")
    net.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
    net.add_argument("--host-maddrs", "--host_maddrs", dest="host_maddrs", nargs="+", metavar="MULTIADDR",
                     default=None,
                     help="multiaddrs to listen on, e.g. /ip6/::/tcp/31337 (every IPv6 interface, port 31337)")
    net.add_argument("--announce-maddrs", "--announce_maddrs", dest="announce_maddrs", nargs="+",
                     metavar="MULTIADDR", default=None,
                     help="multiaddrs other peers dial, announced instead of this machine's addresses")
    net.add_argument("--public-ip", "--public_ip", dest="public_ip", default=None, metavar="IP",
                     help="this machine's public address (a port forwarded to it: give --port too); announced "
                          "as /ip4/IP/tcp/PORT")
    net.add_argument("--identity-path", "--identity_path", dest="identity_path", default=None, metavar="PATH",
                     help="private key file that keeps this server's peer id across restarts (made on first start, "
                          "mode 0600; a key others can read is refused)")
    net.add_argument("--no-relay", "--no_relay", dest="use_relay", action="store_false",
                     help="never use libp2p circuit relays (to be reached, or to reach others)")
    net.add_argument("--no-auto-relay", "--no_auto_relay", dest="use_auto_relay", action="store_false",
                     help="do not serve through a relay when peers cannot dial this server (it then exits)")
    net.add_argument("--skip-reachability-check", "--skip_reachability_check", dest="reachability_check",
                     action="store_false",
                     help="do not ask peers to dial this server back at start (assume it is reachable)")
    net.add_argument("--compression", default="NONE", type=str.upper, metavar="NAME",
                     help=f"hivemind's compression of the hidden states this server sends, asked of the clients and "
                          f"servers that send to it (Petals' --compression): {', '.join(COMPRESSION_NAMES)} (default "
                          "NONE: exact). FLOAT16 halves the bytes of fp32 hidden states, the 8-bit ones quarter them, "
                          "with small changes to the output")
    batching = p.add_argument_group("batching (inference steps of several sessions computed together)")
    batching.add_argument("--max-batch-size", "--max_batch_size", dest="max_batch_size", type=positive_int,
                          default=16, metavar="N", help="rows (sequences) of one batched step (default 16)")
    batching.add_argument("--max-batch-tokens", type=positive_int, default=None, metavar="T",
                          help="rows x padded new tokens of one batched step (default: 8192 for grouped-query "
                               "models, else 2048, as Petals' max_batch_size)")
    batching.add_argument("--prefill-chunk", type=positive_int, default=64, metavar="T",
                          help="compute longer steps (prefills) in chunks of T tokens per row, so other "
                               "sessions' decode steps run between chunks (default 64)")
    batching.add_argument("--max-batch-wait", type=seconds, default=0.04, metavar="S",
                          help="seconds a batch's first step may wait for the steps of steady sessions that are "
                               "due, so a group of sessions stays one batch from server to server (default 0.04; "
                               "0 never waits)")
    batching.add_argument("--no-batching", action="store_true",
                          help="compute each session's step alone (as --max-batch-size 1)")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace, peers: list[str]) -> Any:
    from distconf.server.block_server import ServeOptions

    return ServeOptions(
        model_dir=args.model_dir, dht_prefix=args.dht_prefix, initial_peers=peers, new_swarm=args.new_swarm,
        blocks=args.blocks, num_blocks=args.num_blocks, memory=args.memory, dtype=args.dtype, device=args.device,
        quant=args.quant, host=args.host, port=args.port,
        host_maddrs=tuple(args.host_maddrs) if args.host_maddrs else None,
        announce_maddrs=tuple(args.announce_maddrs) if args.announce_maddrs else None, public_ip=args.public_ip,
        identity_path=args.identity_path, use_relay=args.use_relay, use_auto_relay=args.use_auto_relay,
        reachability_check=args.reachability_check, compression=args.compression,
        public_name=args.public_name, update_period=args.update_period, request_timeout=args.request_timeout,
        session_timeout=args.session_timeout, step_timeout=args.step_timeout,
        max_alloc_timeout=args.max_alloc_timeout, inference_max_length=args.inference_max_length,
        attn_cache_tokens=args.attn_cache_tokens, repository=args.repository,
        verify_weights=args.verify_weights, block_digests=args.block_digests, balance_quality=args.balance_quality,
        mean_balance_check_period=args.mean_balance_check_period,
        max_batch_size=1 if args.no_batching else args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
        prefill_chunk=args.prefill_chunk, max_batch_wait=args.max_batch_wait,
        max_forward_tokens=args.max_forward_tokens, max_peer_cache_share=args.max_peer_cache_share,
        adapters=tuple(args.adapters), revision=args.revision, token=args.token, cache_dir=args.cache_dir,
        max_disk_space=args.max_disk_space)


def _open(args: argparse.Namespace) -> Any:
    """The checked model source and options (None after printing the one-line reason to stderr)."""
    from distconf.blocks.device import resolve_device
    from distconf.sources import ModelSourceError, open_source

    try:
        if args.memory is not None:
            from distconf.planning import parse_memory

            parse_memory(args.memory)
        resolve_device(args.device)
        from distconf.dht.addresses import plan_addresses

        plan_addresses(_options(args, []).network, args.initial_peers or [])  # clashing network flags
        from distconf.rpc.protocol import compression_code

        compression_code(args.compression)
        from distconf.server.adapters import parse_adapters

        parse_adapters(args.adapters)
        return open_source(args.model_dir, dht_prefix=args.dht_prefix, hub=_options(args, []).hub)
    except (ModelSourceError, ValueError) as exc:
        print(f"distconf serve: {exc}", file=sys.stderr)
        return None


def _startup_errors() -> tuple[type[BaseException], ...]:
    from distconf.blocks.lora import AdapterError
    from distconf.dht.identity import IdentityError
    from distconf.errors import SwarmJoinError, UnreachableServerError

    return SwarmJoinError, UnreachableServerError, IdentityError, AdapterError


STOP_TIMEOUT = 5.0
"""Seconds a stopping server gives each step of announcing OFFLINE (its DHT node then stops in at most ~7 s)."""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exit 0 after announcing OFFLINE, 2 on bad arguments."""
    from distconf.loader.mixins import default_initial_peers

    peers = list(args.initial_peers or ([] if args.new_swarm else default_initial_peers()))
    if not peers and not args.new_swarm:
        print("distconf serve: give --initial-peers (or set DISTCONF_INITIAL_PEERS), or --new-swarm", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from distconf.server.block_server import BlockServer

    startup_errors = _startup_errors()  # what joining and loading may end with: one line, exit 2
    source = _open(args)
    if source is None:
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = BlockServer(_options(args, peers), stop_event=stop, source=source)
    try:
        try:
            server.join()
        except startup_errors as exc:
            print(f"distconf serve: {exc}", file=sys.stderr)
            return 2
        if args.new_swarm:  # printed before loading: other servers and clients may join at once
            print(f"new swarm: --initial-peers {' '.join(server.maddrs)}", flush=True)
        try:
            server.serve()
        except startup_errors as exc:  # an adapter that does not fit the blocks
            print(f"distconf serve: {exc}", file=sys.stderr)
            return 2
        print(f"SERVING blocks {server.start_block}:{server.end_block} of {server.config.dht_prefix} as peer "
              f"{server.peer_id} (throughput {server.throughput:.1f})", flush=True)
        print(ready_line(server), flush=True)
        while not stop.wait(1.0):
            pass
        logger.info("stopping: announcing OFFLINE")
        return 0
    except InterruptedError as exc:  # a signal while loading
        logger.info("%s: announcing OFFLINE", exc)
        return 0
    finally:
        server.stop(timeout=STOP_TIMEOUT)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # The interpreter's last garbage collections walk every object torch and transformers
        # made (seconds on a busy machine) though nothing is left to free: skip them.
        gc.freeze()


def main(argv: list[str] | None = None) -> int:
    """``python -m distconf.cli.cmd_serve ...`` (the same as ``distconf serve ...``)."""
    if argv is None:  # the process's own command line: choose its threads before torch is imported
        from distconf.threads import apply_thread_policy

        apply_thread_policy("server")
    parser = argparse.ArgumentParser(prog="distconf")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
