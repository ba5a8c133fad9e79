"""The default spot-check tolerances hold for honest servers and not for liars, on a few families' tiny blocks.

An honest primary (prompt in chunks, then one token per step, batched with other sessions)
and an honest checker (prompt in one call, then one catch-up call) differ by less than
`DEFAULT_TOLERANCES` in float32, bfloat16 and float16; in float32 a block with 3 % weight
noise, skipped blocks and a stale reply differ by more. The measurement behind the numbers
is ``benchmarks/bench_verify_tolerance.py``.
"""

from __future__ import annotations

import copy
from itertools import pairwise
from typing import Any

import pytest
import torch
from blockhelpers import family_config

from distconf.blocks import build_block, kv_geometry
from distconf.blocks.sizing import kv_cache_bytes_per_token
from distconf.client.verify_compare import DEFAULT_TOLERANCES, update_difference
from distconf.server.compute import ServedBlock
from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together

FAMILIES = [("llama", 0), ("falcon", 0), ("gemma2", 0), ("mixtral", 1)]
PROMPT, TOKENS = 6, 16


def blocks_of(family: str, variant: int, dtype: torch.dtype, noise: float = 0.0) -> tuple[list[ServedBlock], int]:
    """Every layer of the tiny variant, random non-trivial weights; ``noise``: relative weight noise on block 0."""
    config, _, _ = family_config(family, variant)
    geometry, per_token = kv_geometry(config), kv_cache_bytes_per_token(config, dtype)
    blocks = []
    for i in range(config.num_hidden_layers):
        module = build_block(config, i, device="cpu", dtype=torch.float32).requires_grad_(False)
        g = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
                if noise and i == 0:
                    p.mul_(1 + noise * torch.randn(p.shape, generator=g))
        blocks.append(ServedBlock(f"b.{i}", i, module.to(dtype), dtype, geometry, per_token))
    return blocks, config.hidden_size


def cache_of(blocks: list[ServedBlock], rows: int = 1) -> SessionCache:
    cache = SessionCache(blocks, rows, TOKENS + 8)
    cache.allocate()
    return cache


def primary(blocks: list[ServedBlock], x: torch.Tensor, batched: bool = False) -> torch.Tensor:
    """The prompt in chunks of 4, then one token per step; ``batched``: next to another session of another length."""
    none = [None] * len(blocks)
    mine, other = cache_of(blocks), cache_of(blocks, rows=2)
    other.step(torch.randn(2, 3, x.shape[2]).to(x.dtype), none, None)
    outs = []
    for a, b in pairwise([*range(0, PROMPT, 4), *range(PROMPT, TOKENS), TOKENS]):
        parts = [StepPart(mine, x[:, a:b], none)]
        if batched:
            parts.append(StepPart(other, torch.randn(2, 1, x.shape[2]).to(x.dtype), none))
        together = [p for p in parts if batch_key(p) == batch_key(parts[0])]
        outs.append(step_together(together)[0])
    return torch.cat(outs, dim=1)


def checker(blocks: list[ServedBlock], x: torch.Tensor) -> torch.Tensor:
    """The prompt in one call, then every later position in one catch-up call."""
    cache, none = cache_of(blocks), [None] * len(blocks)
    return torch.cat([cache.step(x[:, :PROMPT], none, None), cache.step(x[:, PROMPT:], none, None)], dim=1)


def largest(x: torch.Tensor, reference: torch.Tensor, checked: torch.Tensor) -> float:
    return float(update_difference(x, reference, checked).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("family", "variant"), FAMILIES)
def test_honest_servers_stay_under_the_default(family: str, variant: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    blocks, hidden = blocks_of(family, variant, dtype)
    x = torch.randn(1, TOKENS, hidden).to(dtype)
    reference = checker(blocks, x)
    for batched in (False, True):
        assert largest(x, reference, primary(blocks, x, batched)) < DEFAULT_TOLERANCES[dtype] / 2


@pytest.mark.parametrize(("family", "variant"), FAMILIES)
def test_liars_exceed_the_float32_default(family: str, variant: int) -> None:
    torch.manual_seed(0)
    blocks, hidden = blocks_of(family, variant, torch.float32)
    x = torch.randn(1, TOKENS, hidden)
    reference = checker(blocks, x)
    honest = primary(blocks, x)
    tolerance = DEFAULT_TOLERANCES[torch.float32]
    noisy, _ = blocks_of(family, variant, torch.float32, noise=0.03)
    skipped = [copy.copy(b) for b in blocks]
    for b in skipped:
        b.module = Skip(b.module)
    stale = torch.cat([honest[:, :PROMPT + 1], honest[:, PROMPT:-1]], dim=1)
    decode = slice(PROMPT + 1, None)
    for name, got in (("noise", primary(noisy, x)), ("identity", primary(skipped, x)), ("stale", stale)):
        diff = update_difference(x[:, decode], reference[:, decode], got[:, decode])
        assert float(diff.min()) > tolerance, (name, float(diff.min()))


class Skip(torch.nn.Module):
    """A block that skips its compute (returns its input) but keeps the cache it would write."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        return hidden, self.block(hidden, **kwargs)[1]
