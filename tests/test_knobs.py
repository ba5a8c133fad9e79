"""The knobs for chunked attention, buffers a layer computes itself and ALiBi calling conventions."""

from __future__ import annotations

import pytest
import torch
from blockhelpers import family_config, hf_layer, hf_model, save_checkpoint, write_family

from distconf.blocks import build_block
from distconf.blocks.build import materialize_buffers
from distconf.blocks.weights import load_block
from distconf.cli import main
from distconf.errors import FamilyValidationError
from distconf.loader import load_family
from distconf.tools.checker import check_family

# --- chunked attention -----------------------------------------------------------------------------------------


def test_chunked_and_full_layers_alternating_match_transformers() -> None:
    (result,) = check_family("llama4_text")
    assert result.ok, result.failure
    config = load_family("llama4_text")(**load_family("llama4_text").family_spec.tiny_config)
    assert config.layer_types == ["chunked_attention", "full_attention"] * 2
    assert config.attention_chunk_size < 9  # the 9 checked tokens span several chunks
    assert result.full_diff <= 1e-5 and result.incremental_diff <= 1e-5


@pytest.mark.parametrize("wrong", ["causal", "sliding_window"])
def test_chunked_layers_with_another_mask_fail(tmp_path, fresh_cache, wrong: str) -> None:
    path = write_family(tmp_path, "llama4_text", f"llama4_{wrong}", lambda t: t.replace(
        "chunked_attention: chunked}", f"chunked_attention: {wrong}}}\n    sliding_window: attention_chunk_size"))
    (result,) = check_family(path)
    assert not result.ok and result.failure.field == "block" and "block.mask" in str(result.failure)


def test_chunked_mask_needs_a_chunk_size(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "llama4_text", "llama4_nochunk",
                        lambda t: t.replace("    chunk_size: attention_chunk_size\n", ""))
    with pytest.raises(FamilyValidationError, match="chunk_size"):
        load_family(path)


def test_chunked_mask_is_plain_causal_without_a_chunk_size_value() -> None:
    cls = load_family("llama4_text")
    values = {**cls.family_spec.tiny_config, "attention_chunk_size": None}
    block = build_block(cls(**values), 0)
    assert block.settings.mask_kind == "causal" and block.settings.chunk_size is None
    assert build_block(cls(**cls.family_spec.tiny_config), 0).settings.chunk_size == 3


# --- buffers a layer computes itself ---------------------------------------------------------------------------


def test_meta_built_block_gets_the_buffers_the_model_computes() -> None:
    config, hf_config, _ = family_config("gpt_neo")
    model = hf_model(hf_config)
    for i in range(config.num_hidden_layers):
        block = build_block(config, i)  # on the meta device
        assert all(not p.is_meta for p in block.buffers())
        assert all(p.is_meta for p in block.parameters())
        expected = hf_layer(model, config, i).attn.attention.bias
        assert torch.equal(block.attn.attention.bias, expected), f"layer {i}"
    local, glob = build_block(config, 1), build_block(config, 0)
    assert not torch.equal(local.attn.attention.bias, glob.attn.attention.bias)  # the window is in the buffer
    assert materialize_buffers(local, config) == []  # nothing left to do


def test_load_block_fills_computed_buffers_and_matches_the_layer(tmp_path) -> None:
    config, hf_config, _ = family_config("gpt_neo")
    model = hf_model(hf_config)
    directory = save_checkpoint(model, tmp_path / "ckpt")
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i in range(config.num_hidden_layers):
        block = load_block(directory, config, i, dtype=torch.float32)
        with torch.no_grad():
            out, _ = block(hidden)
            mask = torch.full((9, 9), torch.finfo(torch.float32).min).triu(1)[None, None]
            expected = hf_layer(model, config, i)(hidden, attention_mask=mask)[0]
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


# --- ALiBi calling conventions ---------------------------------------------------------------------------------


def test_position_bias_convention_passes() -> None:
    results = check_family("mpt")
    assert len(results) == 2 and all(r.ok for r in results), [str(r.failure) for r in results]


MPT_EDITS = [
    ("mpt_default_alibi", lambda t: t.replace(
        "    alibi_arguments:              # as the model calls it: (n_heads, max_seq_len), default alibi_bias_max\n"
        "      num_heads: n_heads\n      sequence_length: max_seq_len\n", "")),
    ("mpt_float_mask", lambda t: t.replace("    boolean: masked\n", "")),
    ("mpt_attend_mask", lambda t: t.replace("    boolean: masked\n", "    boolean: attend\n")),
    ("mpt_no_bias", lambda t: t.replace("    alibi_argument: position_bias\n", "")),
]


@pytest.mark.parametrize(("name", "edit"), MPT_EDITS, ids=[n for n, _ in MPT_EDITS])
def test_wrong_position_bias_convention_fails(tmp_path, fresh_cache, name, edit) -> None:
    path = write_family(tmp_path, "mpt", name, edit)
    results = check_family(path)
    assert not results[0].ok
    assert results[0].failure.field in ("block", "block.position.rotary_class"), str(results[0].failure)


def test_alibi_arguments_see_the_key_length(tmp_path, fresh_cache) -> None:
    """A bias built for exactly the keys seen (kv_length) equals the model's sliced max_seq_len bias."""
    path = write_family(tmp_path, "mpt", "mpt_kv_length", lambda t: t.replace(
        "      sequence_length: max_seq_len\n", "    alibi_length_argument: sequence_length\n"))
    assert all(r.ok for r in check_family(path))
    slopes = write_family(tmp_path, "mpt", "mpt_slopes", lambda t: t.replace(  # slopes other than the model's
        "      sequence_length: max_seq_len\n", "      sequence_length: max_seq_len\n      alibi_bias_max: '4'\n"))
    results = check_family(slopes)
    assert not results[0].ok and results[0].failure.field == "block" and "differs" in str(results[0].failure)


def test_alibi_arguments_need_a_function(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "llama", "llama_alibi_args", lambda t: t.replace(
        "  position:\n", "  position:\n    alibi_arguments: {num_heads: num_attention_heads}\n"))
    with pytest.raises(FamilyValidationError, match="alibi_arguments needs alibi_function"):
        load_family(path)


# --- errors blame the real cause, each location once ------------------------------------------------------------


def test_validation_error_prints_its_location_once(tmp_path, fresh_cache, capsys) -> None:
    path = write_family(tmp_path, "llama", "llama_badkind", lambda t: t.replace(
        "  position:\n", "  mask:\n    kind: diagonal\n  position:\n"))
    (result,) = check_family(path)
    assert not result.ok and result.failure.field == "block.mask.kind"
    assert str(result.failure).count(str(path)) == 1
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count(str(path)) == 1 and err.count("block.mask.kind") == 1


def test_inconsistent_tiny_config_is_blamed_on_tiny_config(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "mpt", "mpt_heads", lambda t: t.replace("  n_heads: 4\n", "  n_heads: 5\n"))
    results = check_family(path)
    assert not results[0].ok and results[0].failure.field == "tiny_config", str(results[0].failure)


def test_computed_buffers_can_stay_on_meta_or_go_elsewhere() -> None:
    config, _, _ = family_config("gpt_neo")
    assert build_block(config, 1, buffers_device=None).attn.attention.bias.is_meta
    block = build_block(config, 1, buffers_device="cpu")
    assert block.attn.attention.bias.device.type == "cpu" and block.attn.attention.bias.dtype == torch.bool
