"""One demo server process: ``distconf serve``'s `BlockServer`, driven one step at a time by the orchestrator.

The server is the real one (planner, placement rule, weight loading, throughput, Petals
2.x handlers, announcements); this module only adds the orchestrator's line protocol on
stdin/stdout: it prints ``JOINED <peer_id>`` once its DHT node has joined, waits for
``GO`` (so that servers place themselves one after another, each seeing its
predecessors), prints ``distconf serve``'s ready line (``DISTCONF_READY {json}``) once
ONLINE, and waits for ``STOP`` (or end of input, SIGTERM, or ``--lifetime`` seconds)
before announcing OFFLINE.
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["serve", "DEMO_UPDATE_PERIOD"]

logger = logging.getLogger(__name__)

DEMO_UPDATE_PERIOD = 2.0
"""Seconds between a demo server's re-announcements."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distconf.tools.demo serve")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--memory", type=int, required=True, help="memory budget in bytes (the planner sizes the server)")
    p.add_argument("--name", default="server")
    p.add_argument("--lifetime", type=float, default=300.0, help="exit after this many seconds regardless")
    return p


def _on_sigterm(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)  # unwinds through `serve`'s finally: OFFLINE announcement, DHT shutdown


def serve(argv: list[str] | None = None) -> int:
    """Entry point of one demo server process; exits 0 after announcing OFFLINE."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{args.name}] %(levelname)s %(name)s: %(message)s")
    deadline = time.monotonic() + args.lifetime
    for peer in args.initial_peers:
        if not peer.startswith("/ip4/127.0.0.1/"):
            raise SystemExit(f"demo servers dial loopback only, got {peer}")
    signal.signal(signal.SIGTERM, _on_sigterm)

    import torch

    from distconf.server import BlockServer, ServeOptions
    from distconf.server.ready import ready_line

    torch.set_num_threads(1)
    server = BlockServer(ServeOptions(
        model_dir=args.model_dir, initial_peers=list(args.initial_peers), memory=args.memory, dtype="fp32",
        host="127.0.0.1", public_name=args.name, update_period=DEMO_UPDATE_PERIOD, compute_threads=1,
        verify_weights=True,
        # the demo shows a planned layout with a spare for its failover: a balance check would move the spare
        balance_quality=0))
    try:
        server.join()
        # read stdin only now: the DHT is a forked process whose bootstrap closes stdin, which
        # deadlocks if another thread is blocked reading it at fork time
        lines = _stdin_lines()
        _say(f"JOINED {server.peer_id}")
        if _wait_for(lines, "GO", deadline) != "GO":
            return 0
        server.serve()
        _say(ready_line(server))
        _wait_for(lines, "STOP", deadline)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the OFFLINE announcement finish
        server.stop()


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
