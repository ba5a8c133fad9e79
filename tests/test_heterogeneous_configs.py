"""Heterogeneous configs (sizes per layer, transformers' ``per_layer_config``): drafted, checked and served per layer.

Each layer's formulas are read on its own config (`distconf.loader.per_layer.layer_config`); a formula read once for
the whole model that names a per-layer attribute fails in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from sweephelpers import draft_and_check, new_from_defaults

from distconf.errors import ConfigValueError


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_sizes_per_layer_type_draft_check_and_size_per_layer(tmp_path: Path, fresh_cache,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # before: `distconf new` refused dots3_note_text (num_attention_heads, num_key_value_heads, kv_lora_rank and
    # qk_nope_head_dim differ between its indexed and sliding layers) as a heterogeneous config
    from distconf.blocks.kvcache import kv_geometry
    from distconf.loader import load_family

    code, text = draft_and_check("dots3_note_text", tmp_path)
    assert code == 0, capsys.readouterr().err
    assert "layer_overrides" not in text  # the layers' own configs give their sizes
    cls = load_family(next((tmp_path / "out").glob("*.yaml")))
    tiny = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    config = cls(**tiny)
    assert config.is_heterogeneous and "kv_lora_rank" in config.per_layer_attributes
    types = config.layer_types
    by_type = {types[i]: kv_geometry(config, i) for i in range(config.num_hidden_layers)}
    sliding, indexed = by_type["sliding_attention"], by_type["indexed_attention"]
    assert sliding.key_head_dim == config.per_layer_config[types.index("sliding_attention")].kv_lora_rank
    assert sliding.key_head_dim != indexed.key_head_dim and indexed.indexer_head_dim and not sliding.indexer_head_dim
    assert kv_geometry(config) == max(by_type.values(), key=lambda g: g.values_per_token)  # a server's budget


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_a_global_read_of_a_per_layer_attribute_fails_in_one_line(tmp_path: Path, fresh_cache) -> None:
    from distconf.loader import load_family

    assert new_from_defaults("dots3_note_text", tmp_path) == 0
    cls = load_family(next((tmp_path / "out").glob("*.yaml")))
    config = cls(**{k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"})
    with pytest.raises(ConfigValueError) as caught:
        config.num_key_value_groups  # noqa: B018 (kv_groups reads the head counts once for the whole model)
    (line,) = str(caught.value).splitlines()
    assert "kv_groups" in line and "holds num_" in line and "per layer" in line
    assert config.per_layer_config[0].num_key_value_groups >= 1  # each layer's own config reads it


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_per_layer_settings_follow_the_tiny_layer_types_the_class_gives(tmp_path: Path, fresh_cache) -> None:
    # gemma4_unified_text gives its full-attention layers head_dim 512 (256 elsewhere) and forces its last layer to
    # full attention: the tiny layers keep per_layer_config on every tiny full-attention layer, sized like head_dim
    from transformers import AutoConfig

    assert new_from_defaults("gemma4_unified_text", tmp_path) == 0
    draft = yaml.safe_load(next((tmp_path / "out").glob("*.yaml")).read_text())
    tiny = draft["tiny_config"]
    config = AutoConfig.for_model("gemma4_unified_text", **tiny)
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert len(full) >= 2 and "sliding_attention" in config.layer_types
    assert sorted(int(k) for k in tiny["per_layer_config"]) == full
    assert {v["head_dim"] for v in tiny["per_layer_config"].values()} == {2 * tiny["head_dim"]}
    assert "TODO review" not in next((tmp_path / "out").glob("*.yaml")).read_text()


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_head_sizes_per_layer_and_a_shared_kv_container_draft_and_check(tmp_path: Path, fresh_cache,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # before: gemma4_unified_text was refused as a heterogeneous config; drafted, its layers got None for the
    # KVSharingDict the model hands them all (shared_kv_states), and the last full-attention layer stores in it
    from distconf.blocks.kvcache import kv_geometry
    from distconf.loader import load_family

    code, text = draft_and_check("gemma4_unified_text", tmp_path)
    assert code == 0, capsys.readouterr().err
    family = yaml.safe_load(text)
    assert family["block"]["call"]["fresh_arguments"] == {"shared_kv_states": "transformers.cache_utils.KVSharingDict"}
    assert "layer_overrides" not in family.get("kv_cache", {})
    cls = load_family(next((tmp_path / "out").glob("*.yaml")))
    config = cls(**{k: v for k, v in family["tiny_config"].items() if k != "variants"})
    dims = {config.layer_types[i]: kv_geometry(config, i).key_head_dim for i in range(config.num_hidden_layers)}
    assert dims == {"sliding_attention": family["tiny_config"]["head_dim"],
                    "full_attention": 2 * family["tiny_config"]["head_dim"]}


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_layers_reading_what_another_stored_fail_check_in_one_line(tmp_path: Path, fresh_cache,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # a tiny config whose last layer reuses the K/V an earlier layer stored (num_kv_shared_layers): blocks served
    # apart cannot share them, and check says so at block.call.fresh_arguments
    from distconf.cli import main
    from distconf.loader.registry import clear_cache

    assert new_from_defaults("gemma4_unified_text", tmp_path) == 0
    clear_cache()  # `new` loaded the draft as written
    path = next((tmp_path / "out").glob("*.yaml"))
    text = path.read_text()
    assert "\n  num_kv_shared_layers: 0\n" in text
    path.write_text(text.replace("\n  num_kv_shared_layers: 0\n", "\n  num_kv_shared_layers: 1\n"))
    capsys.readouterr()
    assert main(["check", str(path)]) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "[tiny]" in x]
    assert "block.call.fresh_arguments" in line and "shared_kv_states" in line


def test_inputs_per_layer_from_the_token_ids_fail_new_in_one_line(tmp_path: Path, fresh_cache,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # gemma4_text (heterogeneous like gemma4_unified_text) also hands each layer a slice of per_layer_inputs, made
    # from the token ids for the whole model: the drafter carries it on the wire when it finds the method computing
    # it (tests/test_carried_per_layer_inputs.py); a model whose forward reads otherwise is refused in one line
    from sweephelpers import new_fails

    from distconf.tools.drafting import layer_inputs

    monkeypatch.setattr(layer_inputs, "computing_method", lambda *args: None)
    line = new_fails("gemma4_text", tmp_path, capsys)
    assert "'per_layer_input'" in line and "hidden_size_per_layer_input" in line and "besides the hidden states" in line
