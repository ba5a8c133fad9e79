"""How far apart two honest servers' results for one span are, against the spot checks' tolerance and real liars.

The metric is the client's: `distconf.client.verify_compare.update_difference`, the relative
difference of a span's update per position (the largest over the positions compared). For
float32, bfloat16 and float16 it measures what honest servers' results differ by:

* (a) decode vs catch-up: the primary server computes the prompt (in chunks of ``--chunk``
  tokens, as a server's prefill chunking does) and then one token per step with its KV
  cache; the checker computes the prompt in one call and then catches up on every later
  position in one call (its shadow session, as a check does);
* (b) alone vs batched: the session's steps computed alone vs inside `step_together`
  batches with other sessions of other lengths (batching on);
* (c) torch threads 1 vs 2 (the same steps);
* (a+c): decode with 1 thread vs catch-up with 2 threads;
* (d) vs exact: the primary's results vs the same weights computed in a wider dtype
  (float64 for float32, float32 for the half types), a proxy for other hardware's kernels:
  two correct implementations differ by at most about twice this;

on every family's tiny variants (random inputs) and on spans of the real model
(SmolLM2-135M-Instruct from its GGUF, the real hidden states of `FIXED_TEXT` from the local
model). Then, on the real model, what liars differ by: a few percent of weight noise on one
block, identity blocks (skipped compute: all or one), a stale reply (the previous step's
outputs) and quantized weights (int8/nf4, for reference: honest servers of another
quantization are not interchangeable). Per dtype it prints the largest honest difference,
`DEFAULT_TOLERANCES`, their ratio (the margin), and each liar's smallest difference over
the positions (a lie on one token) as a multiple of the tolerance.

    .venv/bin/python benchmarks/bench_verify_tolerance.py [--quick] [--no-real] [--no-tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from distconf.blocks import build_block, kv_geometry
from distconf.blocks.sizing import kv_cache_bytes_per_token
from distconf.client.verify_compare import DEFAULT_TOLERANCES, update_difference
from distconf.loader import list_families, load_family
from distconf.server.compute import ServedBlock
from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together
from distconf.tools.checker import tiny_variants

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = ("a decode/catch-up", "b alone/batched", "c threads 1/2", "a+c", "d vs exact")
EXACT = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}
"""The dtype case (d) computes the same weights in: a proxy for other hardware's kernels."""
Blocks = list[ServedBlock]
TINY_LENGTHS = ((24, 8), (12, 4))
"""(positions, of which prompt) of the tiny runs: the second where the tiny config allows fewer positions."""


def served(modules: Sequence[Any], config: Any, dtype: torch.dtype) -> Blocks:
    """``modules`` as a server holds them."""
    geometry, per_token = kv_geometry(config), kv_cache_bytes_per_token(config, dtype)
    return [ServedBlock(f"b.{i}", i, m, dtype, geometry, per_token) for i, m in enumerate(modules)]


def tiny_blocks(family: str, variant: int, dtype: torch.dtype) -> tuple[Blocks, int]:
    """A family's tiny variant, every layer with random non-trivial weights (as tests/test_batch_step.py)."""
    cls = load_family(family)
    config = cls(**tiny_variants(cls.family_spec.tiny_config)[variant][1])
    modules = []
    for i in range(config.num_hidden_layers):
        module = build_block(config, i, device="cpu", dtype=torch.float32).requires_grad_(False)
        generator = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
        modules.append(module.to(dtype))
    return served(modules, config, dtype), config.hidden_size


def _session(blocks: Blocks, rows: int, length: int) -> SessionCache:
    cache = SessionCache(blocks, rows, length)
    cache.allocate()
    return cache


def primary(blocks: Blocks, x: torch.Tensor, prompt: int, chunk: int) -> torch.Tensor:
    """The primary server's outputs: the prompt in chunks of ``chunk``, then one token per step."""
    cache, none = _session(blocks, x.shape[0], x.shape[1]), [None] * len(blocks)
    cuts = [*range(0, prompt, chunk), *range(prompt, x.shape[1]), x.shape[1]]
    return torch.cat([cache.step(x[:, a:b], none, None) for a, b in pairwise(cuts)], dim=1)


def checker(blocks: Blocks, x: torch.Tensor, prompt: int) -> torch.Tensor:
    """The checker's outputs: the prompt in one call, then every later position in one catch-up call."""
    cache, none = _session(blocks, x.shape[0], x.shape[1]), [None] * len(blocks)
    return torch.cat([cache.step(x[:, :prompt], none, None), cache.step(x[:, prompt:], none, None)], dim=1)


def batched(blocks: Blocks, x: torch.Tensor, prompt: int, chunk: int) -> torch.Tensor:
    """`primary`'s steps, each inside a `step_together` batch with sessions of other lengths and rows."""
    none, hidden = [None] * len(blocks), x.shape[2]
    g = torch.Generator().manual_seed(99)
    skews = (0, 2, 4)
    total = x.shape[1] + max(skews)
    mine = _session(blocks, x.shape[0], total)
    others = [(_session(blocks, rows, total), skew) for rows, skew in zip((1, 2, 1), skews, strict=True)]
    for cache, skew in others:  # different cached lengths: as long as ours, 2 and 4 tokens ahead
        if skew:
            cache.step(torch.randn(cache.batch, skew, hidden, generator=g).to(x.dtype), none, None)
    cuts = [*range(0, prompt, chunk), *range(prompt, x.shape[1]), x.shape[1]]
    outs = []
    for a, b in pairwise(cuts):
        parts = [StepPart(mine, x[:, a:b], none)]
        for cache, _ in others:  # the others decode one token (or join with a chunk of their own)
            n = b - a if cache.position == 0 else 1
            parts.append(StepPart(cache, torch.randn(cache.batch, n, hidden, generator=g).to(x.dtype), none))
        groups: dict[Any, list[int]] = {}
        for i, part in enumerate(parts):
            groups.setdefault(batch_key(part), []).append(i)
        for members in groups.values():
            results = step_together([parts[i] for i in members])
            if members[0] == 0:
                outs.append(results[0])
    return torch.cat(outs, dim=1)


def with_threads(threads: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()`` computed with ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def worst(x: torch.Tensor, reference: torch.Tensor, checked: torch.Tensor, start: int = 0) -> float:
    """The largest `update_difference` over positions ``start..``."""
    return float(update_difference(x[:, start:], reference[:, start:], checked[:, start:]).max())


def exact(blocks: Blocks, x: torch.Tensor, prompt: int) -> torch.Tensor:
    """The checker's steps on the same (rounded) weights computed in the wider `EXACT` dtype, cast back."""
    import copy

    wide = EXACT[blocks[0].dtype]
    modules = [copy.deepcopy(b.module).to(wide) for b in blocks]
    config = blocks[0].module.settings.config
    return checker(served(modules, config, wide), x.to(wide), prompt).to(x.dtype)


def honest(blocks: Blocks, x: torch.Tensor, prompt: int, chunk: int) -> dict[str, float]:
    """The largest honest difference per case (see the module docstring)."""
    one = with_threads(1, lambda: primary(blocks, x, prompt, chunk))
    two = with_threads(2, lambda: primary(blocks, x, prompt, chunk))
    check_two = with_threads(2, lambda: checker(blocks, x, prompt))
    check_one = with_threads(1, lambda: checker(blocks, x, prompt))
    batch = with_threads(1, lambda: batched(blocks, x, prompt, chunk))
    return {CASES[0]: worst(x, check_one, one), CASES[1]: worst(x, one, batch), CASES[2]: worst(x, one, two),
            CASES[3]: worst(x, check_two, one), CASES[4]: worst(x, exact(blocks, x, prompt), one)}


def tiny_table(dtypes: Sequence[torch.dtype], quick: bool) -> dict[torch.dtype, dict[str, float]]:
    """Print each tiny variant's largest honest difference per dtype; return the largest per dtype and case."""
    largest: dict[torch.dtype, dict[str, float]] = {d: dict.fromkeys(CASES, 0.0) for d in dtypes}
    (tokens, prompt), (short, _) = TINY_LENGTHS
    print(f"\ntiny variants (random weights and inputs, {tokens} positions: prompt {prompt} in chunks of 3, then "
          f"{tokens - prompt} decode steps; *: {short} positions where the config allows no more): the largest of "
          "cases a..a+c (which one), and d")
    print(f"{'family':<16}" + "".join(f"{str(d).removeprefix('torch.'):>22}" for d in dtypes))
    families = list_families()[:4] if quick else list_families()
    for family in families:
        for v in range(len(tiny_variants(load_family(family).family_spec.tiny_config))):
            cells = []
            for dtype in dtypes:
                blocks, hidden = tiny_blocks(family, v, dtype)
                diffs, mark = {}, ""
                for n, p in TINY_LENGTHS:
                    x = torch.randn(1, n, hidden, generator=torch.Generator().manual_seed(v)).to(dtype)
                    try:
                        diffs = honest(blocks, x, prompt=p, chunk=3)
                        break
                    except RuntimeError:  # e.g. a bias table as long as the tiny config's 16 positions
                        mark = "*"
                for case, value in diffs.items():
                    largest[dtype][case] = max(largest[dtype][case], value)
                case = max(CASES[:4], key=lambda k: diffs[k])
                cells.append(f"{diffs[case]:>9.2e} {case.split()[0] + mark:<3} d {diffs[CASES[4]]:.0e}")
            print(f"{family + ('' if v == 0 else f'[{v}]'):<16}" + "".join(f"{c:>22}" for c in cells))
    return largest


def real_inputs(source: Any, tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The token ids of `FIXED_TEXT`'s first ``tokens`` and the local fp32 model's hidden states (layer inputs)."""
    from distconf.tools import real_model as rm

    ids = source.load_tokenizer()(rm.FIXED_TEXT, return_tensors="pt")["input_ids"][:, :tokens]
    model = rm.local_model(source.checkpoint_dir)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    return ids, list(states)


def noisy(modules: list[Any], block: int, scale: float) -> list[Any]:
    """A copy of ``modules`` whose ``block`` has Gaussian noise of ``scale`` x each tensor's RMS on every weight."""
    import copy

    out = list(modules)
    out[block] = copy.deepcopy(modules[block])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in out[block].parameters():
            rms = p.float().pow(2).mean().sqrt()
            p.add_((torch.randn(p.shape, generator=g) * rms * scale).to(p.dtype))
    return out


class Identity(torch.nn.Module):
    """A block that skips its compute: it returns its input (and a cache of the right shape)."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        _, present = self.block(hidden, **kwargs)
        return hidden, present


def real_table(dtypes: Sequence[torch.dtype], tokens: int, prompt: int, chunk: int
               ) -> tuple[dict[torch.dtype, dict[str, float]], dict[torch.dtype, dict[str, float]]]:
    """Print the real model's honest differences and liars' per span and dtype; return the largest of each."""
    from distconf.server.loading import load_blocks
    from distconf.sources import open_source
    from distconf.tools.real_model import gguf_path

    cache = Path(os.environ["DISTCONF_CACHE"]) / "gguf" if os.environ.get("DISTCONF_CACHE") else (
        REPO / ".pytest_cache" / "d" / "distconf-real-model" / "gguf")
    source = open_source(gguf_path(), cache_dir=cache)
    config = source.config
    ids, states = real_inputs(source, tokens)
    largest: dict[torch.dtype, dict[str, float]] = {d: dict.fromkeys(CASES, 0.0) for d in dtypes}
    liars: dict[torch.dtype, dict[str, float]] = {d: {} for d in dtypes}
    layers = config.num_hidden_layers
    spans = [(0, layers // 2), (layers // 2, layers)]
    print(f"\nreal model ({config.num_hidden_layers} layers, hidden {config.hidden_size}): FIXED_TEXT's first "
          f"{ids.shape[1]} tokens, the local fp32 model's hidden states; primary: prompt {prompt} in chunks of "
          f"{chunk}, then {ids.shape[1] - prompt} decode steps")
    print(f"{'span':<8}{'dtype':<10}" + "".join(f"{c:>19}" for c in CASES))
    for dtype in dtypes:
        for start, end in spans:
            modules = load_blocks(source.checkpoint_dir, config, start, end, dtype)
            blocks = served(modules, config, dtype)
            x = states[start].to(dtype)
            diffs = honest(blocks, x, prompt, chunk)
            for case, value in diffs.items():
                largest[dtype][case] = max(largest[dtype][case], value)
            print(f"{start}:{end:<5}{str(dtype).removeprefix('torch.'):<10}"
                  + "".join(f"{diffs[c]:>19.2e}" for c in CASES))
            if (start, end) == spans[0]:
                liars[dtype] = liar_differences(source, config, modules, blocks, x, prompt, chunk)
    return largest, liars


def liar_differences(source: Any, config: Any, modules: list[Any], blocks: Blocks, x: torch.Tensor, prompt: int,
                     chunk: int) -> dict[str, float]:
    """Each liar's smallest difference over the decode positions, against the honest checker's results."""
    from distconf.server.loading import load_blocks

    dtype = blocks[0].dtype
    reference = checker(blocks, x, prompt)
    honest_out = primary(blocks, x, prompt, chunk)
    stale = torch.cat([honest_out[:, :prompt + 1], honest_out[:, prompt:-1]], dim=1)  # step t answers step t-1's
    lies: dict[str, torch.Tensor] = {
        "noise 1% on one block": primary(served(noisy(modules, 3, 0.01), config, dtype), x, prompt, chunk),
        "noise 3% on one block": primary(served(noisy(modules, 3, 0.03), config, dtype), x, prompt, chunk),
        "noise 10% on one block": primary(served(noisy(modules, 3, 0.1), config, dtype), x, prompt, chunk),
        "noise 30% on one block": primary(served(noisy(modules, 3, 0.3), config, dtype), x, prompt, chunk),
        "identity (all blocks)": primary(served([Identity(m) for m in modules], config, dtype), x, prompt, chunk),
        "one block skipped": primary(served([Identity(m) if i == 3 else m for i, m in enumerate(modules)], config,
                                            dtype), x, prompt, chunk),
        "stale reply": stale,
    }
    if dtype == torch.float32:
        for quant in ("int8", "nf4"):
            q = load_blocks(source.checkpoint_dir, config, 0, len(modules), dtype, quant=quant)
            lies[f"{quant} weights (honest)"] = primary(served(q, config, dtype), x, prompt, chunk)
    return {name: float(update_difference(x[:, prompt + 1:], reference[:, prompt + 1:], out[:, prompt + 1:]).min())
            for name, out in lies.items()}


def summary(dtypes: Sequence[torch.dtype], tiny: dict[torch.dtype, dict[str, float]],
            real: dict[torch.dtype, dict[str, float]], liars: dict[torch.dtype, dict[str, float]]) -> None:
    """The per-dtype table: largest honest difference, the default tolerance, the margin, liars / tolerance."""
    print("\nper dtype: largest difference between honest servers (cases a..a+c; tiny, real), twice the largest "
          "distance from exact (2 d: a bound for other kernels), DEFAULT_TOLERANCES, margins = tolerance / those")
    print(f"{'dtype':<10}{'tiny':>11}{'real':>11}{'2 d':>11}{'tolerance':>11}{'margin':>9}{'margin 2 d':>11}")
    for dtype in dtypes:
        tol = DEFAULT_TOLERANCES[dtype]
        measured = [max(t[dtype][c] for c in CASES[:4]) if dtype in t else float("nan") for t in (tiny, real)]
        far = 2 * max(t[dtype][CASES[4]] for t in (tiny, real) if dtype in t) if tiny or real else float("nan")
        top = max((v for v in measured if v == v), default=0.0)
        print(f"{str(dtype).removeprefix('torch.'):<10}{measured[0]:>11.2e}{measured[1]:>11.2e}{far:>11.2e}"
              f"{tol:>11.1e}{tol / top if top else float('inf'):>8.1f}x{tol / far if far else float('inf'):>10.1f}x")
    if any(liars.values()):
        names = list(next(v for v in liars.values() if v))
        print("\nliars on the real model's first span: smallest difference over the decode positions "
              "(one lying token), as a multiple of the tolerance")
        print(f"{'liar':<26}" + "".join(f"{str(d).removeprefix('torch.'):>22}" for d in dtypes))
        for name in names:
            cells = []
            for dtype in dtypes:
                v = liars[dtype].get(name)
                cells.append(f"{'':>22}" if v is None else f"{v:>10.2e} ({v / DEFAULT_TOLERANCES[dtype]:>7.1f}x)")
            print(f"{name:<26}" + "".join(f"{c:>22}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    """Measure and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 families, a shorter real text")
    parser.add_argument("--no-real", action="store_true", help="skip the real model")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny variants")
    parser.add_argument("--tokens", type=int, default=48, help="real-model positions (default 48)")
    parser.add_argument("--prompt", type=int, default=16, help="of which the prompt (default 16)")
    parser.add_argument("--chunk", type=int, default=8, help="the primary's prefill chunk (default 8)")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; torch threads 1 (2 in case c)")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tiny = {} if args.no_tiny else tiny_table(DTYPES, args.quick)
    real, liars = ({}, {}) if args.no_real else real_table(
        DTYPES, 32 if args.quick else args.tokens, args.prompt, args.chunk)
    summary(DTYPES, tiny, real, liars)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
