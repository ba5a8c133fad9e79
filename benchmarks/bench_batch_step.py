"""What batching buys in the compute thread alone (no network), and how exact it is.

Blocks of a random model whose blocks dominate the cost (hidden 1024, 16 heads, 8 KV heads,
8 layers, float32: the batching issue's 386 MB model; ``--family`` picks the family file,
by default the first with a plain config), held as a server holds them. ``k`` sessions, each with its own
cache of a different length, take one decode step: side by side in one run (rounds
interleaved, medians),

* alone: ``k`` calls of `SessionCache.step`, one session each (batching off);
* together: one `step_together` call for all ``k`` (batching on);

and a prefill chunk of ``--chunk`` tokens (what a decode step waits for at most while a
long prompt is computed). Then the exactness of batching for every family's tiny
variants, float32 and bfloat16: the largest relative difference between a session's
batched outputs and its outputs alone.

    .venv/bin/python benchmarks/bench_batch_step.py [--family F] [--rounds 5] [--chunk 64] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distconf.blocks import build_block, kv_geometry
from distconf.loader import list_families, load_family
from distconf.server.compute import ServedBlock
from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together
from distconf.tools.checker import tiny_variants

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swarm import plain_family

BIG = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 8,
       "head_dim": 64, "num_hidden_layers": 8, "vocab_size": 1000}


def served_blocks(family: str, overrides: dict[str, Any], dtype: torch.dtype, variant: int = 0
                  ) -> list[ServedBlock]:
    """The family's tiny config (variant) with ``overrides``, every layer as a served block (random weights)."""
    cls = load_family(family)
    _, values = tiny_variants(cls.family_spec.tiny_config)[variant]
    config = cls(**{**values, **overrides})
    geometry = kv_geometry(config)
    blocks = []
    for i in range(config.num_hidden_layers):
        module = build_block(config, i, device="cpu", dtype=torch.float32).requires_grad_(False)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
        module = module.to(dtype)
        size = torch.tensor([], dtype=dtype).element_size()
        blocks.append(ServedBlock(f"b.{i}", i, module, dtype, geometry, geometry.values_per_token * size))
    return blocks


def sessions(blocks: list[ServedBlock], k: int, dtype: torch.dtype, hidden: int, max_length: int = 256
             ) -> list[SessionCache]:
    """``k`` sessions with prompts of different lengths (8, 16, ...) already in their caches."""
    caches = []
    for i in range(k):
        cache = SessionCache(blocks, 1, max_length)
        cache.allocate()
        cache.step(torch.randn(1, 8 + 8 * (i % 8), hidden, dtype=dtype), [None] * len(blocks), None)
        caches.append(cache)
    return caches


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def speed(family: str, rounds: int, chunk: int, ks: list[int], dtype: torch.dtype = torch.float32) -> None:
    blocks = served_blocks(family, BIG, dtype)
    hidden = BIG["hidden_size"]
    mib = sum(p.numel() * p.element_size() for b in blocks for p in b.module.parameters()) / 2**20
    name = str(dtype).removeprefix("torch.")
    print(f"\n{family}: {len(blocks)} blocks, hidden {hidden}, {name}, {mib:.0f} MiB of weights; "
          f"ms per decode step of k sessions (median of {rounds} rounds)")
    print(f"{'k':>3} {'alone (k calls)':>16} {'together (1 call)':>18} {'speedup':>8} {'ms/session together':>20}")
    for k in ks:
        caches = sessions(blocks, k, dtype, hidden)
        x = [torch.randn(1, 1, hidden, dtype=dtype) for _ in range(k)]
        def one_by_one(caches: list[SessionCache] = caches, x: list[torch.Tensor] = x) -> None:
            for c, xi in zip(caches, x):
                c.step(xi, [None] * len(c.blocks), None)

        def together_once(caches: list[SessionCache] = caches, x: list[torch.Tensor] = x) -> None:
            step_together([StepPart(c, xi, [None] * len(c.blocks)) for c, xi in zip(caches, x)])

        alone, together = [], []
        for _ in range(rounds):  # every round advances each cache by two tokens (it has room)
            alone.append(timed(one_by_one))
            together.append(timed(together_once))
        a, t = statistics.median(alone), statistics.median(together)
        print(f"{k:>3} {a:>16.1f} {t:>18.1f} {a / t:>7.2f}x {t / k:>20.2f}")
    caches = sessions(blocks, 1, dtype, hidden, max_length=64 + rounds * (chunk + 1))
    none = [None] * len(blocks)
    one = statistics.median(timed(lambda: caches[0].step(torch.randn(1, 1, hidden, dtype=dtype), none, None))
                            for _ in range(rounds))
    long = statistics.median(timed(lambda: caches[0].step(torch.randn(1, chunk, hidden, dtype=dtype), none, None))
                             for _ in range(rounds))
    print(f"a prefill chunk of {chunk} tokens: {long:.1f} ms = {long / one:.1f}x one decode step ({one:.1f} ms): "
          "the longest a decode step waits behind a prefill")


def max_relative_difference(family: str, variant: int, dtype: torch.dtype) -> float:
    blocks = served_blocks(family, {}, dtype, variant)
    hidden = int(blocks[0].module.settings.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    lengths = [[5, 1, 1, 1], [3, 2, 1, 1], [7, 1, 3, 1]]
    alone = [SessionCache(blocks, 1, 32) for _ in lengths]
    batched = [SessionCache(blocks, 1, 32) for _ in lengths]
    for c in alone + batched:
        c.allocate()
    worst = 0.0
    for step in range(4):
        xs = [torch.randn(1, n[step], hidden, generator=g).to(dtype) for n in lengths]
        refs = [c.step(x, [None] * len(blocks), None) for c, x in zip(alone, xs)]
        parts = [StepPart(c, x, [None] * len(blocks)) for c, x in zip(batched, xs)]
        groups: dict[Any, list[int]] = {}
        for i, p in enumerate(parts):
            groups.setdefault(batch_key(p), []).append(i)
        outs: list[Any] = [None] * len(parts)
        for members in groups.values():
            for i, out in zip(members, step_together([parts[i] for i in members])):
                outs[i] = out
        for out, ref in zip(outs, refs):
            diff = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)
            worst = float(diff) if not float(diff) <= worst else worst  # a NaN shows as nan
    return worst


def exactness() -> None:
    print("\nbatched vs alone, largest relative difference of any output (every family's tiny variants)")
    print(f"{'family':<14} {'float32':>10} {'bfloat16':>10}")
    for family in list_families():
        for v in range(len(tiny_variants(load_family(family).family_spec.tiny_config))):
            f32 = max_relative_difference(family, v, torch.float32)
            bf16 = max_relative_difference(family, v, torch.bfloat16)
            print(f"{family + ('' if v == 0 else f'[{v}]'):<14} {f32:>10.2e} {bf16:>10.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default=None, help="family file (default: the first with a plain config)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="fewer sessions and rounds, no exactness table")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the timed blocks")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; torch threads {torch.get_num_threads()}")
    ks = [1, 4] if args.quick else [1, 2, 4, 8, 16]
    speed(args.family or plain_family(), 2 if args.quick else args.rounds, args.chunk, ks, getattr(torch, args.dtype))
    if not args.quick:
        exactness()
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
