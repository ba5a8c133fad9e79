"""Drafting reads a config the way transformers does, and shrinks every field consistently.

The field names come from real transformers config classes (their ``attribute_map``);
nothing here is a mock. Most tests only shrink (no model is built); the draft tests
build models on the meta device, and a few run a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from blockhelpers import falcon_caches_expanded_heads
from hypothesis import given, settings
from hypothesis import strategies as st

from distconf.cli import main
from distconf.tools.drafting import draft_family, shrink_config

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "presets"


def _preset(name: str) -> dict:
    return json.loads((PRESETS / f"{name}.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- names through attribute_map


@pytest.mark.parametrize(("config", "expected"), [
    # MPT stores d_model / n_heads / n_layers
    ({"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "vocab_size": 50432},
     {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 256}),
    # GPT-Neo stores num_heads / num_layers, and a window_size
    ({"model_type": "gpt_neo", "hidden_size": 2048, "num_heads": 16, "num_layers": 24, "window_size": 256,
      "max_position_embeddings": 2048, "vocab_size": 50257},
     {"hidden_size": 64, "num_heads": 4, "num_layers": 2, "window_size": 4, "max_position_embeddings": 128}),
    # DBRX stores n_heads / n_layers / max_seq_len
    ({"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768},
     {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128}),
])
def test_shrink_reads_names_through_attribute_map(config: dict, expected: dict) -> None:
    tiny = shrink_config(config)
    assert {key: tiny[key] for key in expected} == expected


def test_shrink_scales_parts_of_a_head_with_the_head() -> None:
    # GPT-J: 16 heads of 256, rotary on 64 of them -> tiny heads of 16, rotary on 4
    tiny = shrink_config({"model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28, "rotary_dim": 64,
                          "n_positions": 2048, "vocab_size": 50400})
    assert (tiny["n_embd"], tiny["n_head"], tiny["rotary_dim"], tiny["n_positions"]) == (64, 4, 4, 128)
    # latent attention: every head-part size keeps its ratio to the others
    tiny = shrink_config({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 4,
                          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "qk_head_dim": 192, "v_head_dim": 128})
    assert tiny["qk_nope_head_dim"] + tiny["qk_rope_head_dim"] == tiny["qk_head_dim"]
    assert tiny["qk_nope_head_dim"] == tiny["v_head_dim"] == 2 * tiny["qk_rope_head_dim"]


# ---------------------------------------------------------------- per-layer fields

KINDS = ["chunked_attention", "full_attention", "sliding_attention", "linear_attention"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=4, max_size=64))
def test_per_layer_fields_are_cut_to_the_same_layers(pattern: list[int]) -> None:
    """Every per-layer list keeps the tiny depth; tiny layer j takes all its entries from one real layer."""
    layers = len(pattern)
    config = {
        "num_hidden_layers": layers, "hidden_size": 1024, "num_attention_heads": 8,
        "layer_types": [KINDS[k] for k in pattern],
        "no_rope_layers": [int(k != 1) for k in pattern],  # a flag per layer that goes with the type
        "intermediate_size": [2048 * (1 + k) for k in pattern],  # a size per layer
        "moe_layers": [i for i, k in enumerate(pattern) if k == 2],  # layer indices
    }
    tiny = shrink_config(config)
    depth = tiny["num_hidden_layers"]
    distinct = sorted(set(pattern))
    assert depth == (2 if len(distinct) == 1 else max(3, len(distinct)))
    for key in ("layer_types", "no_rope_layers", "intermediate_size"):
        assert len(tiny[key]) == depth, key
    assert {KINDS[k] for k in distinct} == set(tiny["layer_types"])  # every kind kept
    for j, kind in enumerate(tiny["layer_types"]):
        real = KINDS.index(kind)
        assert tiny["no_rope_layers"][j] == int(real != 1)
        assert (j in tiny["moe_layers"]) == (real == 2)
    assert all(size == 128 for size in tiny["intermediate_size"])


def test_per_layer_sizes_and_head_counts() -> None:
    tiny = shrink_config({"model_type": "laguna", "hidden_size": 6144, "num_attention_heads": 48,
                          "num_key_value_heads": 8, "num_hidden_layers": 40, "head_dim": 128,
                          "num_attention_heads_per_layer": [48] * 40})
    assert tiny["num_attention_heads_per_layer"] == [4] * tiny["num_hidden_layers"]


def test_settings_keyed_by_layer_are_renumbered() -> None:
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 5
    tiny = shrink_config({"num_hidden_layers": 30, "hidden_size": 2048, "num_attention_heads": 8, "head_dim": 256,
                          "layer_types": layer_types,
                          "per_layer_config": {f"{i:02d}": {"head_dim": 512} for i in range(5, 30, 6)}})
    full = [j for j, kind in enumerate(tiny["layer_types"]) if kind == "full_attention"]
    assert sorted(int(key) for key in tiny["per_layer_config"]) == full
    assert all(v == {"head_dim": 2 * tiny["head_dim"]} for v in tiny["per_layer_config"].values())


# ---------------------------------------------------------------- drafts


def test_draft_keeps_every_kind_of_layer() -> None:
    """Three dense layers before the MoE ones: the tiny model needs a fourth layer to have an MoE layer."""
    config = _preset("deepseek-ai--DeepSeek-V2-Lite")
    config["first_k_dense_replace"] = 3
    draft = draft_family("drafted", config, run_tiny=False)
    assert draft.tiny_config["num_hidden_layers"] == 4 and draft.tiny_config["first_k_dense_replace"] == 3
    assert draft.review == []


def test_draft_copies_only_fields_the_class_reads() -> None:
    draft = draft_family("drafted", _preset("tiiuae--falcon-7b"), run_tiny=False)
    assert "apply_residual_connection_post_layernorm" not in draft.tiny_config  # FalconConfig has no such field
    assert draft.tiny_config["multi_query"] is True and draft.tiny_config["parallel_attn"] is True
    assert any("apply_residual_connection_post_layernorm" in fact for fact in draft.facts)
    draft = draft_family("drafted", _preset("deepseek-ai--DeepSeek-V2-Lite"), run_tiny=False)
    assert not {"seq_aux", "aux_loss_alpha", "architectures", "torch_dtype"} & set(draft.tiny_config)
    assert draft.tiny_config["rope_scaling"]["type"] == "yarn"  # read through the class's legacy rope handling
    # not a field of Qwen3MoeConfig, but its modeling code reads it: kept (and still != hidden / heads)
    draft = draft_family("drafted", _preset("Qwen--Qwen3-30B-A3B"), run_tiny=False)
    assert draft.tiny_config["head_dim"] == 2 * draft.tiny_config["hidden_size"] // draft.tiny_config[
        "num_attention_heads"]
    assert "max_window_layers" not in draft.tiny_config


def test_draft_learns_kv_heads_from_the_caches_of_every_variant() -> None:
    """Falcon-7B caches one KV head (multi-query) although its KV-heads field says all heads; Falcon-40B (a
    shipped preset of the same model_type, with other layers) writes each of its KV heads once per query head
    (transformers <= 5.24; 5.25 caches its KV heads and its config says how many, ``num_key_value_heads``).
    The draft gets a variant for 40B and one kv_groups formula right for both, found from their caches."""
    draft = draft_family("drafted", _preset("tiiuae--falcon-7b"))
    assert draft.tiny_config["variants"] == [{}, {"new_decoder_architecture": True, "num_kv_heads": 2}]
    if falcon_caches_expanded_heads():
        assert draft.kv_groups == ("num_attention_heads // num_kv_heads if new_decoder_architecture "
                                   "else num_attention_heads")
        assert draft.kv_cache == {"layer_writes": "repeat_interleave"}
    else:
        assert draft.kv_groups == "num_attention_heads // num_key_value_heads"
        assert not draft.kv_cache
    assert draft.review == []


@pytest.mark.parametrize("model_type", ["gptj", "mpt", "gpt_neo", "laguna"])
def test_draft_from_class_defaults_runs(model_type: str) -> None:
    """Architectures whose fields have other names or per-layer lists draft a tiny config that runs."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    draft = draft_family("drafted", {**config_class().to_dict(), "model_type": model_type})
    assert not [item for item in draft.review if "does not run" in item or "not recognised" in item], draft.review
    tiny = config_class(**draft.tiny_config)
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.vocab_size) == (64, 4, 256)
    assert tiny.num_hidden_layers <= 6


# ---------------------------------------------------------------- the written file


def test_schema_line_is_never_a_machine_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from distconf.cli.cmd_new import _schema_reference
    from distconf.loader.spec import SCHEMA_ID

    assert _schema_reference(REPO / "families" / "x.yaml") == "../schemas/family.schema.json"
    assert _schema_reference(tmp_path / "x.yaml") == SCHEMA_ID
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_preset("Qwen--Qwen3-4B")), encoding="utf-8")
    assert main(["new", "drafted", "--from-config", str(config), "--out", str(tmp_path), "--no-run"]) == 0
    capsys.readouterr()
    first = (tmp_path / "drafted.yaml").read_text(encoding="utf-8").splitlines()[0]
    assert first == f"# yaml-language-server: $schema={SCHEMA_ID}"
