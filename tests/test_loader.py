"""Search path, caching, thread safety and user families outside the package."""

from __future__ import annotations

import threading

import pytest

from distconf import AutoDistributedConfig, FamilyNotFoundError, get_family_spec, list_families, load_family
from distconf.loader.spec import FamilySpec

SEEDS = ["bloom", "falcon", "llama", "mixtral"]


def test_builtins_listed() -> None:
    assert set(SEEDS) <= set(list_families())


def test_cached_identity() -> None:
    assert load_family("llama") is load_family("llama")


def test_path_and_name_give_one_class(family_text) -> None:
    from tests.conftest import FAMILIES

    assert load_family(FAMILIES / "falcon.yaml") is load_family("falcon")
    assert load_family(str(FAMILIES / "falcon.yaml")) is load_family("falcon")


def test_spec_access() -> None:
    spec = get_family_spec("falcon")
    assert isinstance(spec, FamilySpec) and spec.family == "falcon"
    assert load_family("falcon").family_spec is spec or load_family("falcon").family_spec == spec
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        spec.family = "other"  # type: ignore[misc]


def test_unknown_family_lists_known() -> None:
    with pytest.raises(FamilyNotFoundError) as info:
        load_family("gpt17")
    for family in SEEDS:
        assert family in str(info.value)


def test_sixteen_threads_get_one_class(fresh_cache) -> None:
    barrier = threading.Barrier(16)
    results: list[type] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait(timeout=30)
            results.append(load_family("mixtral"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 16
    assert len({id(cls) for cls in results}) == 1


USER_FAMILY = """\
# yaml-language-server: $schema=../schemas/family.schema.json
family: my_llama
display_name: MyLlama
model_type: my_llama_type
config_class: transformers.LlamaConfig
block:
  layer_class: transformers.models.llama.modeling_llama.LlamaDecoderLayer
  attention_class: transformers.models.llama.modeling_llama.LlamaAttention
  prefix: model.layers
kv_groups: max(1, num_attention_heads // num_key_value_heads)
dht_prefix:
  name: repo
  suffix: -mine
"""


def test_user_family_via_env(tmp_path, monkeypatch, fresh_cache) -> None:
    (tmp_path / "my_llama.yaml").write_text(USER_FAMILY.replace("my_llama_type", "llama"))
    other = tmp_path / "second"
    other.mkdir()
    monkeypatch.setenv("DISTCONF_FAMILIES_PATH", f"{tmp_path / 'nonexistent'}:{tmp_path}:{other}")
    assert "my_llama" in list_families()
    cls = load_family("my_llama")
    assert cls.__name__ == "DistributedMyLlamaConfig"
    assert cls(num_attention_heads=8, num_key_value_heads=2, hidden_size=64).num_key_value_groups == 4
    cfg = cls.from_pretrained  # noqa: F841 - the attribute exists like on any config class


def test_user_family_mismatched_model_type_fails_at_resolve(tmp_path, monkeypatch, fresh_cache) -> None:
    from distconf import FamilyValidationError

    (tmp_path / "my_llama.yaml").write_text(USER_FAMILY)
    monkeypatch.setenv("DISTCONF_FAMILIES_PATH", str(tmp_path))
    with pytest.raises(FamilyValidationError, match="model_type"):
        load_family("my_llama")


def test_auto_finds_user_family(tmp_path, monkeypatch, fresh_cache) -> None:
    import transformers

    fam_dir = tmp_path / "fams"
    fam_dir.mkdir()
    (fam_dir / "gpt2.yaml").write_text(
        USER_FAMILY.replace("my_llama", "gpt2").replace("MyLlama", "Gpt2").replace("gpt2_type", "gpt2")
        .replace("transformers.LlamaConfig", "transformers.GPT2Config")
        .replace("max(1, num_attention_heads // num_key_value_heads)", "1")
        .replace("models.llama.modeling_llama.LlamaDecoderLayer", "models.gpt2.modeling_gpt2.GPT2Block")
        .replace("models.llama.modeling_llama.LlamaAttention", "models.gpt2.modeling_gpt2.GPT2Attention")
        .replace("model.layers", "transformer.h")
    )
    monkeypatch.setenv("DISTCONF_FAMILIES_PATH", str(fam_dir))
    transformers.GPT2Config(n_layer=2).save_pretrained(tmp_path / "model")
    cfg = AutoDistributedConfig.from_pretrained(tmp_path / "model")
    assert type(cfg).__name__ == "DistributedGpt2Config" and cfg.num_hidden_layers == 2
    assert isinstance(cfg, transformers.GPT2Config)


def test_load_by_class_name_for_pickle(fresh_cache) -> None:
    import distconf.loader.registry

    assert distconf.loader.registry.DistributedBloomConfig is load_family("bloom")
    with pytest.raises(AttributeError):
        _ = distconf.loader.registry.NotAClass
