"""Batched inference steps equal each session's steps alone, for every family's tiny variants.

Sessions with different cached lengths, different new lengths (a prefill chunk next to
decode steps), their own deep prompts and their own batch are computed in one block call
per block (`step_together`); every row's outputs and every cache entry must equal what the
session gets from `SessionCache.step` alone (float32: within 1e-5 relative).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from blockhelpers import family_config

from distconf.blocks import build_block, kv_geometry
from distconf.loader import get_family_spec, list_families
from distconf.server.compute import ServedBlock
from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together
from distconf.tools.checker import tiny_variants

CASES = [(family, v) for family in list_families()
         for v in range(len(tiny_variants(get_family_spec(family).tiny_config)))]


def served_blocks(family: str, variant: int) -> tuple[list[ServedBlock], int]:
    config, _, _ = family_config(family, variant)
    torch.manual_seed(0)
    geometry = kv_geometry(config)
    blocks = []
    for i in range(config.num_hidden_layers):
        module = build_block(config, i, device="cpu", dtype=torch.float32).requires_grad_(False)
        generator = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
        blocks.append(ServedBlock(f"b.{i}", i, module, torch.float32, geometry, geometry.values_per_token * 4))
    return blocks, config.hidden_size


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max().clamp(min=1.0)))


class Session:
    """One session's inputs (its own random stream), run alone and batched side by side."""

    def __init__(self, blocks: list[ServedBlock], hidden: int, rows: int, seed: int, prompt_len: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.inputs = [torch.randn(rows, n, hidden, generator=g) for n in (5 + seed % 3, 1, 3, 1, 1)]
        self.prompts: list[Any] = [None] * len(blocks)
        if prompt_len:
            self.prompts = [torch.randn(rows, prompt_len, hidden, generator=g) * 0.1 for _ in blocks]
        self.alone = SessionCache(blocks, rows, 16)
        self.batched = SessionCache(blocks, rows, 16)
        self.alone.allocate()
        self.batched.allocate()


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_batched_steps_equal_alone(family: str, variant: int) -> None:
    blocks, hidden = served_blocks(family, variant)
    sessions = [Session(blocks, hidden, rows=r, seed=s, prompt_len=p)
                for s, (r, p) in enumerate([(1, 0), (2, 0), (1, 4)])]
    # step k of every session; session s joins at step s (so rows have different cached lengths)
    for k in range(len(sessions[0].inputs) + len(sessions) - 1):
        parts, expected = [], []
        for s, session in enumerate(sessions):
            i = k - s
            if 0 <= i < len(session.inputs):
                x = session.inputs[i]
                expected.append(session.alone.step(x, session.prompts, None))
                parts.append(StepPart(session.batched, x, session.prompts))
        groups: dict[Any, list[int]] = {}
        for i, part in enumerate(parts):
            groups.setdefault(batch_key(part), []).append(i)
        outputs: list[Any] = [None] * len(parts)
        for members in groups.values():
            for i, out in zip(members, step_together([parts[i] for i in members])):
                outputs[i] = out
        for out, ref in zip(outputs, expected):
            assert out.shape == ref.shape
            assert close(out, ref), f"step {k}: max diff {(out - ref).abs().max():.3g}"
    for session in sessions:
        assert_same_cache(session.batched, session.alone)


def assert_same_cache(batched: SessionCache, alone: SessionCache) -> None:
    """Every slot of the session's cache equals what the session computed alone."""
    assert batched.position == alone.position
    pos = alone.position
    for sb, sa in zip(batched.slots, alone.slots):
        if sa.keys is not None:
            assert close(sb.keys[:, :, :pos], sa.keys[:, :, :pos])
            assert close(sb.values[:, :, :pos], sa.values[:, :, :pos])
        if sa.indexer is not None:
            assert close(sb.indexer[:, :pos], sa.indexer[:, :pos])
        assert (sb.state is None) == (sa.state is None)
        for tb, ta in zip(sb.state or (), sa.state or ()):
            assert (tb is None and ta is None) or close(tb.float(), ta.float())


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_sessions_in_step_are_batched_whatever_their_blocks_keep(family: str, variant: int) -> None:
    """Sessions at one position with as many new tokens share one block call per block, also when their blocks
    keep a recurrent state or an indexer's keys (rows stacked, never padded), and each equals itself alone."""
    blocks, hidden = served_blocks(family, variant)
    sessions = [Session(blocks, hidden, rows=r, seed=s, prompt_len=p)
                for s, (r, p) in enumerate([(1, 0), (2, 0), (1, 4)])]
    for session in sessions:  # one schedule of lengths for all: 5 tokens, then 1, 3, 1, 1
        session.inputs = [x[:, :n] if x.shape[1] >= n else torch.cat([x] * n, dim=1)[:, :n]
                          for x, n in zip(session.inputs, (5, 1, 3, 1, 1))]
    for k in range(len(sessions[0].inputs)):
        parts = [StepPart(s.batched, s.inputs[k], s.prompts) for s in sessions]
        assert len({batch_key(p) for p in parts}) == 1
        expected = [s.alone.step(s.inputs[k], s.prompts, None) for s in sessions]
        for out, ref in zip(step_together(parts), expected):
            assert out.shape == ref.shape
            assert close(out, ref), f"step {k}: max diff {(out - ref).abs().max():.3g}"
    for session in sessions:
        assert_same_cache(session.batched, session.alone)


def test_one_part_is_the_alone_path() -> None:
    blocks, hidden = served_blocks("llama", 0)
    session = Session(blocks, hidden, rows=1, seed=0)
    for x in session.inputs:
        ref = session.alone.step(x, session.prompts, None)
        (out,) = step_together([StepPart(session.batched, x, session.prompts)])
        assert torch.equal(out, ref)
