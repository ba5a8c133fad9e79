"""Drafter bugs found by sweeping transformers' causal-LM model types (issue 23), each pinned.

Configs are real transformers config classes' defaults (``save_pretrained`` of
``AutoConfig.for_model``), read back as ``distconf new`` reads them. Only shrinking and
the CLI's error path run here (no tiny model is built, except by the CLI tests).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from distconf.cli import main
from distconf.tools.drafting import read_config_json, shrink_config
from distconf.tools.drafting.fields import FieldNames, role_of


def _defaults(model_type: str, folder: Path, **overrides: object) -> dict:
    """The config.json transformers writes for ``model_type``'s defaults, read back by the drafter."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **overrides).save_pretrained(folder / model_type)
    return read_config_json(folder / model_type)


def _builds(model_type: str, config: dict) -> object:
    """The transformers config of a shrunk ``config`` (raises when the class refuses it)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **config)


def test_config_json_infinity_is_read_as_transformers_writes_it(tmp_path: Path) -> None:
    # before: time_step_limit stayed [0.0, {"__float__": "Infinity"}] and Mamba2Config refused it
    config = _defaults("mamba2", tmp_path)
    assert "__float__" in (tmp_path / "mamba2" / "config.json").read_text()
    low, high = config["time_step_limit"]
    assert low == 0.0 and math.isinf(high)
    nested = tmp_path / "nested.json"
    nested.write_text('{"model_type": "x", "a": {"b": [{"__float__": "-Infinity"}, {"__float__": "NaN"}]},'
                      ' "c": {"__float__": 1}}')
    data = read_config_json(nested)
    assert math.isinf(data["a"]["b"][0]) and data["a"]["b"][0] < 0 and math.isnan(data["a"]["b"][1])
    assert data["c"] == {"__float__": 1}  # not a tag transformers writes: left as it is


def test_a_non_finite_default_is_left_out_of_the_draft(tmp_path: Path) -> None:
    from transformers import Mamba2Config

    from distconf.tools.drafting.readable import architecture_fields

    facts: list[str] = []
    review: list[str] = []
    kept = architecture_fields({"time_step_limit": [0.0, math.inf], "hidden_size": 64}, Mamba2Config, facts,
                               review=review)
    assert "time_step_limit" not in kept and kept["hidden_size"] == 64
    assert any("time_step_limit" in fact and "default" in fact for fact in facts) and not review
    architecture_fields({"time_step_limit": [1.0, math.inf]}, Mamba2Config, facts, review=review)
    assert any("time_step_limit" in item for item in review)  # not the default: a reviewer must look


def test_an_index_list_that_names_every_layer_stays_an_index_list(tmp_path: Path) -> None:
    # before: lfm2's full_attn_idxs (every layer) was cut like a per-layer list into [0, 0, 0, 0, 0, 0]
    tiny = shrink_config(_defaults("lfm2", tmp_path))
    assert tiny["full_attn_idxs"] == list(range(tiny["num_hidden_layers"]))
    some = _defaults("lfm2", tmp_path, full_attn_idxs=[2, 5, 8, 10, 12, 14], layer_types=None)
    some.pop("layer_types", None)
    tiny = shrink_config(some)
    config = _builds("lfm2", tiny)
    assert "full_attention" in config.layer_types and "conv" in config.layer_types


def test_periods_and_offsets_of_layer_patterns_are_kept(tmp_path: Path) -> None:
    # before: jamba's attn_layer_period 8 became 1 (offset 1 not below period 1), expert_layer_period 2 became 4
    raw = _defaults("jamba", tmp_path)
    tiny = shrink_config(raw)
    for key in ("attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset"):
        assert tiny[key] == raw[key], key
    _builds("jamba", tiny)
    names = FieldNames.of(None)
    assert role_of("decoder_sparse_step", 1, names) == "layer_pattern"
    assert role_of("time_step_rank", 256, names) == "size"  # a rank is a width, whatever "step" says


def test_a_count_of_layers_is_not_a_window(tmp_path: Path) -> None:
    # before: max_window_layers 62 (of 62 layers) became the tiny window 4, on a 2-layer model
    raw = _defaults("dots1", tmp_path)
    tiny = shrink_config(raw)
    assert raw["max_window_layers"] == raw["num_hidden_layers"]
    assert tiny["max_window_layers"] == tiny["num_hidden_layers"]
    assert role_of("max_window_layers", 28, FieldNames.of(None)) == "layer_count"


def test_new_reports_a_model_transformers_cannot_build_in_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # before: dots1's defaults crashed `distconf new` with a 40-line traceback
    _defaults("dots1", tmp_path)
    code = main(["new", "dots1", "--from-config", str(tmp_path / "dots1"), "--out", str(tmp_path / "out") + "/"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "transformers cannot build the model" in err and "raised at modeling_dots1.py:" in err


def test_new_reports_a_rejected_config_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _defaults("jamba", tmp_path)
    path = tmp_path / "jamba" / "config.json"
    text = path.read_text()
    path.write_text(text.replace('"attn_layer_offset": 4', '"attn_layer_offset": 9'))  # the class refuses it
    code = main(["new", "jamba", "--from-config", str(tmp_path / "jamba"), "--out", str(tmp_path / "out") + "/"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "rejects this config.json" in err and "attention layer offset" in err


def test_a_variant_per_layer_type_the_architecture_names(tmp_path: Path) -> None:
    # before: lfm2's all-attention defaults and qwen3's windowless presets drafted no variant with conv / sliding layers
    from transformers import Lfm2Config, Qwen3Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from distconf.tools.drafting.named_variants import named_type_variants

    tiny = shrink_config(_defaults("lfm2", tmp_path))
    _, found = named_type_variants(Lfm2Config, Lfm2DecoderLayer, tiny, [])
    assert [(t, v["layer_types"][-1]) for t, v in found] == [("conv", "conv")]
    tiny = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}
    where, found = named_type_variants(Qwen3Config, Qwen3DecoderLayer, tiny, [])
    assert "modeling_qwen3" in where
    (layer_type, values), = found
    assert layer_type == "sliding_attention" and values["sliding_window"] == 4 and values["use_sliding_window"]
    assert named_type_variants(Qwen3Config, Qwen3DecoderLayer, tiny, [values])[1] == []  # covered: nothing more


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"])
def test_state_space_heads_keep_their_width(tmp_path: Path, model_type: str) -> None:
    # before: num_heads 128 stayed while head_dim shrank ("hidden_size * expand (128) must equal num_heads *
    # head_dim (2048)"); mamba_d_ssm 1024 stayed beside a 64-wide model
    from distconf.tools.drafting.fields import config_class_for
    from distconf.tools.drafting.shrink import head_pairs

    raw = _defaults(model_type, tmp_path)
    tiny = shrink_config(raw)
    pairs = head_pairs(raw, FieldNames.of(config_class_for(raw)))
    assert pairs, "no (heads, head size) pair found"
    for heads, size in pairs:
        assert tiny[heads] * tiny[size] * raw["hidden_size"] == raw[heads] * raw[size] * tiny["hidden_size"]
    _builds(model_type, tiny)  # the class's own consistency checks pass


@pytest.mark.parametrize("model_type", ["phi3", "starcoder2"])
def test_a_preset_with_a_sliding_window_gets_a_variant(tmp_path: Path, model_type: str) -> None:
    # before: the class defaults have no window, the shipped preset has one: check refused mask=sliding_window
    from distconf.tools.drafting import draft_family

    draft = draft_family(model_type, _defaults(model_type, tmp_path), run_tiny=False)
    assert draft.tiny_config.get("sliding_window") is None
    assert any(v.get("sliding_window") == 4 for v in draft.tiny_config["variants"]), draft.tiny_config


def test_a_model_reading_layer_types_through_its_layers_gets_a_per_layer_mask(tmp_path: Path) -> None:
    # before: dory's model maps masks by decoder_layer.attention_type (its forward never says layer_types): the
    # draft said "sliding on every layer" with a rotary per layer type, and did not validate
    from distconf.loader.source import read_family_file
    from distconf.tools.drafting import draft_family

    draft = draft_family("dory", _defaults("dory", tmp_path), run_tiny=False)
    assert draft.mask.get("layer_types_field") == "layer_types" and draft.position["rotary_layer_type_argument"]
    path = tmp_path / "dory.yaml"
    path.write_text(draft.to_yaml(schema_path="x"), encoding="utf-8")
    read_family_file(path)  # validates


def test_the_config_argument_is_the_parameter_that_takes_the_config() -> None:
    # before: openai-gpt's Block(n_positions, config, scale) drafted config_argument: n_positions
    from transformers.models.openai.modeling_openai import Block

    from distconf.tools.drafting.render import FamilyDraft
    from distconf.tools.drafting.sections import draft_constructor

    draft = FamilyDraft(family="x", model_type="openai-gpt", config_class="c", layer_class="l",
                        attention_class=None, prefix="h", base_model_prefix=None)
    draft_constructor(draft, Block)
    assert draft.constructor.get("config_argument", "config") == "config"
    assert any("n_positions" in item for item in draft.review)  # a required argument to map by hand


def test_a_kv_size_is_guessed_only_from_fields_that_mean_it() -> None:
    # before: 2 cached KV heads matched num_experts_per_tok: 2 on both tiny models (num_kv_heads: num_experts_per_tok)
    from transformers import Qwen3MoeConfig

    from distconf.tools.drafting.kv import _candidates

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
                            num_experts=4, head_dim=16, moe_intermediate_size=16, max_position_embeddings=16)
    raw = {"num_experts_per_tok": 2, "num_key_value_heads": 4, "max_position_embeddings": 16}
    assert _candidates(config, 2, raw, counts_heads=True) == []
    assert _candidates(config, 4, raw, counts_heads=True)[0] == "num_key_value_heads"
    assert "max_position_embeddings" not in _candidates(config, 16, raw)
    assert "head_dim" in _candidates(config, 16, raw)


@pytest.mark.parametrize(("model_type", "limit"), [("blt", 2_000_000), ("phi4_multimodal", 2_000_000)])
def test_nested_sub_configs_are_shrunk(tmp_path: Path, model_type: str, limit: int) -> None:
    # before: blt's patcher / encoder / global / decoder configs and phi4_multimodal's vision and audio configs kept
    # their real sizes: "tiny" models of 1.56 G and 870 M parameters
    import torch
    from transformers import AutoModelForCausalLM

    tiny = shrink_config(_defaults(model_type, tmp_path))
    config = _builds(model_type, tiny)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) < limit
    if model_type == "blt":  # a size named after a sibling sub-config is that sub-config's tiny size
        assert tiny["encoder_config"]["hidden_size_global"] == tiny["global_config"]["hidden_size"]


def test_allow_skip_false_when_the_attention_reads_the_mask() -> None:
    # before: doge's attention combines the mask with a dynamic mask of its own; the draft let sdpa skip it
    # (block 0 differed from the model by 0.7)
    from transformers.models.doge.modeling_doge import DogeAttention, DogeDecoderLayer
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    from distconf.tools.drafting.render import FamilyDraft
    from distconf.tools.drafting.sections import draft_mask_skip

    def drafted(*classes: type) -> dict:
        draft = FamilyDraft(family="x", model_type="x", config_class="c", layer_class="l", attention_class=None,
                            prefix="model.layers", base_model_prefix=None)
        draft_mask_skip(draft, *classes)
        return draft.mask

    assert drafted(DogeAttention, DogeDecoderLayer) == {"allow_skip": False}
    assert drafted(LlamaAttention, LlamaDecoderLayer) == {}
