"""Every layer kind of the real model runs in the check: the tiny variants must cover them all."""

from __future__ import annotations

import pytest
from blockhelpers import write_family

from distconf.cli import main
from distconf.loader import load_family
from distconf.loader.data import builtin_families_dir
from distconf.tools.checker import check_family
from distconf.tools.checker.kinds import coverage, layer_kinds, real_configs

BUILTIN = sorted(p.stem for p in builtin_families_dir().glob("*.yaml"))


@pytest.mark.parametrize("family", BUILTIN)
def test_tiny_variants_cover_every_layer_kind_of_the_preset(family: str) -> None:
    cls = load_family(family)
    kinds = coverage(cls)
    assert kinds.real, "no layer kinds found"
    # a kind comes from a preset, or is a layer type the architecture's modeling code names (that no preset sets)
    assert all(source.startswith(("preset ", "layer type ")) for source in kinds.real.values()), kinds.real
    assert kinds.missing == [], f"{family}: tiny variants never run {kinds.missing}"


def test_kinds_read_per_layer_lists_masks_and_structure() -> None:
    """Per-layer lists, the resolved mask and the block's submodules all become labels (no family knowledge)."""
    cls = load_family("llama4_text")
    (name, real), = real_configs(cls)
    assert name == "preset meta-llama/Llama-4-Scout-17B-16E"
    labels = set().union(*layer_kinds(real))
    assert {"mask=chunked", "mask=causal", "layer_types=chunked_attention", "layer_types=full_attention",
            "no_rope_layers=0", "no_rope_layers=1", "feed_forward:Llama4TextMoe"} <= labels
    assert "feed_forward:Llama4TextMLP" not in labels  # Scout routes every layer
    neo = set().union(*layer_kinds(real_configs(load_family("gpt_neo"))[0][1]))
    assert {"attention_layers=global", "attention_layers=local", "position=none"} <= neo
    moe = layer_kinds(real_configs(load_family("deepseek_v2"))[0][1])
    assert "mlp:DeepseekV2MLP" in moe[0] and "mlp:DeepseekV2Moe" in moe[1]  # first_k_dense_replace: 1


PATTERN = """\
family: {name}
model_type: gemma3_text
config_class: transformers.Gemma3TextConfig
block:
  layer_class: transformers.models.gemma3.modeling_gemma3.Gemma3DecoderLayer
  attention_class: transformers.models.gemma3.modeling_gemma3.Gemma3Attention
  prefix: model.layers
  position:
    rotary_class: transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding
    rotary_layer_type_argument: true
  mask:
    layer_types_field: layer_types
    sliding_window: sliding_window
    layer_kinds: {{sliding_attention: sliding_window, full_attention: {full}}}
kv_groups: num_attention_heads // num_key_value_heads
dht_prefix: {{name: repo}}
tiny_config:
  vocab_size: 128
  hidden_size: 64
  intermediate_size: 96
  num_hidden_layers: {layers}
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 32
  sliding_window: 3
  sliding_window_pattern: 3     # one full-attention layer every 3
  query_pre_attn_scalar: 32
  rope_parameters:
    sliding_attention: {{rope_type: default, rope_theta: 10000.0}}
    full_attention: {{rope_type: default, rope_theta: 1000000.0}}
"""


def test_wrong_mask_on_a_pattern_family_fails_when_the_tiny_config_skips_a_kind(tmp_path, fresh_cache, capsys) -> None:
    """2 tiny layers of a 1-in-3 pattern are both sliding: the wrong full-attention mask never runs."""
    path = tmp_path / "pattern_short.yaml"
    path.write_text(PATTERN.format(name="pattern_short", full="sliding_window", layers=2))
    (result,) = check_family(path)
    assert result.full_diff is not None and result.full_diff <= 1e-5  # the layers it ran do match
    assert not result.ok and result.failure.field == "tiny_config"
    message = str(result.failure)
    assert "layer_types=full_attention" in message and "preset google/gemma-3-270m" in message
    assert str(path) in message
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    assert "layer kinds not covered" in captured.out and "layer_types=full_attention" in captured.err

    deep = tmp_path / "pattern_deep.yaml"  # three tiny layers run the full layer: the wrong mask is caught
    deep.write_text(PATTERN.format(name="pattern_deep", full="sliding_window", layers=3))
    (result,) = check_family(deep)
    assert not result.ok and result.failure.field == "block" and "block.mask" in str(result.failure)

    right = tmp_path / "pattern_right.yaml"
    right.write_text(PATTERN.format(name="pattern_right", full="causal", layers=3))
    (result,) = check_family(right)
    assert result.ok, result.failure
    assert result.kinds == "11/11 layer kinds of preset google/gemma-3-270m covered"


def test_a_preset_kind_missing_from_the_tiny_config_fails(tmp_path, fresh_cache) -> None:
    """gpt_neo's tiny model cut to global layers only: the preset's local layers never run."""
    path = write_family(tmp_path, "gpt_neo", "gpt_neo_global",
                        lambda t: t.replace("attention_types: [[[global, local], 2]]",
                                            "attention_types: [[[global], 4]]"))
    (result,) = check_family(path)
    assert not result.ok and result.failure.field == "tiny_config"
    assert "attention_layers=local (in preset EleutherAI/gpt-neo-1.3B)" in str(result.failure)
