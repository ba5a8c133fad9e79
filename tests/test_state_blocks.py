"""Blocks whose layers keep a per-sequence state (the family file's ``state`` section), against transformers.

A real tiny Mamba-2 model: its blocks loaded through the family file compute exactly what
the model's layers compute, a prefill in one step equals token-by-token steps carrying the
block's ``(conv, recurrent)`` state, reordered state rows follow their sequences (beam
search's ``hypo_ids``), and the state is sized per sequence, not per token.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from blockhelpers import family_config, hf_model, record_layers, save_checkpoint
from sessionhelpers import served, steps

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.sizing import kv_cache_bytes_per_token, state_bytes_per_sequence
from distconf.blocks.state import BlockStateCache, state_geometry
from distconf.blocks.weights import load_block
from distconf.errors import FamilyValidationError
from distconf.loader import load_family
from distconf.loader.presets import preset_path

FAMILY = "mamba2"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object]]:
    """(config, HF model, blocks loaded from its checkpoint through the family file)."""
    config, hf_config, _ = family_config(FAMILY)
    model = hf_model(hf_config)
    directory = save_checkpoint(model, tmp_path_factory.mktemp("mamba2"))
    blocks = [load_block(Path(directory), config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    return config, model, blocks


def test_blocks_equal_the_model_layers(tiny: tuple) -> None:
    config, model, blocks = tiny
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    with torch.no_grad():
        for block, (inputs, outputs) in zip(blocks, records):
            out, present = block(inputs)
            assert present is None
            torch.testing.assert_close(out, outputs, rtol=1e-5, atol=1e-5)


def test_incremental_steps_equal_one_prefill(tiny: tuple) -> None:
    config, _, blocks = tiny
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole, states = steps(blocks, hidden, [9])
    for sizes in ([1] * 9, [4, 2, 1, 2], [3, 6]):
        stepped, stepped_states = steps(blocks, hidden, sizes)
        torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)
        for (conv, rec), (conv2, rec2) in zip(states, stepped_states):
            torch.testing.assert_close(conv2, conv, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rec2, rec, rtol=1e-4, atol=1e-5)


def test_state_shapes_and_bytes_come_from_the_family_file(tiny: tuple) -> None:
    config, _, blocks = tiny
    geometry = state_geometry(config)
    _, states = steps(blocks, torch.randn(3, 5, config.hidden_size), [5])
    conv, recurrent = states[0]
    assert tuple(conv.shape) == (3, *geometry.conv_shape)
    assert tuple(recurrent.shape) == (3, *geometry.recurrent_shape)
    assert recurrent.dtype == torch.float32
    # bf16 blocks: the conv window in bf16 (2 bytes), the recurrent state in float32 (the family's recurrent_dtype)
    assert state_bytes_per_sequence(config, torch.bfloat16) == geometry.conv_values * 2 + geometry.recurrent_values * 4
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 0
    assert kv_geometry(config).values_per_token == 0


def test_reordered_state_rows_follow_their_sequences(tiny: tuple) -> None:
    """Beam search's hypo_ids: reordering the state rows equals having run the reordered sequences."""
    config, _, blocks = tiny
    hidden = torch.randn(3, 6, config.hidden_size, generator=torch.Generator().manual_seed(2))
    hypo_ids = torch.tensor([2, 0, 0])
    _, states = steps(blocks, hidden[:, :5], [5])
    reordered = [(conv[hypo_ids], rec[hypo_ids]) for conv, rec in states]
    step = hidden[hypo_ids, 5:]
    with torch.no_grad():
        for i, block in enumerate(blocks):
            step, _ = block(step, layer_past=reordered[i], use_cache=True)
    expected, _ = steps(blocks, hidden[hypo_ids], [6])
    torch.testing.assert_close(step, expected[:, 5:], rtol=1e-5, atol=1e-5)


def test_the_callers_state_is_not_changed_by_a_step(tiny: tuple) -> None:
    """Layers update their state in place: the block works on a copy, so a session's state survives a retry."""
    config, _, blocks = tiny
    _, states = steps(blocks, torch.randn(1, 4, config.hidden_size), [4])
    before = [tuple(t.clone() for t in s) for s in states]
    with torch.no_grad():
        blocks[0](torch.randn(1, 1, config.hidden_size), layer_past=states[0], use_cache=True)
    for (conv, rec), (conv0, rec0) in zip(states, before):
        assert torch.equal(conv, conv0) and torch.equal(rec, rec0)


def test_state_cache_before_the_first_step_reports_none() -> None:
    cache = BlockStateCache(None)
    assert cache.get_conv_state(0) is None and cache.get_recurrent_state(0) is None and cache.present is None
    window = cache.update_conv_state(torch.ones(1, 3, 2), 0, conv_kernel_size=4)
    assert window.shape == (1, 3, 4) and cache.present[0].shape == (1, 3, 4)


# Methods of transformers' Cache its models call (not their layers), or K/V calls (`BlockKVCache` answers those
# for a hybrid layer); every other public method is a call a layer may make on the cache it is given.
MODEL_LEVEL_CALLS = {
    "activate_past_recording", "batch_repeat_interleave", "batch_select_indices", "batch_size", "crop",
    "early_initialization", "get_max_length", "has_previous_state", "is_compileable", "is_croppable", "is_dummy",
    "is_initialized", "is_linear", "is_sliding", "offload", "prefetch", "reorder_cache", "reset",
    "update_indexer",  # sparse-attention indexers: `distconf.blocks.sublayer_cache`
}
KV_CALLS = {"update", "get_mask_sizes", "get_query_offset"}


def test_state_caches_answer_every_layer_call_of_the_installed_transformers() -> None:
    """A transformers minor may add calls its recurrent layers make on their cache (5.25 added
    ``get_recurrent_states_to_keep`` and ``increase_count``): any the block caches do not answer is named here."""
    import transformers
    from transformers.cache_utils import Cache

    from distconf.blocks.hybrid_cache import BlockHybridCache

    layer_calls = {m for m in dir(Cache) if not m.startswith("_")} - MODEL_LEVEL_CALLS
    for cls, calls in ((BlockStateCache, layer_calls - KV_CALLS), (BlockHybridCache, layer_calls)):
        missing = sorted(m for m in calls if not hasattr(cls, m))
        assert not missing, f"{cls.__name__} does not answer {missing} (transformers {transformers.__version__})"


def test_state_cache_keeps_no_history_and_takes_the_last_of_a_list() -> None:
    """transformers >= 5.25: no intermediate states are asked for, a token count is not kept, and a list of
    recurrent states (history then last) keeps the last."""
    cache = BlockStateCache((torch.zeros(1, 3, 4), torch.zeros(1, 2)))
    assert cache.get_recurrent_states_to_keep(0) == 0
    cache.increase_count(0, 0)
    assert torch.equal(cache.present[0], torch.zeros(1, 3, 4))
    first, last = torch.ones(1, 2), torch.full((1, 2), 2.0)
    assert torch.equal(cache.update_recurrent_state([first, last], 0), last)
    assert torch.equal(cache.get_recurrent_state(0), last)


def test_preset_sizes_a_session_per_sequence() -> None:
    cls = load_family(FAMILY)
    config = cls.from_json_file(str(preset_path("mistralai/Mamba-Codestral-7B-v0.1")))
    # 128 heads x 64 x 128 float32 state + (8192 + 2 * 8 * 128) x 4 conv window in bf16, per block and sequence
    assert state_bytes_per_sequence(config, torch.bfloat16) == 128 * 64 * 128 * 4 + (8192 + 2048) * 4 * 2


def test_a_family_without_state_still_needs_kv_groups(tmp_path: Path) -> None:
    from blockhelpers import write_family

    path = write_family(tmp_path, FAMILY, "nostate",
                        lambda text: re.sub(r"\nstate:\n(  .*\n)+", "\n", text))
    with pytest.raises(FamilyValidationError, match="kv_groups"):
        load_family(path)


# ---------------------------------------------------------------- a server's session over such blocks


def test_session_cache_holds_the_state_per_session(tiny: tuple) -> None:
    from distconf.server.session_cache import SessionCache, StepPart, batch_key

    config, _, blocks = tiny
    chain = served(config, blocks)
    hidden = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    expected, _ = steps(blocks, hidden, [7])
    # the budget is charged per row (sequence), whatever max_length
    per_row = 2 * chain[0].state_bytes_per_sequence
    assert SessionCache.nbytes(chain, 3, 100) == SessionCache.nbytes(chain, 3, 10) == 3 * per_row
    cache = SessionCache(chain, 3, 16)
    cache.allocate()
    outputs = [cache.step(hidden[:, :4], [None, None], None)]
    outputs += [cache.step(hidden[:, i:i + 1], [None, None], None) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)
    # beam search: hypo_ids reorder the state rows
    hypo_ids = torch.tensor([1, 1, 0])
    nxt = torch.randn(3, 1, config.hidden_size)
    out = cache.step(nxt, [None, None], hypo_ids)
    ref, _ = steps(blocks, torch.cat([hidden[hypo_ids], nxt], dim=1), [8])
    torch.testing.assert_close(out, ref[:, 7:], rtol=1e-5, atol=1e-5)
    # a rewind: refused except to where it stands or to 0 (which empties the state)
    assert cache.rewind_refusal(8) is None and cache.rewind_refusal(0) is None
    assert "cannot be cut back from position 8" in cache.rewind_refusal(5)
    cache.restart(0)
    again = cache.step(hidden, [None, None], None)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)
    # batched only with sessions in step (one position, one length): rows are never padded through the recurrence
    other = SessionCache(chain, 1, 16)
    parts = [StepPart(c, hidden[:1, :1], [None, None]) for c in (cache, other)]
    assert batch_key(parts[0]) != batch_key(parts[1])
    assert batch_key(parts[0]) != batch_key(StepPart(cache, hidden[:1, :2], [None, None]))
    other.position = cache.position
    assert batch_key(parts[0]) == batch_key(parts[1])
    cache.release()
    assert not cache.allocated and cache.slots == []


def test_plan_counts_state_per_sequence() -> None:
    from distconf.planning import plan_server

    cls = load_family(FAMILY)
    config = cls.from_json_file(str(preset_path("mistralai/Mamba-Codestral-7B-v0.1")))
    plan = plan_server(config, "64GiB", "bfloat16", attn_cache_tokens=8192)
    assert plan.kv_bytes_per_token == 0
    # the memory a K/V cache of 8192 tokens takes at this hidden size (bfloat16), in whole sequences
    assert plan.state_sequences == 2 * config.hidden_size * 2 * 8192 // plan.state_bytes_per_sequence >= 1
    assert plan.cache_bytes_per_block == plan.state_bytes_per_sequence * plan.state_sequences > 0
