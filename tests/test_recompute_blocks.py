"""Layers that keep no cache (``block.call.cache_argument: null``): a block keeps the layer's input hidden
states and reruns the whole sequence at every step.

The architecture sweep's openai-gpt (``Block.forward(x, attention_mask)``, no cache argument; the model
builds its layers as ``Block(config.n_positions, config, scale=True)``) is drafted from its defaults and
proved by ``check``; then its tiny blocks serve a session as a server does: steps, beam search's
``hypo_ids``, a rewind (inputs are cut back like K/V), and two sessions batched together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blockhelpers import record_layers
from sessionhelpers import served, session_with_beam_and_rewind, steps
from sweephelpers import drafted_tiny_blocks

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.sizing import kv_cache_bytes_per_token


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object], Path]:
    """openai-gpt drafted from its defaults and checked; its tiny config, model, blocks and draft."""
    drafted = drafted_tiny_blocks("openai-gpt", tmp_path_factory.mktemp("openai_gpt"))
    text = drafted[3].read_text()
    assert "cache_argument: null" in text and "n_positions: n_positions" in text and "scale: 'True'" in text
    return drafted


def test_a_block_keeps_its_inputs_in_place_of_kv(drafted: tuple) -> None:
    config, model, blocks, _ = drafted
    geometry = kv_geometry(config, 0)
    assert (geometry.num_kv_heads, geometry.key_head_dim, geometry.value_head_dim) == (1, config.hidden_size, 0)
    assert kv_cache_bytes_per_token(config, torch.float32, 0) == config.hidden_size * 4
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    stepped, pasts = steps(blocks, records[0][0], [3, 1, 1, 2])
    torch.testing.assert_close(stepped, records[-1][1], rtol=1e-5, atol=1e-5)
    inputs, empty = pasts[1]
    torch.testing.assert_close(inputs[:, 0], records[1][0], rtol=1e-5, atol=1e-5)  # layer 1's own inputs
    assert empty.shape == (2, 1, 7, 0)


def test_a_session_steps_reorders_beams_and_rewinds(drafted: tuple) -> None:
    config, _, blocks, _ = drafted
    session_with_beam_and_rewind(config, blocks)  # no recurrent state: inputs are cut back by position


def test_two_sessions_batched_equal_each_alone(drafted: tuple) -> None:
    from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together

    config, _, blocks, _ = drafted
    chain = served(config, blocks)
    generator = torch.Generator().manual_seed(5)
    first, second = (torch.randn(1, n, config.hidden_size, generator=generator) for n in (6, 3))
    caches = [SessionCache(chain, 1, 16) for _ in range(2)]
    for cache in caches:
        cache.allocate()
    try:
        none = [None] * len(blocks)
        caches[0].step(first[:, :4], none, None)
        caches[1].step(second[:, :1], none, None)
        parts = [StepPart(caches[0], first[:, 4:], none), StepPart(caches[1], second[:, 1:], none)]
        assert batch_key(parts[0]) == batch_key(parts[1])
        together = step_together(parts)
        torch.testing.assert_close(together[0], steps(blocks, first, [6])[0][:, 4:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[1], steps(blocks, second, [3])[0][:, 1:], rtol=1e-5, atol=1e-5)
    finally:
        for cache in caches:
            cache.release()


def test_check_refuses_a_layer_given_a_cache_it_does_not_take(tmp_path: Path, drafted: tuple) -> None:
    """The same draft without the knob: the layer is handed ``cache=`` and ``check`` names the field."""
    from distconf.cli import main

    draft = drafted[3]
    broken = tmp_path / draft.name
    broken.write_text(draft.read_text().replace("    cache_argument: null\n", ""))
    assert main(["check", str(broken)]) == 1
