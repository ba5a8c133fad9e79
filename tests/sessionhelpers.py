"""Chains of tiny blocks run by hand and as a server session: the helpers the state and hybrid tests share."""

from __future__ import annotations

import torch

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.sizing import kv_cache_bytes_per_token, state_bytes_per_sequence
from distconf.tools.checker.runs import run_in_steps


def steps(blocks: list[object], hidden: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[object]]:
    """`distconf.tools.checker.runs.run_in_steps` without autograd: (the outputs, each block's cache)."""
    with torch.no_grad():
        return run_in_steps(blocks, hidden, sizes)


def served(config: object, blocks: list[object]) -> list[object]:
    """The blocks as a server holds them (float32), each sized by its own layer type."""
    from distconf.server.compute import ServedBlock

    return [ServedBlock(f"b.{i}", i, b, torch.float32, kv_geometry(config, i),
                        kv_cache_bytes_per_token(config, torch.float32, i),
                        state_bytes_per_sequence(config, torch.float32, i)) for i, b in enumerate(blocks)]


def session_with_beam_and_restart(config: object, blocks: list[object]) -> None:
    """A 3-row session: a 4-token prefill then decode steps, a beam reorder (``hypo_ids``), a refused
    rewind, a restart from 0; every output equals the chain run by hand."""
    from distconf.server.session_cache import SessionCache

    chain = served(config, blocks)
    hidden = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))  # type: ignore[attr-defined]
    expected, _ = steps(blocks, hidden, [7])
    cache = SessionCache(chain, 3, 16)
    cache.allocate()
    try:
        no_prompts = [None] * len(chain)
        outputs = [cache.step(hidden[:, :4], no_prompts, None)]
        outputs += [cache.step(hidden[:, i:i + 1], no_prompts, None) for i in range(4, 7)]
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)
        hypo_ids = torch.tensor([2, 0, 0])
        nxt = torch.randn(3, 1, config.hidden_size)  # type: ignore[attr-defined]
        out = cache.step(nxt, no_prompts, hypo_ids)
        ref, _ = steps(blocks, torch.cat([hidden[hypo_ids], nxt], dim=1), [8])
        torch.testing.assert_close(out, ref[:, 7:], rtol=1e-5, atol=1e-5)
        assert "cannot be cut back from position 8" in cache.rewind_refusal(3)
        cache.restart(0)
        torch.testing.assert_close(cache.step(hidden, no_prompts, None), expected, rtol=1e-5, atol=1e-5)
    finally:
        cache.release()


def session_with_beam_and_rewind(config: object, blocks: list[object]) -> None:
    """A 3-row session over blocks that keep K/V-like rows (no recurrent state): a 4-token prefill and decode
    steps, a beam reorder (``hypo_ids``), then a rewind to position 3 (allowed: rows are cut back by position);
    every output equals the chain run by hand."""
    from distconf.server.session_cache import SessionCache

    hidden = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))  # type: ignore[attr-defined]
    expected, _ = steps(blocks, hidden, [7])
    cache = SessionCache(served(config, blocks), 3, 16)
    cache.allocate()
    try:
        none = [None] * len(blocks)
        outputs = [cache.step(hidden[:, :4], none, None)] + [cache.step(hidden[:, i:i + 1], none, None)
                                                             for i in range(4, 7)]
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)
        hypo_ids, nxt = torch.tensor([2, 0, 0]), torch.randn(3, 1, config.hidden_size)  # type: ignore[attr-defined]
        ref, _ = steps(blocks, torch.cat([hidden[hypo_ids], nxt], dim=1), [8])
        torch.testing.assert_close(cache.step(nxt, none, hypo_ids), ref[:, 7:], rtol=1e-5, atol=1e-5)
        assert cache.rewind_refusal(3) is None
        cache.restart(3)
        ref, _ = steps(blocks, hidden[hypo_ids], [7])
        torch.testing.assert_close(cache.step(hidden[hypo_ids][:, 3:], none, None), ref[:, 3:], rtol=1e-5, atol=1e-5)
    finally:
        cache.release()
