"""A local swarm on 127.0.0.1: real DHT, server processes loading real weights, a client.

`run_swarm_demo` (called by ``distconf demo``) does, within a bounded time:

1. writes a tiny checkpoint of a family (its family file's ``tiny_config``, with 8
   layers; random weights, real safetensors) and saves its distributed config with a
   ``dht_prefix`` next to it;
2. starts a bootstrap DHT node on 127.0.0.1;
3. starts several server *processes* (``python -m distconf.tools.swarm_demo serve ...``).
   Each joins the DHT, reads the swarm, sizes itself with `plan_server` for its
   memory budget, picks its span with `choose_blocks` (weakest window), announces
   JOINING, loads the real weights of its blocks with `distconf.weights.load_block`,
   runs them once to measure a throughput, and announces ONLINE;
4. a client that knows only the DHT prefix reads the block count from the model
   listing, finds the servers in one batched request, prints the coverage and route;
   then one server leaves (announcing OFFLINE) and the client reports the gap;
5. stops every server (they announce OFFLINE) and the DHT nodes.

Servers are started together (imports overlap) but choose their blocks one after
another, so each sees its predecessors: that is what the placement rule needs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["DEMO_LAYERS", "demo_family", "make_tiny_checkpoint", "run_swarm_demo", "serve"]

logger = logging.getLogger(__name__)

DEMO_LAYERS = 8
"""Blocks of the demo model (the family's tiny config, with this many layers)."""
BLOCKS_PER_SERVER = 3
DEMO_DTYPE = "float32"
DEMO_UPDATE_PERIOD = 2.0


# ------------------------------------------------------------------------------ model


def demo_family(family: str | None = None) -> str:
    """The family the demo serves: ``family``, else the first built-in one with a ``tiny_config``."""
    from distconf.family import list_families, load_family

    if family is not None:
        return family
    for name in list_families():
        if load_family(name).family_spec.tiny_config:
            return name
    raise LookupError("no family file has a tiny_config to build a demo model from")


def demo_prefix(family: str) -> str:
    """DHT prefix of the demo model of ``family`` (no '.', no space)."""
    return f"distconf-demo-tiny-{family}".replace("_", "-")


def make_tiny_checkpoint(model_dir: str | Path, family: str, *, seed: int = 0) -> Any:
    """Write a tiny random model of ``family`` (safetensors) to ``model_dir``; return its config.

    The model is the family file's ``tiny_config`` (first variant) with `DEMO_LAYERS`
    layers. The saved ``config.json`` is the distributed config's, so it carries
    ``dht_prefix``.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from distconf import load_family
    from distconf.tools.checker import tiny_variants

    cls = load_family(family)
    _, values = tiny_variants(dict(cls.family_spec.tiny_config))[0]
    base_cls = next(k for k in cls.__mro__[1:] if k.__module__.startswith("transformers."))
    reference = base_cls(**values)
    reference.num_hidden_layers = DEMO_LAYERS
    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(reference)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(model_dir, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    config = cls.from_pretrained(str(model_dir), dht_prefix=demo_prefix(family))
    config.save_pretrained(model_dir)
    return config


def _memory_for(config: Any, num_blocks: int, dtype: str) -> int:
    """A memory budget for which `plan_server` gives exactly ``num_blocks`` blocks."""
    from distconf.planning import plan_server

    probe = plan_server(config, 2**40, dtype)
    per_block = probe.block_bytes + probe.cache_bytes_per_block
    return int(probe.autograd_reserve_bytes + (num_blocks + 0.5) * per_block)


# ------------------------------------------------------------------------------ server process


def serve(argv: list[str] | None = None) -> int:
    """Entry point of one demo server process (protocol on stdin/stdout, one line each).

    Prints ``READY <peer_id>``; waits for ``GO``; then plans, places, loads, announces and
    prints ``SERVING <start> <end> <throughput> <params> <checksum>``; waits for ``STOP``
    (or end of input, or ``--lifetime`` seconds) and exits 0 after announcing OFFLINE.
    """
    p = argparse.ArgumentParser(prog="python -m distconf.tools.swarm_demo serve")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--family", required=True)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--memory", required=True, help="memory budget in bytes (or 24GiB, ...)")
    p.add_argument("--name", default="server")
    p.add_argument("--lifetime", type=float, default=120.0, help="exit after this many seconds regardless")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{args.name}] %(levelname)s %(name)s: %(message)s")
    deadline = time.monotonic() + args.lifetime

    import torch

    from distconf import load_family
    from distconf.blocks.weights import load_block
    from distconf.dht import BlockAnnouncer, ServerInfo, ServerState, find_block_servers, start_local_dht
    from distconf.planning import choose_blocks, plan_server

    for peer in args.initial_peers:
        if not peer.startswith("/ip4/127.0.0.1/"):
            raise SystemExit(f"demo servers dial loopback only, got {peer}")
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
        plan = plan_server(config, int(args.memory), DEMO_DTYPE)
        if plan.num_blocks < 1:
            logger.error("not one block fits in %s bytes", args.memory)
            return 1
        swarm = find_block_servers(dht, config, timeout=10)
        start, end = choose_blocks(config, plan.num_blocks, swarm)
        logger.info("plan: %d blocks (%d B weights + %d B cache each); swarm throughputs %s -> blocks %d..%d",
                    plan.num_blocks, plan.block_bytes, plan.cache_bytes_per_block,
                    [round(t, 1) for t in swarm.throughputs()], start, end - 1)
        info = ServerInfo(state=ServerState.JOINING, throughput=0.0, public_name=args.name, version="distconf-demo",
                          torch_dtype=DEMO_DTYPE, cache_tokens_left=plan.attn_cache_tokens)
        announcer = BlockAnnouncer(dht, config, start, end, info, update_period=DEMO_UPDATE_PERIOD)
        announcer.start()

        dtype = getattr(torch, DEMO_DTYPE)
        blocks = [load_block(args.model_dir, config, i, dtype=dtype) for i in range(start, end)]
        params = sum(p.numel() for b in blocks for p in b.parameters())
        checksum = float(sum(p.double().abs().sum() for b in blocks for p in b.parameters()))
        throughput = _measure(blocks, config.hidden_size, dtype)
        announcer.announce(info.model_copy(update={"state": ServerState.ONLINE, "throughput": throughput,
                                                   "inference_rps": throughput, "forward_rps": throughput}))
        _say(f"SERVING {start} {end} {throughput:.2f} {params} {checksum:.4f}")
        _wait_for(lines, "STOP", deadline)
        return 0
    finally:
        if announcer is not None:
            announcer.stop(offline=True, timeout=5)
        dht.shutdown()


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


# ------------------------------------------------------------------------------ orchestrator


class _Server:
    """One server subprocess with a line reader (bounded waits only)."""

    def __init__(self, name: str, cmd: list[str], log: IO[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.strip())
        self.lines.put(None)

    def expect(self, word: str, deadline: float) -> list[str]:
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited (code {self.proc.poll()}) before saying {word}")
            if line.startswith(word):
                return line.split()[1:]
        raise TimeoutError(f"{self.name} did not say {word} in time")

    def send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def stop(self, deadline: float) -> int:
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.send("STOP")
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(timeout=3)


def run_swarm_demo(
    num_servers: int = 3,
    *,
    family: str | None = None,
    workdir: str | Path | None = None,
    timeout: float = 90.0,
    out: Callable[[str], None] = print,
) -> int:
    """Run the local swarm demo; return 0 if a client found a full route and all stopped cleanly.

    :param num_servers: server processes to start (each takes 3 of the 8 blocks).
    :param family: family of the tiny model (default: `demo_family`).
    :param workdir: where to write the tiny checkpoint and server logs (default: a temp dir).
    :param timeout: hard bound on the whole demo, in seconds.
    :param out: where progress lines go (``print`` by default).
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="distconf-swarm-"))
        workdir = Path(workdir)
        family = demo_family(family)
        prefix = demo_prefix(family)
        model_dir = workdir / prefix
        config = make_tiny_checkpoint(model_dir, family)
        memory = _memory_for(config, BLOCKS_PER_SERVER, DEMO_DTYPE)
        out(f"tiny model: {type(config).__name__}, {config.num_hidden_layers} blocks, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, KV groups {config.num_key_value_groups}, "
            f"dht_prefix {config.dht_prefix!r}, weights in {model_dir}")

        from distconf.dht import find_models, find_servers_by_prefix, start_local_dht, visible_maddrs
        from distconf.dht.report import format_coverage, format_route

        boot = start_local_dht()
        stack.callback(boot.shutdown)
        peers = visible_maddrs(boot)
        out(f"bootstrap DHT node: {peers[0]}")

        servers: list[_Server] = []
        log_path = workdir / "servers.log"
        log = stack.enter_context(log_path.open("w"))

        def stop_all() -> list[int]:
            stop_deadline = time.monotonic() + 15
            for s in servers:  # all at once: they announce OFFLINE and shut down in parallel
                s.send("STOP")
            return [s.stop(stop_deadline) for s in servers]

        codes: list[int] | None = None
        ok = False
        try:
            for i in range(num_servers):
                name = f"server-{i + 1}"
                cmd = [sys.executable, "-m", "distconf.tools.swarm_demo", "serve", "--model-dir", str(model_dir),
                       "--family", family,
                       "--initial-peers", *peers, "--memory", str(memory), "--name", name,
                       "--lifetime", str(max(10.0, deadline - time.monotonic()))]
                servers.append(_Server(name, cmd, log))
            out(f"started {num_servers} server processes, {memory / 2**20:.1f} MiB budget each "
                f"(planner: {BLOCKS_PER_SERVER} blocks)")
            for server in servers:
                server.expect("READY", deadline)
            out(f"  all servers joined the DHT ({time.monotonic() - t0:.1f} s)")
            for server in servers:
                server.send("GO")
                start, end, rps, params, checksum = server.expect("SERVING", deadline)
                out(f"  {server.name}: chose blocks {start}..{int(end) - 1}, loaded {int(params):,} real parameters "
                    f"(checksum {float(checksum):.2f}), measured {float(rps):.0f} rps, announced ONLINE")

            client = start_local_dht(peers, client_mode=True)
            try:
                models = find_models(client, timeout=10)
                num_blocks = models[prefix].num_blocks
                out(f"client: knows only {prefix!r}; the swarm lists it with {num_blocks} blocks")
                state = find_servers_by_prefix(client, prefix, num_blocks, timeout=10)
                out(format_coverage(state))
                ok, text = format_route(state)
                out(text)
                if ok and len(servers) >= 2:
                    leaving = servers[1]
                    code = leaving.stop(time.monotonic() + 15)
                    after = find_servers_by_prefix(client, prefix, num_blocks, timeout=10)
                    still, text_after = format_route(after)
                    out(f"{leaving.name} leaves (exit {code}, announced OFFLINE): {text_after}")
                    ok = ok and code == 0 and (still or "covers block" in text_after)
                out(f"  ({time.monotonic() - t0:.1f} s)")
            finally:
                client.shutdown()
        except (RuntimeError, TimeoutError, KeyError) as exc:
            out(f"swarm demo failed: {exc!r}; server log: {log_path}")
            log.flush()
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            out("\n".join(tail))
        finally:
            codes = stop_all()
        clean = all(c == 0 for c in codes)
        out(f"stopped {len(codes)} servers ({'cleanly' if clean else f'exit codes {codes}'}) and the DHT "
            f"in {time.monotonic() - t0:.1f} s total")
        return 0 if ok and clean else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m distconf.tools.swarm_demo [serve ...]``: run the demo, or one server of it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(prog="python -m distconf.tools.swarm_demo")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--family", default=None, help="family of the tiny model (default: first with a tiny_config)")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    return run_swarm_demo(args.servers, family=args.family, workdir=args.workdir, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
