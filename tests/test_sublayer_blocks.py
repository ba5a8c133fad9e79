"""Layer modules holding several attention sublayers (``block.modules_field``, ``kv_cache.sublayers``).

The sweep's longcat_flash counts 2 attention sublayers per layer module in ``num_hidden_layers``
(``2 * num_layers``); each module calls the cache with layer indices ``2i`` and ``2i + 1``. Drafted from
its defaults and proved by ``check``; then a block per module serves a session as a server does, with both
sublayers' K/V side by side: steps, beam search's ``hypo_ids``, a rewind, two sessions batched together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blockhelpers import record_layers
from sessionhelpers import served, steps
from sweephelpers import drafted_tiny_blocks

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.sublayer_cache import BlockSublayerKVCache
from distconf.errors import FamilyValidationError
from distconf.loader import load_family


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object], Path]:
    """longcat_flash drafted from its defaults and checked; its tiny config, model, blocks and draft."""
    drafted = drafted_tiny_blocks("longcat_flash", tmp_path_factory.mktemp("longcat_flash"))
    text = drafted[3].read_text()
    assert "modules_field: num_layers" in text and "sublayers: 2" in text
    return drafted


def test_one_block_per_module_caching_both_sublayers(drafted: tuple) -> None:
    config, model, blocks, _ = drafted
    assert config.num_hidden_layers == config.num_layers == len(blocks)
    assert model.config.num_hidden_layers == 2 * config.num_layers  # transformers still counts sublayers
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    stepped, pasts = steps(blocks, records[0][0], [3, 1, 1, 2])
    torch.testing.assert_close(stepped, records[-1][1], rtol=1e-5, atol=1e-5)
    key, value = pasts[0]
    geometry = kv_geometry(config, 0)
    assert key.shape == (2, geometry.num_kv_heads, 7, geometry.key_head_dim) and geometry.num_kv_heads == 2
    assert value.shape[-1] == geometry.value_head_dim
    assert geometry.values_per_token == 2 * (geometry.key_head_dim + geometry.value_head_dim)


def test_a_session_steps_reorders_beams_rewinds_and_batches(drafted: tuple) -> None:
    from distconf.server.session_cache import SessionCache, StepPart, step_together

    config, _, blocks, _ = drafted
    chain = served(config, blocks)
    hidden = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    expected, _ = steps(blocks, hidden, [7])
    cache, other = SessionCache(chain, 3, 16), SessionCache(chain, 3, 16)
    cache.allocate()
    other.allocate()
    try:
        none = [None] * len(blocks)
        outputs = [cache.step(hidden[:, :4], none, None)] + [cache.step(hidden[:, i:i + 1], none, None)
                                                             for i in range(4, 7)]
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)
        hypo_ids, nxt = torch.tensor([2, 0, 0]), torch.randn(3, 1, config.hidden_size)
        ref, _ = steps(blocks, torch.cat([hidden[hypo_ids], nxt], dim=1), [8])
        torch.testing.assert_close(cache.step(nxt, none, hypo_ids), ref[:, 7:], rtol=1e-5, atol=1e-5)
        assert cache.rewind_refusal(3) is None
        cache.restart(3)
        other.step(hidden[:, :1], none, None)
        together = step_together([StepPart(cache, hidden[hypo_ids][:, 3:], none),
                                  StepPart(other, hidden[:, 1:3], none)])
        alone, _ = steps(blocks, hidden[hypo_ids], [7])
        torch.testing.assert_close(together[0], alone[:, 3:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[1], expected[:, 1:3], rtol=1e-5, atol=1e-5)
    finally:
        cache.release()
        other.release()


def test_a_module_calling_more_sublayers_than_declared_is_named() -> None:
    cache = BlockSublayerKVCache(None, 2, "kv_heads", 2)
    for layer_idx in (4, 5):
        cache.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), layer_idx)
    with pytest.raises(RuntimeError, match="more than 2 layer indices"):
        cache.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), 6)
    key, _ = cache.present
    assert key.shape == (1, 2, 3, 4)


def test_a_modules_field_the_config_lacks_is_located(tmp_path: Path, drafted: tuple) -> None:
    path = tmp_path / "longcat_flash_bad.yaml"
    path.write_text(drafted[3].read_text().replace("modules_field: num_layers", "modules_field: num_modules")
                    .replace("family: longcat_flash", "family: longcat_flash_bad"))
    with pytest.raises(FamilyValidationError) as raised:
        load_family(path)
    assert "block.modules_field" in str(raised.value) and "'num_modules' is not an integer field" in str(raised.value)
