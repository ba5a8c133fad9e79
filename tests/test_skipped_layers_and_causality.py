"""Layers the model skips for token ids alone (mllama: cross-attention layers) and a model that is not causal (cpmant):
what the family file must name, what the check and a server session prove."""

from __future__ import annotations

from pathlib import Path

import pytest

from distconf import FamilyValidationError
from distconf.loader.source import read_family_file


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


_SKIPPED_BLOCK = ("  layer_classes:\n    cross_attention: "
                  "transformers.models.mllama.modeling_mllama.MllamaCrossAttentionDecoderLayer\n"
                  "  skipped_layer_kinds: [cross_attention]\n  mask:\n    layer_index_fields:\n"
                  "      cross_attention: cross_attention_layers\n  position:\n    rotary_class: "
                  "transformers.models.mllama.modeling_mllama.MllamaRotaryEmbedding\n")


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


def test_a_skipped_layer_keeps_nothing_and_passes_hidden_states(tmp_path: Path, fresh_cache: None) -> None:
    """Block 1 (a cross-attention layer) keeps no cache and returns its input; KV sizing counts the others."""
    import torch

    from distconf import load_family
    from distconf.blocks.build import build_block
    from distconf.blocks.layer_types import keeps_kv_at, layer_type

    path = _family(tmp_path, _SKIPPED_BLOCK)
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


# cpmant attends bidirectionally over its whole input (context=1 for every token): no step-by-step run of blocks
# gives its full-sequence outputs, whatever its position bias; drafter and check say so in one line
_CPMANT = """family: cpmant
model_type: cpmant
config_class: transformers.CpmAntConfig
block:
  layer_class: transformers.models.cpmant.modeling_cpmant.CpmAntTransformerBlock
  attention_class: transformers.models.cpmant.modeling_cpmant.CpmAntSelfAttentionBlock
  prefix: cpmant.encoder.layers
  base_model_prefix: cpmant
  attn_implementation: eager
  call:
    position_ids_argument: null
    position_embeddings_argument: null
kv_groups: 1
dht_prefix:
  name: repo
tiny_config:
  dim_ff: 160
  dim_head: 16
  hidden_size: 64
  num_attention_heads: 4
  num_hidden_layers: 2
  prompt_length: 4
  vocab_size: 256
"""


def test_check_names_a_model_that_is_not_causal(tmp_path: Path) -> None:
    from distconf.tools.checker.run import check_family

    path = tmp_path / "cpmant.yaml"
    path.write_text(_CPMANT, encoding="utf-8")
    (result,) = check_family(path)
    assert result.failure is not None and result.failure.field == "block", result.failure
    assert "the model is not causal" in str(result.failure), result.failure


def test_a_causal_model_does_not_change_its_first_outputs() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from distconf.tools.checker.causal import later_tokens_change

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=256)).eval()
    change = later_tokens_change(model, 256)
    assert change is not None and change < 1e-5


def test_a_server_session_runs_a_chain_with_a_skipped_layer(tmp_path: Path, fresh_cache: None) -> None:
    """A session (prefill, decode steps, a beam reorder) through blocks 0-2 of a tiny mllama text model: the
    skipped cross-attention block is sized at no cache, and every output equals the chain run by hand."""
    import torch
    from sessionhelpers import served, steps

    from distconf import load_family
    from distconf.blocks.build import build_block
    from distconf.blocks.sizing import kv_cache_bytes_per_token
    from distconf.server.session_cache import SessionCache

    cls = load_family(_family(tmp_path, _SKIPPED_BLOCK))
    config = cls(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=3, cross_attention_layers=[1], vocab_size=256)
    sizes = [kv_cache_bytes_per_token(config, torch.float32, i) for i in range(3)]
    assert sizes[1] == 0 and sizes[0] == sizes[2] > 0
    torch.manual_seed(0)
    blocks = [build_block(config, i, device="cpu") for i in range(3)]
    hidden = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(3))
    expected, _ = steps(blocks, hidden, [7])
    cache = SessionCache(served(config, blocks), 3, 16)
    cache.allocate()
    try:
        no_prompts = [None] * 3
        outputs = [cache.step(hidden[:, :4], no_prompts, None)]
        outputs += [cache.step(hidden[:, i:i + 1], no_prompts, None) for i in range(4, 7)]
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)
        hypo_ids = torch.tensor([2, 0, 0])
        nxt = torch.randn(3, 1, 64)
        ref, _ = steps(blocks, torch.cat([hidden[hypo_ids], nxt], dim=1), [8])
        torch.testing.assert_close(cache.step(nxt, no_prompts, hypo_ids), ref[:, 7:], rtol=1e-5, atol=1e-5)
    finally:
        cache.release()
