"""Hybrid families: layers of one model keep different caches, as their family file says per layer type.

Real tiny models of two built-in hybrid families, against transformers: granitemoehybrid
(Mamba-2 layers keeping a conv + SSM state, attention layers keeping K/V) and falcon_h1
(every layer runs attention and a Mamba-2 mixer side by side, keeping both). A server's
session over such blocks computes what the model computes, step by step, with beam search
reordering both kinds of rows; the family file's per-layer-type knobs are validated at
their place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blockhelpers import family_config, hf_model, record_layers, save_checkpoint, write_family
from sessionhelpers import served, session_with_beam_and_restart, steps

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
from distconf.blocks.sizing import kv_cache_bytes_per_token, state_bytes_per_sequence
from distconf.blocks.weights import load_block
from distconf.errors import FamilyValidationError
from distconf.loader import load_family


def _tiny(family: str, directory: Path, **overrides: object) -> tuple[object, object, list[object]]:
    config, hf_config, _ = family_config(family, **overrides)
    model = hf_model(hf_config)
    save_checkpoint(model, directory)
    blocks = [load_block(directory, config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    return config, model, blocks


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object]]:
    """A tiny granitemoehybrid: Mamba-2, attention, Mamba-2 layers."""
    return _tiny("granitemoehybrid", tmp_path_factory.mktemp("granitemoehybrid"))


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object]]:
    """A tiny falcon_h1: attention and Mamba-2 in every layer."""
    return _tiny("falcon_h1", tmp_path_factory.mktemp("falcon_h1"))


def test_each_layer_keeps_what_its_type_says(granite: tuple, falcon_h1: tuple) -> None:
    config, _, blocks = granite
    assert list(config.layer_types) == ["linear_attention", "full_attention", "linear_attention"]
    assert [keeps_kv_at(config, i) for i in range(3)] == [False, True, False]
    assert [keeps_state_at(config, i) for i in range(3)] == [True, False, True]
    assert kv_geometry(config, 0).values_per_token == 0 < kv_geometry(config, 1).values_per_token
    assert state_bytes_per_sequence(config, torch.float32, 1) == 0 < state_bytes_per_sequence(config, torch.float32, 0)
    _, pasts = steps(blocks, torch.randn(2, 5, config.hidden_size), [5])
    conv, recurrent = pasts[0]
    assert recurrent.dtype == torch.float32 and conv.shape[0] == 2
    key, value = pasts[1]
    assert key.shape[-2] == 5  # K/V per token
    assert kv_cache_bytes_per_token(config, torch.float32, 1) == (key.numel() + value.numel()) * 4 // (2 * 5)
    h1_config, _, h1_blocks = falcon_h1
    assert all(keeps_kv_at(h1_config, i) and keeps_state_at(h1_config, i) for i in range(2))
    _, pasts = steps(h1_blocks, torch.randn(1, 3, h1_config.hidden_size), [3])
    assert len(pasts[0]) == 4 and pasts[0][0].shape[-2] == 3 and pasts[0][3].dtype == torch.float32


@pytest.mark.parametrize("which", ["granite", "falcon_h1"])
def test_blocks_equal_the_model_layers_in_anysteps(which: str, request: pytest.FixtureRequest) -> None:
    config, model, blocks = request.getfixturevalue(which)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    hidden = records[0][0]
    with torch.no_grad():
        for block, (inputs, outputs) in zip(blocks, records):
            torch.testing.assert_close(block(inputs)[0], outputs, rtol=1e-5, atol=1e-5)
    whole, _ = steps(blocks, hidden, [9])
    torch.testing.assert_close(whole, records[-1][1], rtol=1e-5, atol=1e-5)
    for sizes in ([1] * 9, [4, 2, 1, 2]):
        stepped, _ = steps(blocks, hidden, sizes)
        torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["granite", "falcon_h1"])
def test_a_session_over_hybrid_blocks(which: str, request: pytest.FixtureRequest) -> None:
    """Prefill + decode steps, beam search's hypo_ids (K/V rows and state rows), rewinds and the budget."""
    from distconf.server.session_cache import SessionCache

    config, _, blocks = request.getfixturevalue(which)
    chain = served(config, blocks)
    assert SessionCache.nbytes(chain, 3, 16) == sum(b.kv_bytes_per_token * 3 * 16 + b.state_bytes_per_sequence * 3
                                                    for b in chain)
    session_with_beam_and_restart(config, blocks)


def test_one_token_continuation_feeds_a_longer_step_token_by_token(tmp_path: Path) -> None:
    """``state.continuation: one_token``: a multi-token step after a state runs as one-token steps (same result)."""
    path = write_family(tmp_path, "mamba2", "mamba2_one_token",
                        lambda text: text.replace("  recurrent_dtype: float32", "  recurrent_dtype: float32\n"
                                                  "  continuation: one_token"))
    cls = load_family(path)
    config, hf_config, _ = family_config("mamba2")
    mine = cls(**hf_config.to_dict())
    model = hf_model(hf_config)
    save_checkpoint(model, tmp_path / "ckpt")
    blocks = [load_block(tmp_path / "ckpt", mine, i, dtype=torch.float32) for i in range(mine.num_hidden_layers)]
    assert blocks[0].settings.one_token_steps
    calls: list[int] = []

    def seen(module: object, args: tuple, kwargs: dict) -> None:
        calls.append(int((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]))

    handle = blocks[0].mixer.register_forward_pre_hook(seen, with_kwargs=True)
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(4))
    try:
        whole, _ = steps(blocks, hidden, [9])
        calls.clear()
        stepped, _ = steps(blocks, hidden, [4, 5])
    finally:
        handle.remove()
    torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)
    assert calls == [4, 1, 1, 1, 1, 1]  # the prefill whole, the continuation one token at a time


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("    layer_types_field: layer_types\n", ""),
     r"state.layer_kinds needs block.mask.layer_types_field"),
    (lambda t: t.replace("  layer_kinds: [full_attention]", "  layer_kinds: [full_attention, attention]"),
     r"kv_cache.layer_kinds names 'attention', which block.mask.layer_kinds does not map"),
    (lambda t: t.replace("layer_kinds: {full_attention: causal, linear_attention: none}",
                         "layer_kinds: {full_attention: causal, linear_attention: nothing}"),
     r"block.mask.layer_kinds.linear_attention"),
])
def test_per_layer_type_knobs_are_checked_at_their_place(tmp_path: Path, edit: object, message: str) -> None:
    path = write_family(tmp_path, "granitemoehybrid", "hybrid_bad", edit)
    with pytest.raises(FamilyValidationError, match=message):
        load_family(path)


def test_a_model_buffer_function_that_is_not_there_is_located(tmp_path: Path) -> None:
    path = write_family(tmp_path, "falcon_h1", "h1_bad",
                        lambda t: t.replace("modeling_falcon_h1.compute_mup_vector", "modeling_falcon_h1.no_such"))
    cls = load_family(path)
    _, hf_config, _ = family_config("falcon_h1")
    from distconf.blocks import build_block

    with pytest.raises(FamilyValidationError, match=r"block.model_buffers.mamba.mup_vector"):
        build_block(cls(**hf_config.to_dict()), 0)


def test_a_layer_class_per_layer_type(tmp_path: Path) -> None:
    """``block.layer_classes``: jamba's attention layers and Mamba layers are two decoder-layer classes."""
    import pickle

    import distconf.blocks.build as build

    config, model, blocks = _tiny("jamba", tmp_path / "jamba")
    names = [type(b).layer_class.__name__ for b in blocks]
    assert names == ["JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"] * 2
    assert getattr(build, type(blocks[1]).__name__) is type(blocks[1])  # found by name, as pickle does
    assert type(pickle.loads(pickle.dumps(blocks[1]))) is type(blocks[1])
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    records = record_layers(model, config, ids, use_cache=False)
    stepped, _ = steps(blocks, records[0][0], [4, 2, 1, 2])  # Mamba layers continue one token at a time
    torch.testing.assert_close(stepped, records[-1][1], rtol=1e-5, atol=1e-5)


def test_a_wrong_layer_class_for_a_type_is_located(tmp_path: Path) -> None:
    from distconf.tools.checker import check_family

    path = write_family(tmp_path, "jamba", "jamba_swapped",
                        lambda t: t.replace("full_attention: transformers.models.jamba.modeling_jamba."
                                            "JambaAttentionDecoderLayer",
                                            "full_attention: transformers.models.jamba.modeling_jamba."
                                            "JambaMambaDecoderLayer"))
    (result,) = check_family(path)
    assert result.failure is not None and result.failure.field.startswith("block.layer_classes"), result.failure
