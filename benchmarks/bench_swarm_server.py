"""Block servers on loopback: per-hop overhead, server-to-server push, server memory.

For each model (a family's tiny config, and the same family scaled to hidden size 1024 and
8 layers; the family is ``--family``, by default the demo's), two ``distconf serve``
processes on 127.0.0.1 hold half of the blocks each (float32). A client made of the
`distconf.rpc` helpers runs inference sessions of batch 1, one token per step, and
measures (medians over the steps, all in one run):

* local: the same blocks and KV-cache code in this process (no network);
* remote: client -> server A -> client -> server B -> client per token; per-hop overhead
  = (remote - local) / 2;
* push: client -> A, A pushes its outputs to B (``next_servers``), B replies to the client;
* server peak RSS (VmHWM of each server process) against its blocks' bytes + its cache budget,
  and against a bare process that only imported the server stack.

Every process uses one compute thread (``OMP_NUM_THREADS=1``). Time per generated token
through the full client (embeddings, LM head, sampling) is measured by the client benchmark.

    .venv/bin/python benchmarks/bench_swarm_server.py [--family F] [--steps 32] [--rounds 3] [--json]
        [--only tiny|small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from distconf.tools.serving import ServerProcess, serve_command, stop_all, wait_all_ready

REPO = Path(__file__).resolve().parents[1]
CACHE_TOKENS = 1024
MODELS = {
    "tiny": {},
    "small": {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
              "head_dim": 64, "num_hidden_layers": 8, "vocab_size": 32000},
}


def make_model(directory: Path, family: str, overrides: dict[str, Any]) -> Any:
    """A model of ``family`` (its tiny config + ``overrides``), random weights (safetensors), distributed config."""
    from transformers import AutoModelForCausalLM

    from distconf.loader import load_family
    from distconf.tools.checker import tiny_variants

    cls = load_family(family)
    _, values = tiny_variants(cls.family_spec.tiny_config)[0]
    values = {**values, "num_hidden_layers": 4, **overrides}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cls.hf_config_class(**values)).save_pretrained(directory)
    config = cls.from_pretrained(str(directory), dht_prefix=f"bench-{directory.name}")
    config.save_pretrained(directory)
    return config


def start_server(model_dir: Path, peers: list[str], blocks: str, log: Path) -> ServerProcess:
    """A ``distconf serve`` process (one compute thread) serving ``blocks`` of ``model_dir``."""
    cmd = serve_command(model_dir, "--initial-peers", *peers, "--blocks", blocks, "--dtype", "fp32",
                        "--attn-cache-tokens", str(CACHE_TOKENS))
    return ServerProcess(cmd, log, name=log.stem, env={"OMP_NUM_THREADS": "1"})


def peak_rss(server: ServerProcess) -> int:
    """VmHWM of the server process, in bytes (0 where /proc has no such line)."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def bare_rss() -> int:
    """Peak RSS of a process that imported the server stack and did nothing else."""
    code = ("import torch, transformers, hivemind, distconf.server.block_server, distconf.server.handler;"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.strip()) * 1024


def local_blocks(model_dir: Path, config: Any) -> list[Any]:
    """All blocks of the model, loaded in this process (as `ServedBlock` objects)."""
    from distconf.blocks.kvcache import kv_geometry
    from distconf.blocks.sizing import kv_cache_bytes_per_token
    from distconf.server.compute import ServedBlock
    from distconf.server.loading import load_blocks

    modules = load_blocks(model_dir, config, 0, config.num_hidden_layers, torch.float32)
    return [ServedBlock(f"b.{i}", i, m, torch.float32, kv_geometry(config), kv_cache_bytes_per_token(config))
            for i, m in enumerate(modules)]


def local_step_times(blocks: list[Any], hidden_size: int, steps: int) -> list[float]:
    """Per-token time of one session through all blocks in this process (same cache code as the server)."""
    from distconf.server.session_cache import SessionCache

    cache = SessionCache(blocks, 1, steps + 8)
    cache.allocate()
    x = torch.randn(1, steps + 1, hidden_size, generator=torch.Generator().manual_seed(0))
    times = []
    cache.step(x[:, :1], [None] * len(blocks), None)
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        cache.step(x[:, t:t + 1], [None] * len(blocks), None)
        times.append(time.perf_counter() - t0)
    return times


async def remote_step_times(p2p: Any, config: Any, a: str, b: str, steps: int, push: bool) -> list[float]:
    """Per-token time through servers A (first half) and B (second half)."""
    from distconf.rpc import InferenceStream, chain_uid, deserialize_tensors, inference_step_request

    half = config.num_hidden_layers // 2
    uid_a, uid_b = chain_uid(config.dht_prefix, 0, half), chain_uid(config.dht_prefix, half,
                                                                    config.num_hidden_layers)
    sa, sb = await InferenceStream.open(p2p, a, timeout=10), await InferenceStream.open(p2p, b, timeout=10)
    sid_b = str(uuid.uuid4())
    x = torch.randn(1, steps + 1, config.hidden_size, generator=torch.Generator().manual_seed(0))
    opening = {"max_length": steps + 8}
    h = deserialize_tensors((await sa.step(inference_step_request(uid_a, x[:, :1], metadata={
        **opening, "session_id": str(uuid.uuid4()), "step_id": "0"}), timeout=30)).tensors)[0]
    await sb.step(inference_step_request(uid_b, h, metadata={**opening, "session_id": sid_b, "step_id": "0"}),
                  timeout=30)
    times = []
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        meta: dict[str, Any] = {"step_id": str(t)}
        if push:
            meta["next_servers"] = [(b, sid_b, half, config.num_hidden_layers)]
            await sa.send(inference_step_request(uid_a, x[:, t:t + 1], metadata=meta))
            await sb.receive(timeout=30)  # B's output, computed from A's push
            times.append(time.perf_counter() - t0)
            await sa.receive(timeout=30)  # A's own reply (not on the critical path)
        else:
            h = deserialize_tensors((await sa.step(inference_step_request(uid_a, x[:, t:t + 1], metadata=meta),
                                                   timeout=30)).tensors)[0]
            await sb.step(inference_step_request(uid_b, h, metadata=meta), timeout=30)
            times.append(time.perf_counter() - t0)
    await sa.close(timeout=5)
    await sb.close(timeout=5)
    return times


def bench_model(name: str, family: str, overrides: dict[str, Any], steps: int, rounds: int, workdir: Path
                ) -> dict[str, Any]:
    """All figures for one model."""
    from distconf.blocks.sizing import block_size_bytes, kv_cache_bytes_per_token
    from distconf.dht import start_local_dht, visible_maddrs
    from distconf.rpc import RpcLoop

    model_dir = workdir / name
    config = make_model(model_dir, family, overrides)
    half = config.num_hidden_layers // 2
    blocks = local_blocks(model_dir, config)
    boot = start_local_dht()
    servers: list[ServerProcess] = []
    loop = None
    local: list[float] = []
    remote: list[float] = []
    pushed: list[float] = []
    try:
        peers = visible_maddrs(boot)
        servers = [start_server(model_dir, peers, span, workdir / f"{name}-{i}.log")
                   for i, span in enumerate((f"0:{half}", f"{half}:{config.num_hidden_layers}"))]
        wait_all_ready(servers, time.monotonic() + 180.0)
        loop = RpcLoop(boot)
        a, b = servers[0].peer_id, servers[1].peer_id
        loop.run(remote_step_times(loop.p2p, config, a, b, 8, False), timeout=120)  # warm-up
        local_step_times(blocks, config.hidden_size, 8)
        for _ in range(rounds):  # interleaved, so that load changes on the machine hit all three alike
            local += local_step_times(blocks, config.hidden_size, steps)
            remote += loop.run(remote_step_times(loop.p2p, config, a, b, steps, False), timeout=600)
            pushed += loop.run(remote_step_times(loop.p2p, config, a, b, steps, True), timeout=600)
        rss = [peak_rss(s) for s in servers]
    finally:
        if loop is not None:
            loop.shutdown()
        stop_all(servers)
        boot.shutdown()
    blocks_bytes = sum(block_size_bytes(config, torch.float32, layer_idx=i) for i in range(half))
    cache_bytes = kv_cache_bytes_per_token(config, torch.float32) * CACHE_TOKENS * half
    med = statistics.median
    return {
        "model": name, "family": family, "params_mb": sum(block_size_bytes(config, torch.float32, layer_idx=i)
                                                         for i in range(config.num_hidden_layers)) / 2**20,
        "hidden_size": config.hidden_size, "layers": config.num_hidden_layers, "steps": steps * rounds,
        "local_ms": med(local) * 1e3, "remote_ms": med(remote) * 1e3, "push_ms": med(pushed) * 1e3,
        "per_hop_overhead_ms": (med(remote) - med(local)) / 2 * 1e3,
        "remote_over_local": med(remote) / med(local),
        "tokens_per_s_no_push": 1 / med(remote), "tokens_per_s_push": 1 / med(pushed),
        "push_speedup": med(remote) / med(pushed),
        "server_peak_rss_mb": [r / 2**20 for r in rss],
        "blocks_plus_cache_mb": (blocks_bytes + cache_bytes) / 2**20,
    }


def main() -> int:
    """Run the benchmark and print its figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=32, help="timed tokens per session (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of local/remote/push (default 3)")
    p.add_argument("--only", choices=sorted(MODELS), default=None)
    p.add_argument("--family", default=None, help="family of the models (default: the demo's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    from distconf.tools.demo import demo_family

    family = demo_family(args.family)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for name, overrides in MODELS.items():
            if args.only in (None, name):
                results.append(bench_model(name, family, overrides, args.steps, args.rounds, Path(tmp)))
    bare = bare_rss() / 2**20
    if args.json:
        print(json.dumps({"models": results, "bare_process_rss_mb": bare}, indent=2))
        return 0
    for r in results:
        print(f"{r['model']} ({r['family']}): hidden {r['hidden_size']}, {r['layers']} layers, "
              f"{r['params_mb']:.0f} MiB of blocks, 2 servers, batch 1, {r['steps']} steps")
        print(f"  per token: local {r['local_ms']:.2f} ms | 2 servers {r['remote_ms']:.2f} ms "
              f"({r['remote_over_local']:.2f}x local) | with push {r['push_ms']:.2f} ms")
        print(f"  per-hop overhead {r['per_hop_overhead_ms']:.2f} ms (median); "
              f"tokens/s {r['tokens_per_s_no_push']:.0f} without push, {r['tokens_per_s_push']:.0f} with push "
              f"({r['push_speedup']:.2f}x)")
        rss = ", ".join(f"{m:.0f}" for m in r["server_peak_rss_mb"])
        print(f"  server peak RSS {rss} MiB; blocks + cache budget {r['blocks_plus_cache_mb']:.1f} MiB; "
              f"bare process (imports only) {bare:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
