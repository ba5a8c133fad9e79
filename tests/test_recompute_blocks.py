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
from blockhelpers import hf_model, record_layers, save_checkpoint
from sessionhelpers import served, steps
from sweephelpers import draft_and_check

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.sizing import kv_cache_bytes_per_token
from distconf.blocks.weights import load_block
from distconf.loader import load_family
from distconf.tools.checker import tiny_variants


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object], Path]:
    """openai-gpt drafted from its defaults and checked; its tiny config, model and blocks."""
    folder = tmp_path_factory.mktemp("openai_gpt")
    code, text = draft_and_check("openai-gpt", folder)
    assert code == 0, text
    assert "cache_argument: null" in text and "n_positions: n_positions" in text and "scale: 'True'" in text
    path = next((folder / "out").glob("*.yaml"))
    cls = load_family(path)
    _, values = tiny_variants(cls.family_spec.tiny_config)[0]
    config = cls(**values)
    model = hf_model(cls.hf_config_class(**values))
    save_checkpoint(model, folder / "ckpt")
    blocks = [load_block(folder / "ckpt", config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    return config, model, blocks, path


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
    from distconf.server.compute import SessionCache

    config, _, blocks, _ = drafted
    hidden = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    expected, _ = steps(blocks, hidden, [7])
    cache = SessionCache(served(config, blocks), 3, 16)
    cache.allocate()
    try:
        none = [None] * len(blocks)
        outputs = [cache.step(hidden[:, :4], none, None)] + [cache.step(hidden[:, i:i + 1], none, None)
                                                             for i in range(4, 7)]
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)
        hypo_ids, nxt = torch.tensor([2, 0, 0]), torch.randn(3, 1, config.hidden_size)
        ref, _ = steps(blocks, torch.cat([hidden[hypo_ids], nxt], dim=1), [8])
        torch.testing.assert_close(cache.step(nxt, none, hypo_ids), ref[:, 7:], rtol=1e-5, atol=1e-5)
        assert cache.rewind_refusal(3) is None  # no recurrent state: inputs are cut back by position
        cache.restart(3)
        ref, _ = steps(blocks, hidden[hypo_ids], [7])
        torch.testing.assert_close(cache.step(hidden[hypo_ids][:, 3:], none, None), ref[:, 3:], rtol=1e-5, atol=1e-5)
    finally:
        cache.release()


def test_two_sessions_batched_equal_each_alone(drafted: tuple) -> None:
    from distconf.server.batch_step import StepPart, batch_key, step_together
    from distconf.server.compute import SessionCache

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
