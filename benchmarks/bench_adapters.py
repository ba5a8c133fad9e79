"""What LoRA adapters cost a server: decode steps of 8 sessions in one batch, with 0, 1 and 4 different adapters,
side by side with the base alone; and the memory an adapter takes, measured against the planner's figure.

The real model's blocks (SmolLM2-135M-Instruct from its GGUF, all 30, float32) are held as a server holds them;
each adapter is a PEFT LoRA (r=8 on every linear module of every layer: q, k, v, o, gate, up, down) with random
weights. 8 sessions with 64 cached tokens each take one decode step together (`step_together`): rounds of the four
configurations interleaved, medians, ms per token (a batch step / 8). Memory: the process's resident set before
and after reading and attaching one adapter, next to the planner's figure (`lora_bytes_per_block` x blocks).

    .venv/bin/python benchmarks/bench_adapters.py [--rounds 7] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.lora import attach, lora_bytes_per_block, read_lora
from distconf.blocks.sizing import kv_cache_bytes_per_token
from distconf.blocks.weights import load_block
from distconf.server.compute import ServedBlock
from distconf.server.session_cache import SessionCache, StepPart, step_together
from distconf.sources import open_source
from distconf.tools import real_model as rm

SESSIONS = 8
CACHED = 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_adapters(checkpoint: Path, folder: Path, count: int, rank: int) -> list[Path]:
    """``count`` random PEFT LoRA adapters of the model (different seeds), saved under ``folder``."""
    import peft

    out = []
    for i in range(count):
        torch.manual_seed(100 + i)
        tuned = peft.get_peft_model(rm.local_model(checkpoint), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False))
        tuned.save_pretrained(str(folder / f"a{i}"))
        out.append(folder / f"a{i}")
    return out


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    source = open_source(rm.gguf_path())
    config = source.config
    layers = int(config.num_hidden_layers)
    blocks = [load_block(source.checkpoint_dir, config, i, dtype=torch.float32).requires_grad_(False)
              for i in range(layers)]
    served = [ServedBlock(f"b.{i}", i, b, torch.float32, kv_geometry(config, i),
                          kv_cache_bytes_per_token(config, torch.float32, i)) for i, b in enumerate(blocks)]
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(Path(source.checkpoint_dir), Path(tmp), 4, args.rank)
        planned = lora_bytes_per_block(folders[0], config, torch.float32) * layers
        before = _rss()
        first = read_lora(folders[0], "a0", config, range(layers), torch.float32)
        for i, block in enumerate(blocks):
            attach(first, block, i)
        measured_rss = _rss() - before
        for n, folder in enumerate(folders[1:], start=1):
            adapter = read_lora(folder, f"a{n}", config, range(layers), torch.float32)
            for i, block in enumerate(blocks):
                attach(adapter, block, i)
    configurations = {"base alone": [None] * SESSIONS, "1 adapter": ["a0"] * SESSIONS,
                      "4 adapters": [f"a{i % 4}" for i in range(SESSIONS)],
                      "base + 4 adapters": [None, None, None, None, "a0", "a1", "a2", "a3"]}
    g = torch.Generator().manual_seed(0)
    prefix = torch.randn(1, CACHED, config.hidden_size, generator=g)
    steps = [torch.randn(1, 1, config.hidden_size, generator=g) for _ in range(SESSIONS)]
    caches: dict[str, list[SessionCache]] = {}
    for name, adapters in configurations.items():
        caches[name] = [SessionCache(served, 1, CACHED + 4 * args.rounds + 4, adapter=a) for a in adapters]
        for cache in caches[name]:
            cache.allocate()
            cache.step(prefix, [None] * layers, None)
    times: dict[str, list[float]] = {name: [] for name in configurations}
    prompts = [None] * layers
    for _ in range(args.rounds):
        for name in configurations:
            parts = [StepPart(c, x, prompts) for c, x in zip(caches[name], steps)]
            times[name].append(timed(lambda parts=parts: step_together(parts)) * 1000 / SESSIONS)
            for c in caches[name]:
                c.position = CACHED  # every round steps from the same cached length
    base = statistics.median(times["base alone"])
    load = os.getloadavg()
    print(f"SmolLM2-135M blocks 0..{layers - 1} (float32, 1 thread), {SESSIONS} sessions x 1 new token after "
          f"{CACHED} cached, LoRA r={args.rank} on {', '.join(TARGETS)}; medians of {args.rounds} rounds; "
          f"load {load[0]:.2f} {load[1]:.2f}")
    print(f"{'batch of 8 sessions':<24}{'ms/token':>10}{'vs base alone':>15}")
    for name in configurations:
        ms = statistics.median(times[name])
        print(f"{name:<24}{ms:>10.2f}{ms / base:>14.2f}x")
    print(f"memory of one adapter over {layers} blocks: planner {planned / 2**20:.2f} MiB, measured (tensors) "
          f"{first.nbytes / 2**20:.2f} MiB ({first.nbytes / planned:.2f}x), resident set grew "
          f"{measured_rss / 2**20:.2f} MiB ({measured_rss / planned:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
