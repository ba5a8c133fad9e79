"""One demo server process: join the DHT, plan, choose blocks, load real weights, announce.

It talks to the orchestrator one line at a time: it prints ``READY <peer_id>``, waits for
``GO``, prints ``SERVING <start> <end> <throughput> <params> <checksum>``, and waits for
``STOP`` (or end of input, or ``--lifetime`` seconds) before announcing OFFLINE.
"""

from __future__ import annotations

import argparse
import logging
import queue
import sys
import threading
import time
from typing import Any

from distconf.tools.demo.model import DEMO_DTYPE

__all__ = ["serve", "DEMO_UPDATE_PERIOD"]

logger = logging.getLogger(__name__)

DEMO_UPDATE_PERIOD = 2.0
"""Seconds between a demo server's re-announcements."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distconf.tools.demo serve")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--family", required=True)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--memory", required=True, help="memory budget in bytes")
    p.add_argument("--name", default="server")
    p.add_argument("--lifetime", type=float, default=120.0, help="exit after this many seconds regardless")
    return p


def serve(argv: list[str] | None = None) -> int:
    """Entry point of one demo server process; exits 0 after announcing OFFLINE."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{args.name}] %(levelname)s %(name)s: %(message)s")
    deadline = time.monotonic() + args.lifetime
    for peer in args.initial_peers:
        if not peer.startswith("/ip4/127.0.0.1/"):
            raise SystemExit(f"demo servers dial loopback only, got {peer}")

    import torch

    from distconf.dht import start_local_dht
    from distconf.family import load_family

    torch.set_num_threads(1)
    config = load_family(args.family).from_pretrained(args.model_dir)
    dht = start_local_dht(args.initial_peers, num_workers=config.num_hidden_layers)
    # read stdin only now: the DHT is a forked process whose bootstrap closes stdin, which
    # deadlocks if another thread is blocked reading it at fork time
    lines = _stdin_lines()
    announcer = None
    try:
        _say(f"READY {dht.peer_id.to_base58()}")
        if _wait_for(lines, "GO", deadline) != "GO":
            return 0
        announcer = _announce_joining(args, config, dht)
        if announcer is None:
            return 1
        _go_online(args, config, announcer)
        _wait_for(lines, "STOP", deadline)
        return 0
    finally:
        if announcer is not None:
            announcer.stop(offline=True, timeout=5)
        dht.shutdown()


def _announce_joining(args: argparse.Namespace, config: Any, dht: Any) -> Any:
    """Plan for the memory budget, choose a span seeing the swarm so far, announce it JOINING."""
    from distconf.dht import BlockAnnouncer, ServerInfo, ServerState, find_block_servers
    from distconf.planning import choose_blocks, plan_server

    plan = plan_server(config, int(args.memory), DEMO_DTYPE)
    if plan.num_blocks < 1:
        logger.error("not one block fits in %s bytes", args.memory)
        return None
    swarm = find_block_servers(dht, config, timeout=10)
    start, end = choose_blocks(config, plan.num_blocks, swarm)
    logger.info("plan: %d blocks (%d B weights + %d B cache each); swarm throughputs %s -> blocks %d..%d",
                plan.num_blocks, plan.block_bytes, plan.cache_bytes_per_block,
                [round(t, 1) for t in swarm.throughputs()], start, end - 1)
    info = ServerInfo(state=ServerState.JOINING, throughput=0.0, public_name=args.name, version="distconf-demo",
                      torch_dtype=DEMO_DTYPE, cache_tokens_left=plan.attn_cache_tokens)
    announcer = BlockAnnouncer(dht, config, start, end, info, update_period=DEMO_UPDATE_PERIOD)
    announcer.start()
    return announcer


def _go_online(args: argparse.Namespace, config: Any, announcer: Any) -> None:
    """Load the span's real weights, measure a throughput, announce ONLINE and tell the orchestrator."""
    import torch

    from distconf.blocks.weights import load_block
    from distconf.dht import ServerState

    start, end = announcer.start_block, announcer.end_block
    dtype = getattr(torch, DEMO_DTYPE)
    blocks = [load_block(args.model_dir, config, i, dtype=dtype) for i in range(start, end)]
    params = sum(p.numel() for b in blocks for p in b.parameters())
    checksum = float(sum(p.detach().double().abs().sum() for b in blocks for p in b.parameters()))
    throughput = _measure(blocks, config.hidden_size, dtype)
    announcer.announce(announcer.info.model_copy(update={
        "state": ServerState.ONLINE, "throughput": throughput, "inference_rps": throughput,
        "forward_rps": throughput}))
    _say(f"SERVING {start} {end} {throughput:.2f} {params} {checksum:.4f}")


def _measure(blocks: list[Any], hidden: int, dtype: Any, steps: int = 5) -> float:
    """Requests/s of one token through all ``blocks`` (median of a few runs)."""
    import torch

    x = torch.randn(1, 1, hidden, dtype=dtype, generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            t0 = time.perf_counter()
            h = x
            for block in blocks:
                h, _ = block(h)
            times.append(time.perf_counter() - t0)
    if not torch.isfinite(h).all():
        raise RuntimeError("the loaded blocks produced non-finite outputs")
    return 1.0 / max(sorted(times)[len(times) // 2], 1e-6)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _stdin_lines() -> queue.Queue[str | None]:
    q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for raw in sys.stdin:
            q.put(raw.strip())
        q.put(None)  # end of input: the orchestrator is gone

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for(lines: queue.Queue[str | None], word: str, deadline: float) -> str | None:
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None or line == word:
            return line
    return None
