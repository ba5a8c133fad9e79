"""``distconf check`` passes the built-in families and names the field of a wrong one."""

from __future__ import annotations

import re

import pytest
from blockhelpers import falcon_caches_expanded_heads, write_family

from distconf.cli import main
from distconf.tools.checker import check_family, tiny_variants


@pytest.mark.slow
def test_check_all_builtin_families(capsys) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    for family in ("bloom", "falcon", "llama", "mixtral"):
        assert family in out
    passed = re.search(r"(\d+)/(\d+) variant\(s\) passed", out)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(1)) >= 7
    assert "new_decoder_architecture=True" in out and "multi_query=True" in out


def test_check_reports_measurements() -> None:
    (result,) = check_family("llama")
    assert result.ok, result.failure
    assert result.layers == 3 and result.shards >= 2
    assert result.full_diff is not None and result.full_diff <= 1e-5
    assert result.incremental_diff is not None and result.incremental_diff <= 1e-5
    assert result.kv_declared == result.kv_actual == 2 * 2 * 16 * 4  # 2 KV heads x (16 + 16) x fp32
    assert result.size_declared == result.size_actual


def test_tiny_variants_apply_on_the_base() -> None:
    variants = tiny_variants({"a": 1, "b": 2, "variants": [{"b": 3}, {"a": 0, "c": 1}]})
    assert variants == [("b=3", {"a": 1, "b": 3}), ("a=0,c=1", {"a": 0, "b": 2, "c": 1})]
    assert tiny_variants({"a": 1, "variants": [{}]}) == [("base", {"a": 1})]
    assert tiny_variants({"a": 1}) == [("tiny", {"a": 1})]


BROKEN = [
    # (source family, edit, field the failure must name)
    ("llama", lambda t: t.replace("  prefix: model.layers\n", "  prefix: model.blocks\n"), "block.prefix"),
    ("bloom", lambda t: t.replace("  prefix: h\n", "  prefix: transformer.blocks\n"), "block.prefix"),
    ("llama", lambda t: t.replace("kv_cache: {}\n", "kv_cache:\n  num_kv_heads: num_attention_heads\n"),
     "kv_cache.num_kv_heads"),
    ("llama", lambda t: t.replace("kv_cache: {}\n", "kv_cache:\n  key_head_dim: hidden_size // 2\n"),
     "kv_cache.key_head_dim"),
    ("mixtral", lambda t: t.replace("kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: 1"),
     "kv_groups"),
    ("falcon", lambda t: t.replace("  layer_writes: repeat_interleave\n", "  layer_writes: kv_heads\n"),
     "kv_groups"),
    ("llama", lambda t: t.replace("modeling_llama.LlamaAttention", "modeling_llama.LlamaMLP"),
     "block.attention_class"),
    ("mixtral", lambda t: t.replace("modeling_mixtral.MixtralAttention", "modeling_llama.LlamaAttention"),
     "block.attention_class"),
    ("llama", lambda t: t.replace("modeling_llama.LlamaDecoderLayer", "modeling_mistral.MistralDecoderLayer"),
     "block.layer_class"),
    ("bloom", lambda t: t.replace("    alibi_argument: alibi\n", "    alibi_argument: position_bias\n"), "block"),
    ("llama", lambda t: t.split("tiny_config:")[0], "tiny_config"),
    ("gpt_neox", lambda t: t.replace("cache_argument: layer_past", "cache_argument: cache"),
     "block.call.cache_argument"),
    ("qwen3", lambda t: t.replace(
        "  position:\n    rotary_class: transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding\n", ""),
     "block.position.rotary_class"),
    ("deepseek_v2", lambda t: t.replace("kv_cache:\n  num_kv_heads: 1\n  key_head_dim: kv_lora_rank\n"
                                        "  value_head_dim: qk_rope_head_dim\n", ""), "kv_groups"),
    # per-sequence state: a wrong shape is named by its field
    ("mamba2", lambda t: t.replace("state_size\", conv_kernel]", "state_size\", 2]"), "state.conv_shape"),
    ("mamba2", lambda t: t.replace("[num_heads, head_dim, state_size]", "[num_heads, head_dim, n_groups]"),
     "state.recurrent_shape"),
    ("mamba2", lambda t: t.replace("    cache_argument: cache\n", "    cache_argument: cache_params_x\n"),
     "block.call.cache_argument"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("source", "edit", "field"), BROKEN,
                         ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(BROKEN)])
def test_check_fails_on_wrong_family_file(tmp_path, fresh_cache, capsys, source, edit, field) -> None:
    path = write_family(tmp_path, source, f"{source}_broken", edit)
    results = check_family(path)
    failures = [r for r in results if not r.ok]
    if source == "falcon" and not falcon_caches_expanded_heads():  # transformers >= 5.25: both layouts are right
        assert not failures, [str(r.failure) for r in failures]
        return
    assert failures, "a wrong family file passed the check"
    failure = failures[0].failure
    assert failure.field == field, str(failure)
    assert str(path) in str(failure)  # located in the family file
    if source == "deepseek_v2":
        assert "kv_cache.num_kv_heads" in str(failure)  # the hint names the section to add

    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert field in err


def test_falcon_hint_for_expanded_cache(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "falcon", "falcon_expanded",
                        lambda t: t.replace("  layer_writes: repeat_interleave\n", "  layer_writes: kv_heads\n"))
    (first, second, third) = check_family(path)
    assert second.ok and third.ok  # multi-query and multi-head layers write their real heads
    if not falcon_caches_expanded_heads():  # transformers >= 5.25 writes the 2 KV heads: nothing to hint
        assert first.ok and first.kv_declared == first.kv_actual == 128
        return
    assert not first.ok and "set kv_cache.layer_writes: repeat_interleave" in str(first.failure)
    assert first.kv_declared == 128 and first.kv_actual == 512  # 2 KV heads declared, 8 cached


PER_LAYER = """\
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
{mask}
kv_groups: num_attention_heads // num_key_value_heads
dht_prefix: {{name: repo}}
tiny_config:
  vocab_size: 128
  hidden_size: 64
  intermediate_size: 96
  num_hidden_layers: 3
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 32
  sliding_window: 3
  query_pre_attn_scalar: 32
  layer_types: [sliding_attention, full_attention, sliding_attention]
  rope_parameters:
    sliding_attention: {{rope_type: default, rope_theta: 10000.0}}
    full_attention: {{rope_type: linear, factor: 8.0, rope_theta: 1000000.0}}
"""


def test_per_layer_mask_and_rotary_knobs(tmp_path, fresh_cache) -> None:
    """Alternating sliding/full layers with per-layer-type rotary: described by knobs alone."""
    good = tmp_path / "per_layer_good.yaml"
    good.write_text(PER_LAYER.format(name="per_layer_good", mask="    layer_types_field: layer_types\n"
                                                                 "    sliding_window: sliding_window"))
    (result,) = check_family(good)
    assert result.ok, result.failure
    bad = tmp_path / "per_layer_bad.yaml"  # sliding layers treated as full attention
    bad.write_text(PER_LAYER.format(name="per_layer_bad", mask="    layer_types_field: layer_types\n"
                                    "    layer_kinds: {sliding_attention: causal, full_attention: causal}"))
    (result,) = check_family(bad)
    assert not result.ok and result.failure.field == "block"
    assert "block.mask" in str(result.failure)
    missing = tmp_path / "per_layer_missing.yaml"  # rotary by layer type needs the layer types
    missing.write_text(PER_LAYER.format(name="per_layer_missing", mask="    kind: causal"))
    (result,) = check_family(missing)
    assert not result.ok and "mask.layer_types_field" in str(result.failure)


def test_check_prints_layer_kind_coverage(capsys) -> None:
    assert main(["check", "gpt_neo"]) == 0
    out = capsys.readouterr().out
    assert "gpt_neo: 8/8 layer kinds of preset EleutherAI/gpt-neo-1.3B covered" in out
