"""``distconf check`` bugs found by the issue-23 sweep, each pinned: one precise located line per failure."""

from __future__ import annotations

import pytest
from blockhelpers import write_family

from distconf.cli import main
from distconf.tools.checker import check_family


def test_an_unimportable_attention_class_is_located_once(tmp_path, fresh_cache, capsys) -> None:
    # before: "x.yaml:14:3: block.attention_class: x.yaml:14:3: block.attention_class: cannot import ..."
    path = write_family(tmp_path, "llama", "llama_noattn",
                        lambda t: t.replace("modeling_llama.LlamaAttention", "modeling_llama.NoSuchAttention"))
    failure = next(r.failure for r in check_family(path) if not r.ok)
    assert failure.field == "block.attention_class"
    assert str(failure).count(str(path)) == 1 and str(failure).count("block.attention_class") == 1, str(failure)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(str(path)) == 1, err


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("family: llama_bad\n", "family: llama_bad\nunknown_section: 1\n"),
    lambda t: t.replace("  prefix: model.layers\n", "  prefix: [model.layers]\n"),
])
def test_check_of_an_invalid_file_is_one_located_failure(tmp_path, fresh_cache, capsys, edit) -> None:
    path = write_family(tmp_path, "llama", "llama_bad", edit)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}:" in err, err


LFM2_ALL_ATTENTION = """\
family: lfm2_attention_only
model_type: lfm2
config_class: transformers.Lfm2Config
block:
  layer_class: transformers.models.lfm2.modeling_lfm2.Lfm2DecoderLayer
  attention_class: transformers.models.lfm2.modeling_lfm2.Lfm2Attention
  prefix: model.layers
  base_model_prefix: model
  position:
    rotary_class: transformers.models.lfm2.modeling_lfm2.Lfm2RotaryEmbedding
  mask:
    layer_types_field: layer_types
    layer_kinds:
      full_attention: causal
kv_groups: num_attention_heads // num_key_value_heads
dht_prefix:
  name: repo
tiny_config:
  hidden_size: 64
  intermediate_size: 128
  num_attention_heads: 4
  num_hidden_layers: 2
  num_key_value_heads: 2
  full_attn_idxs: [0, 1]
  max_position_embeddings: 128
  vocab_size: 256
"""


def test_check_refuses_a_family_that_never_runs_a_layer_type_of_its_architecture(tmp_path, fresh_cache) -> None:
    # before: lfm2's default config is all attention, so `check` passed without ever running a conv layer
    path = tmp_path / "lfm2_attention_only.yaml"
    path.write_text(LFM2_ALL_ATTENTION, encoding="utf-8")
    results = check_family(path)
    failure = next(r.failure for r in results if not r.ok)
    assert failure.field == "block.mask.layer_kinds" and "'conv'" in str(failure), str(failure)
    assert str(path) in str(failure)


def test_check_refuses_sliding_layers_no_variant_runs(tmp_path, fresh_cache) -> None:
    # qwen3's presets have no sliding layers, its architecture has: a family without a sliding variant fails
    path = write_family(tmp_path, "qwen3", "qwen3_nosliding", lambda t: t.split("  variants:")[0])
    from distconf.loader import load_family
    from distconf.tools.checker.failures import CheckFailure
    from distconf.tools.checker.kinds import check_coverage

    with pytest.raises(CheckFailure) as caught:
        check_coverage(load_family(path))
    assert caught.value.field == "tiny_config" and "layer_types=sliding_attention" in str(caught.value)
    check_coverage(load_family("qwen3"))  # the built-in family runs them


def test_kv_geometry_per_layer_kind_is_named_not_blamed_on_layer_writes(tmp_path, fresh_cache) -> None:
    # before: "blocks cache 4 KV heads but the family declares 2 (the layer writes every KV head once per query
    # head: set kv_cache.layer_writes: repeat_interleave)" for mimo_v2_flash, whose sliding layers cache 2x the heads
    from transformers import AutoConfig

    from distconf.tools.drafting import draft_family, read_config_json

    AutoConfig.for_model("mimo_v2_flash").save_pretrained(tmp_path / "cfg")
    draft = draft_family("mimo_v2_flash", read_config_json(tmp_path / "cfg"))
    del draft.kv_cache["layer_overrides"]  # the drafter writes them; without them check must name the cause
    path = tmp_path / "mimo_v2_flash.yaml"
    path.write_text(draft.to_yaml(schema_path="x"), encoding="utf-8")
    failure = next(r.failure for r in check_family(path) if not r.ok)
    assert failure.field == "kv_cache" and "differs per layer kind" in str(failure), str(failure)
    assert "repeat_interleave" not in str(failure)


def test_an_unmapped_layer_type_is_a_located_failure(tmp_path, fresh_cache) -> None:
    # the issue saw an AttributeError (family_source) here; building the block and checking it both name the field
    from distconf.blocks import build_block
    from distconf.errors import FamilyValidationError
    from distconf.loader import load_family

    path = write_family(tmp_path, "qwen2", "qwen2_unmapped", lambda t: t.replace(
        "  max_window_layers: 1\n", "  max_window_layers: 1\n  layer_types: [full_attention, linear_attention, "
        "full_attention]\n"))
    cls = load_family(path)
    config = cls(**{k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"})
    with pytest.raises(FamilyValidationError) as caught:
        build_block(config, 1)
    problem = caught.value.problems[0]
    assert problem.field == "block.mask.layer_kinds" and "'linear_attention'" in problem.message
    failure = next(r.failure for r in check_family(path) if not r.ok)
    assert failure.field == "block.mask.layer_kinds", str(failure)


def test_kv_geometry_per_layer_kind_is_declared_by_layer_overrides(tmp_path, fresh_cache) -> None:
    """The draft declares its sliding layers' KV heads (``kv_cache.layer_overrides``) and passes."""
    from transformers import AutoConfig

    from distconf.blocks.kvcache import kv_geometry
    from distconf.loader import load_family
    from distconf.tools.drafting import draft_family, read_config_json

    AutoConfig.for_model("mimo_v2_flash").save_pretrained(tmp_path / "cfg")
    draft = draft_family("mimo_v2_flash", read_config_json(tmp_path / "cfg"))
    text = draft.to_yaml(schema_path="x")
    # the drafter reads the sliding layers' geometry off two tiny models
    assert "  layer_overrides:\n    sliding_attention:\n      num_kv_heads: 2 * (num_key_value_heads)\n" in text
    path = tmp_path / "mimo_v2_flash.yaml"
    path.write_text(text, encoding="utf-8")
    results = check_family(path)
    assert all(r.ok for r in results), [str(r.failure) for r in results]
    cls = load_family(path)
    tiny = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    config = cls(**tiny)
    kinds = list(config.layer_types)
    assert "sliding_attention" in kinds
    heads = [kv_geometry(config, i).num_kv_heads for i in range(len(kinds))]
    assert heads == [(2 if k == "sliding_attention" else 1) * config.num_key_value_heads for k in kinds]
    assert kv_geometry(config).num_kv_heads == 2 * config.num_key_value_heads  # the family's largest
