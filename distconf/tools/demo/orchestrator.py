"""The demo's orchestrator: tiny model, bootstrap DHT, server processes, then a client that routes."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distconf.tools.demo.model import (
    BLOCKS_PER_SERVER,
    DEMO_DTYPE,
    demo_family,
    demo_prefix,
    make_tiny_checkpoint,
    memory_for,
)
from distconf.tools.demo.process import ServerProcess

__all__ = ["run_swarm_demo"]

Out = Callable[[str], None]


@dataclass
class _Demo:
    """What the servers and the client of one demo run share."""

    family: str
    prefix: str
    model_dir: Path
    memory: int
    peers: list[str]
    t0: float
    deadline: float
    out: Out

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.t0:.1f} s"


def run_swarm_demo(
    num_servers: int = 3,
    *,
    family: str | None = None,
    workdir: str | Path | None = None,
    timeout: float = 180.0,
    out: Out = print,
) -> int:
    """Run the local swarm demo; return 0 if a client found a full route and all stopped cleanly.

    :param num_servers: server processes to start (each takes 3 of the 8 blocks).
    :param family: family of the tiny model (default: `demo_family`).
    :param workdir: where to write the tiny checkpoint and server logs (default: a temp dir).
    :param timeout: hard bound on the whole demo, in seconds.
    :param out: where progress lines go (``print`` by default).
    """
    from distconf.dht import start_local_dht, visible_maddrs

    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="distconf-swarm-"))
        workdir = Path(workdir)
        family = demo_family(family)
        model_dir = workdir / demo_prefix(family)
        config = make_tiny_checkpoint(model_dir, family)
        out(f"tiny model: {type(config).__name__}, {config.num_hidden_layers} blocks, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, KV groups {config.num_key_value_groups}, "
            f"dht_prefix {config.dht_prefix!r}, weights in {model_dir}")
        boot = start_local_dht()
        stack.callback(boot.shutdown)
        demo = _Demo(family, demo_prefix(family), model_dir, memory_for(config, BLOCKS_PER_SERVER, DEMO_DTYPE),
                      visible_maddrs(boot), t0, t0 + timeout, out)
        out(f"bootstrap DHT node: {demo.peers[0]}")
        log_path = workdir / "servers.log"
        log = stack.enter_context(log_path.open("w"))
        servers: list[ServerProcess] = []
        ok = False
        try:
            _start_servers(demo, num_servers, log, servers)
            ok = _client_routes(demo, servers)
        except (RuntimeError, TimeoutError, KeyError) as exc:
            out(f"swarm demo failed: {exc!r}; server log: {log_path}")
            log.flush()
            out("\n".join(log_path.read_text(errors="replace").splitlines()[-20:]))
        finally:
            codes = _stop_all(servers)
        clean = all(c == 0 for c in codes)
        out(f"stopped {len(codes)} servers ({'cleanly' if clean else f'exit codes {codes}'}) and the DHT "
            f"in {demo.elapsed()} total")
        return 0 if ok and clean else 1


def _start_servers(demo: _Demo, num_servers: int, log: Any, servers: list[ServerProcess]) -> None:
    """Start the processes together, then let them choose their blocks one after another."""
    for i in range(num_servers):
        lifetime = max(10.0, demo.deadline - time.monotonic())
        servers.append(ServerProcess(f"server-{i + 1}", [
            "--model-dir", str(demo.model_dir), "--family", demo.family, "--initial-peers", *demo.peers,
            "--memory", str(demo.memory), "--lifetime", str(lifetime)], log))
    demo.out(f"started {num_servers} server processes, {demo.memory / 2**20:.1f} MiB budget each "
             f"(planner: {BLOCKS_PER_SERVER} blocks)")
    for server in servers:
        server.expect("READY", demo.deadline)
    demo.out(f"  all servers joined the DHT ({demo.elapsed()})")
    for server in servers:  # one at a time: each sees its predecessors when it places itself
        server.send("GO")
        start, end, rps, params, checksum = server.expect("SERVING", demo.deadline)
        demo.out(f"  {server.name}: chose blocks {start}..{int(end) - 1}, loaded {int(params):,} real parameters "
                 f"(checksum {float(checksum):.2f}), measured {float(rps):.0f} rps, announced ONLINE")


def _client_routes(demo: _Demo, servers: list[ServerProcess]) -> bool:
    """A client that knows only the prefix finds a full route; after one server leaves, it sees the gap."""
    from distconf.dht import find_models, find_servers_by_prefix, start_local_dht
    from distconf.dht.report import format_coverage, format_route

    client = start_local_dht(demo.peers, client_mode=True)
    try:
        num_blocks = find_models(client, timeout=10)[demo.prefix].num_blocks
        demo.out(f"client: knows only {demo.prefix!r}; the swarm lists it with {num_blocks} blocks")
        state = find_servers_by_prefix(client, demo.prefix, num_blocks, timeout=10)
        demo.out(format_coverage(state))
        ok, text = format_route(state)
        demo.out(text)
        if ok and len(servers) >= 2:
            leaving = servers[1]
            code = leaving.stop(time.monotonic() + 15)
            after = find_servers_by_prefix(client, demo.prefix, num_blocks, timeout=10)
            still, text_after = format_route(after)
            demo.out(f"{leaving.name} leaves (exit {code}, announced OFFLINE): {text_after}")
            ok = ok and code == 0 and (still or "covers block" in text_after)
        demo.out(f"  ({demo.elapsed()})")
        return ok
    finally:
        client.shutdown()


def _stop_all(servers: list[ServerProcess]) -> list[int]:
    """Stop every server at once (they announce OFFLINE and shut down in parallel); return exit codes."""
    stop_deadline = time.monotonic() + 15
    for server in servers:
        server.send("STOP")
    return [server.stop(stop_deadline) for server in servers]
