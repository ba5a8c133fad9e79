"""Sweep fixes (h2, round 25): layers the model skips for token ids alone (cross-attention layers listed by index)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sweephelpers import draft_and_check

from distconf import FamilyValidationError
from distconf.loader.source import read_family_file


def test_mllama_drafts_its_cross_attention_layers_as_skipped(tmp_path: Path) -> None:
    """The text model's cross-attention layers (listed in cross_attention_layers) are their own layer type, which
    the model skips without image input; the check proves the blocks pass hidden states through there."""
    code, draft = draft_and_check("mllama", tmp_path)
    assert code == 0, draft
    assert "cross_attention: cross_attention_layers" in draft
    assert re.search(r"skipped_layer_kinds:\n  - cross_attention", draft), draft


def _family(tmp_path: Path, block_extra: str) -> Path:
    text = f"""family: skiptest
model_type: mllama_text_model
config_class: transformers.MllamaTextConfig
block:
  layer_class: transformers.models.mllama.modeling_mllama.MllamaSelfAttentionDecoderLayer
  attention_class: transformers.models.mllama.modeling_mllama.MllamaTextSelfAttention
  prefix: model.layers
{block_extra}kv_groups: num_attention_heads // num_key_value_heads
dht_prefix:
  name: repo
"""
    path = tmp_path / "skiptest.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _problem(path: Path):
    with pytest.raises(FamilyValidationError) as info:
        read_family_file(path)
    (problem,) = info.value.problems
    return problem


def test_a_skipped_type_nothing_names_is_refused_at_its_field(tmp_path: Path) -> None:
    path = _family(tmp_path, "  skipped_layer_kinds: [cros_attention]\n  mask:\n    layer_index_fields:\n"
                             "      cross_attention: cross_attention_layers\n")
    problem = _problem(path)
    assert problem.field == "block.skipped_layer_kinds", problem
    assert "'cros_attention'" in problem.message and "'cross_attention'" in problem.message, problem.message


def test_skipped_types_need_a_field_naming_layer_types(tmp_path: Path) -> None:
    problem = _problem(_family(tmp_path, "  skipped_layer_kinds: [cross_attention]\n"))
    assert problem.field == "block.skipped_layer_kinds", problem
    assert "layer_index_fields" in problem.message


def test_an_index_field_must_be_an_identifier(tmp_path: Path) -> None:
    problem = _problem(_family(tmp_path, "  mask:\n    layer_index_fields:\n      cross_attention: 'not a field'\n"))
    assert problem.field.startswith("block.mask.layer_index_fields"), problem


def test_a_skipped_layer_keeps_nothing_and_passes_hidden_states(tmp_path: Path) -> None:
    """Block 1 (a cross-attention layer) keeps no cache and returns its input; KV sizing counts the others."""
    import torch

    from distconf import load_family
    from distconf.blocks.build import build_block
    from distconf.blocks.layer_types import keeps_kv_at, layer_type

    path = _family(tmp_path, "  layer_classes:\n    cross_attention: "
                             "transformers.models.mllama.modeling_mllama.MllamaCrossAttentionDecoderLayer\n"
                             "  skipped_layer_kinds: [cross_attention]\n  mask:\n    layer_index_fields:\n"
                             "      cross_attention: cross_attention_layers\n")
    cls = load_family(path)
    config = cls(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=3, cross_attention_layers=[1], vocab_size=256)
    assert [layer_type(config, i) for i in range(3)] == [None, "cross_attention", None]
    assert [keeps_kv_at(config, i) for i in range(3)] == [True, False, True]
    block = build_block(config, 1, device="cpu")
    assert type(block).layer_class.__name__ == "MllamaCrossAttentionDecoderLayer"
    hidden = torch.randn(1, 4, 64)
    out, present = block(hidden, use_cache=True)
    assert present is None and torch.equal(out, hidden)
