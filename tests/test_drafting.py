"""``distconf new`` / `distconf.drafting`: drafts from real configs are right, valid and pass ``check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distconf.cli import main
from distconf.tools.drafting import DraftingError, draft_family, read_config_json, shrink_config

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "presets"
GQA = "num_attention_heads // num_key_value_heads"
LAYER_TYPES_MASK = {"layer_types_field": "layer_types", "sliding_window": "sliding_window"}
WINDOW_MASK = {"kind": "sliding_window", "sliding_window": "sliding_window"}

# preset -> (layer class, attention class, prefix, mask, kv_groups, kv_cache, extra expectations)
EXPECTED = {
    "Qwen--Qwen2-7B": ("Qwen2DecoderLayer", "Qwen2Attention", "model.layers", LAYER_TYPES_MASK, GQA, {}, {}),
    "Qwen--Qwen3-4B": ("Qwen3DecoderLayer", "Qwen3Attention", "model.layers", LAYER_TYPES_MASK, GQA, {}, {}),
    "mistralai--Mistral-7B-v0.1": ("MistralDecoderLayer", "MistralAttention", "model.layers", WINDOW_MASK, GQA,
                                   {}, {}),
    "google--gemma-2-9b": ("Gemma2DecoderLayer", "Gemma2Attention", "model.layers", LAYER_TYPES_MASK, GQA, {},
                           {"attn_implementation": "eager"}),
    "Qwen--Qwen3-30B-A3B": ("Qwen3MoeDecoderLayer", "Qwen3MoeAttention", "model.layers", WINDOW_MASK, GQA, {}, {}),
    "deepseek-ai--DeepSeek-V2-Lite": (
        "DeepseekV2DecoderLayer", "DeepseekV2Attention", "model.layers", {}, GQA,
        {"num_kv_heads": 1, "key_head_dim": "kv_lora_rank", "value_head_dim": "qk_rope_head_dim"}, {}),
    "microsoft--Phi-3-mini-4k-instruct": ("Phi3DecoderLayer", "Phi3Attention", "model.layers", WINDOW_MASK, GQA,
                                          {}, {}),
    "ibm-granite--granite-3.3-8b-instruct": ("GraniteDecoderLayer", "GraniteAttention", "model.layers", {}, GQA,
                                             {}, {}),
    "bigcode--starcoder2-7b": ("Starcoder2DecoderLayer", "Starcoder2Attention", "model.layers", WINDOW_MASK, GQA,
                               {}, {}),
    "EleutherAI--gpt-neox-20b": ("GPTNeoXLayer", "GPTNeoXAttention", "gpt_neox.layers", {}, 1, {},
                                 {"call": {"cache_argument": "layer_past"}, "base_model_prefix": "gpt_neox"}),
}


def _preset(name: str) -> dict:
    return json.loads((PRESETS / f"{name}.json").read_text(encoding="utf-8"))


def _write_draft(tmp_path: Path, family: str, preset: str) -> Path:
    draft = draft_family(family, _preset(preset))
    path = tmp_path / f"{family}.yaml"
    path.write_text(draft.to_yaml(), encoding="utf-8")
    return path


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_draft_finds_the_family_structure(preset: str, tmp_path: Path, fresh_cache: None) -> None:
    layer, attention, prefix, mask, kv_groups, kv_cache, extra = EXPECTED[preset]
    family = "drafted_" + _preset(preset)["model_type"]
    draft = draft_family(family, _preset(preset))
    assert draft.layer_class.endswith("." + layer)
    assert draft.attention_class is not None and draft.attention_class.endswith("." + attention)
    assert draft.prefix == prefix
    assert draft.mask == mask
    assert draft.kv_groups == kv_groups
    assert draft.kv_cache == kv_cache
    assert draft.position.get("rotary_class", "").endswith("RotaryEmbedding")
    for key, value in extra.items():
        assert getattr(draft, key) == value
    assert draft.review == [], draft.review  # nothing left to a human for these families

    # the rendered file validates, synthesizes a class, and its tiny config builds
    path = tmp_path / f"{family}.yaml"
    path.write_text(draft.to_yaml(), encoding="utf-8")
    from distconf.loader import load_family, read_family_file

    spec = read_family_file(path).spec
    assert spec.block.prefix == prefix and spec.model_type == _preset(preset)["model_type"]
    cls = load_family(path)
    tiny = cls(**spec.tiny_config)
    assert tiny.hidden_size == 64 and tiny.vocab_size == 256 and tiny.num_hidden_layers in (2, 3)


@pytest.mark.parametrize("preset", ["Qwen--Qwen3-4B", "google--gemma-2-9b", "deepseek-ai--DeepSeek-V2-Lite",
                                    "EleutherAI--gpt-neox-20b", "Qwen--Qwen3-30B-A3B",
                                    "microsoft--Phi-3-mini-4k-instruct"])
def test_drafted_family_passes_check(preset: str, tmp_path: Path, fresh_cache: None) -> None:
    from distconf.tools.checker import check_family

    path = _write_draft(tmp_path, "drafted_" + _preset(preset)["model_type"], preset)
    results = check_family(path)
    assert results and all(r.ok for r in results), [r.failure for r in results]


def test_draft_yaml_has_findings_and_reviews_as_comments(tmp_path: Path) -> None:
    draft = draft_family("drafted_neox", _preset("EleutherAI--gpt-neox-20b"))
    draft.review.append("an example item")
    text = draft.to_yaml()
    assert text.startswith("# yaml-language-server: $schema=")
    assert "# the layer takes its cache as 'layer_past'" in text
    assert "# TODO review: an example item" in text
    assert "cache_argument: layer_past" in text


# ---------------------------------------------------------------- shrinking (no torch needed)


def test_shrink_keeps_proportions_that_matter() -> None:
    review: list[str] = []
    tiny = shrink_config({
        "model_type": "x", "architectures": ["XForCausalLM"], "torch_dtype": "bfloat16", "hidden_size": 2560,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
        "num_hidden_layers": 36, "vocab_size": 151936, "max_position_embeddings": 40960, "eos_token_id": 151645,
        "pad_token_id": None, "attention_dropout": 0.1, "attention_bias": True, "quantization_config": {"bits": 4},
    }, review)
    assert tiny["hidden_size"] == 64 and tiny["num_attention_heads"] == 4
    assert tiny["num_key_value_heads"] == 2  # GQA stays GQA
    assert tiny["head_dim"] == 32  # explicit head_dim stays != hidden / heads (16)
    assert tiny["num_hidden_layers"] == 2 and tiny["vocab_size"] == 256 and tiny["intermediate_size"] == 128
    assert tiny["eos_token_id"] == 2 and tiny["pad_token_id"] is None
    assert tiny["attention_bias"] is True
    for dropped in ("model_type", "architectures", "torch_dtype", "attention_dropout", "quantization_config"):
        assert dropped not in tiny
    assert any("quantized" in item for item in review)


def test_shrink_multi_head_and_multi_query() -> None:
    assert shrink_config({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32})[
        "num_key_value_heads"] == 4
    assert shrink_config({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 1})[
        "num_key_value_heads"] == 1
    natural = shrink_config({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128})
    assert natural["head_dim"] == 16


def test_shrink_latent_attention_and_moe() -> None:
    tiny = shrink_config({
        "hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 27, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "moe_intermediate_size": 1408,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    })
    assert tiny["kv_lora_rank"] != tiny["qk_rope_head_dim"]
    assert tiny["qk_nope_head_dim"] + tiny["qk_rope_head_dim"] != tiny["v_head_dim"]  # key != value size
    assert tiny["q_lora_rank"] is None
    assert tiny["n_routed_experts"] == 4 and tiny["num_experts_per_tok"] == 2 and tiny["n_shared_experts"] == 1
    assert tiny["num_hidden_layers"] == 3 and tiny["first_k_dense_replace"] == 1  # dense and MoE layers
    assert tiny["rope_scaling"]["original_max_position_embeddings"] == 32 and tiny["rope_scaling"]["factor"] == 4.0


def test_shrink_layer_types_and_windows() -> None:
    tiny = shrink_config({"num_hidden_layers": 48, "sliding_window": 1024,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    assert tiny["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert tiny["sliding_window"] == 4 < 7  # the check runs 7 tokens: the window must bite
    derived = shrink_config({"num_hidden_layers": 42, "sliding_window": 4096},
                            derived_layer_types=["sliding_attention", "full_attention"] * 21)
    assert derived["num_hidden_layers"] == 3 and "layer_types" not in derived


def test_shrink_replaces_per_dimension_rope_factors() -> None:
    review: list[str] = []
    tiny = shrink_config({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                           "long_factor": [2.0] * 48, "rope_theta": 10000.0}}, review)
    assert tiny["rope_scaling"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert any("longrope" in item for item in review)


def test_shrink_refuses_nested_text_config() -> None:
    with pytest.raises(DraftingError, match="text_config"):
        shrink_config({"model_type": "x", "text_config": {"num_hidden_layers": 2}})


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(("config", "family", "message"), [
    ({"hidden_size": 8}, "fam", "no model_type"),
    ({"model_type": "surely_not_a_model"}, "fam", "not known to the installed transformers"),
    ({"model_type": "qwen3"}, "Qwen3", "lower case"),
    ({"model_type": "qwen3"}, "3qwen", "lower case"),
])
def test_draft_errors(config: dict, family: str, message: str) -> None:
    with pytest.raises(DraftingError, match=message):
        draft_family(family, config)


def test_read_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}', encoding="utf-8")
    assert read_config_json(tmp_path) == {"model_type": "qwen3"}  # a folder holding config.json
    assert read_config_json(tmp_path / "config.json") == {"model_type": "qwen3"}
    with pytest.raises(DraftingError, match="no such file"):
        read_config_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(DraftingError, match="not valid JSON"):
        read_config_json(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]", encoding="utf-8")
    with pytest.raises(DraftingError, match="JSON object"):
        read_config_json(tmp_path / "list.json")


# ---------------------------------------------------------------- command line


def test_cli_new_writes_a_valid_draft(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      fresh_cache: None) -> None:
    preset = str(PRESETS / "mistralai--Mistral-7B-v0.1.json")
    assert main(["new", "drafted_mistral", "--from-config", preset, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "drafted_mistral.yaml"
    assert f"wrote {path}" in out and "distconf check" in out
    assert "every layer has sliding-window attention (4096 tokens" in out
    from distconf.loader.source import read_family_file

    assert read_family_file(path).spec.block.mask.kind == "sliding_window"

    # an existing file is kept unless --force
    assert main(["new", "drafted_mistral", "--from-config", preset, "--out", str(tmp_path)]) == 1
    assert "use --force" in capsys.readouterr().err
    assert main(["new", "drafted_mistral", "--from-config", preset, "--out", str(tmp_path), "--force",
                 "--no-run"]) == 0


def test_cli_new_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preset = str(PRESETS / "Qwen--Qwen3-4B.json")
    assert main(["new", "fam", "--from-config", preset, "--out", str(tmp_path / "other.yaml")]) == 2
    assert "must be named fam.yaml" in capsys.readouterr().err
    unknown = tmp_path / "config.json"
    unknown.write_text('{"model_type": "surely_not_a_model"}', encoding="utf-8")
    assert main(["new", "fam", "--from-config", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert "not known to the installed transformers" in capsys.readouterr().err
    assert not (tmp_path / "fam.yaml").exists()


def test_draft_refuses_multimodal_wrapper_before_building() -> None:
    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 34}}
    with pytest.raises(DraftingError, match="text_config"):
        draft_family("fam", config)


def test_draft_per_layer_type_rotary() -> None:
    draft = draft_family("drafted_gemma3", {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240, "vocab_size": 262208,
        "sliding_window": 1024, "query_pre_attn_scalar": 256,
    })
    assert draft.position["rotary_layer_type_argument"] is True
    assert draft.mask == LAYER_TYPES_MASK
    assert draft.tiny_config["num_hidden_layers"] == 3 and draft.tiny_config["query_pre_attn_scalar"] == 32
