"""A sparse-attention indexer's key cache on some layer types only (``kv_cache.indexer_layer_kinds``), reached
through a model's own cache layer API (``cache.layers[i].update_index`` with one-head ``[batch, 1, tokens, dim]``
keys).

The sweep's minimax_m3_vl_text: its defaults build only full-attention layers, and the modeling code names a
``minimax_m3_sparse`` type whose layers add a block-selecting indexer. Drafted from the defaults (a tiny variant
builds the sparse layer) and proved by ``check``; then a session over the tiny blocks holds the indexer's keys
on the sparse block only, through steps, beam search's ``hypo_ids`` and a rewind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blockhelpers import record_layers
from sessionhelpers import session_with_beam_and_rewind, steps
from sweephelpers import drafted_tiny_blocks

from distconf.blocks.kvcache import BlockKVCache, kv_geometry


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object], Path]:
    """minimax_m3_vl_text drafted and checked; the tiny variant with a sparse layer, its model and blocks."""
    drafted = drafted_tiny_blocks("minimax_m3_vl_text", tmp_path_factory.mktemp("minimax_m3"),
                                  lambda values: "minimax_m3_sparse" in values.get("layer_types", []))
    text = drafted[3].read_text()
    assert "indexer_layer_kinds:\n  - minimax_m3_sparse" in text and "minimax_m3_sparse: causal" in text
    return drafted


def test_only_the_sparse_layers_keep_indexer_keys(drafted: tuple) -> None:
    config, model, blocks, _ = drafted
    sparse = [i for i, t in enumerate(config.layer_types) if t == "minimax_m3_sparse"]
    dense = [i for i in range(len(blocks)) if i not in sparse]
    assert sparse and dense
    assert all(kv_geometry(config, i).indexer_head_dim == config.index_head_dim for i in sparse)
    assert all(kv_geometry(config, i).indexer_head_dim == 0 for i in dense)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    stepped, pasts = steps(blocks, records[0][0], [3, 1, 1, 2])
    torch.testing.assert_close(stepped, records[-1][1], rtol=1e-5, atol=1e-5)
    assert all(len(pasts[i]) == 3 and pasts[i][2].shape == (2, 7, config.index_head_dim) for i in sparse)
    assert all(len(pasts[i]) == 2 for i in dense)


def test_a_session_over_sparse_blocks_steps_reorders_and_rewinds(drafted: tuple) -> None:
    config, _, blocks, _ = drafted
    session_with_beam_and_rewind(config, blocks)


def test_cache_layers_exist_only_where_an_indexer_is_kept() -> None:
    plain = BlockKVCache(None, 2, "kv_heads")
    assert not hasattr(plain, "layers")  # a layer probing ``cache.layers`` sees a cache without them
    kept = BlockKVCache(None, 2, "kv_heads", keeps_indexer=True)
    first = kept.layers[5].update_index(torch.ones(1, 1, 3, 4))
    both = kept.layers[5].update_index(torch.zeros(1, 1, 2, 4))
    assert first.shape == (1, 1, 3, 4) and both.shape == (1, 1, 5, 4) and kept.indexer.shape == (1, 5, 4)
