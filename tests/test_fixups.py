"""After-load fix-ups, pinned revisions, notices and the return_unused_kwargs tuple."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import BloomConfig, FalconConfig, LlamaConfig, MixtralConfig

from distconf import load_family

PINS = {
    "tiiuae/falcon-40b": "f1ba7d328c06aa6fbb4a8afd3c756f46d7e6b232",
    "tiiuae/falcon-40b-instruct": "7475ff8cfc36ed9a962b658ae3c33391566a85a5",
    "tiiuae/falcon-7b": "4e2d06f0a7c6370ebabbc30c6f59377ae8f73d76",
    "tiiuae/falcon-7b-instruct": "f8dac3fff96d5debd43edf56fb4e1abcfffbef28",
}
MAIN_COMMIT = "0" * 40


def _save(tmp_path, config):
    config.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("family,base", [("falcon", FalconConfig), ("mixtral", MixtralConfig)])
def test_pad_token_defaults_to_zero(tmp_path, family, base) -> None:
    cls = load_family(family)
    assert cls.from_pretrained(_save(tmp_path, base(pad_token_id=None))).pad_token_id == 0


@pytest.mark.parametrize("family,base", [("falcon", FalconConfig), ("mixtral", MixtralConfig)])
def test_pad_token_kept_when_set(tmp_path, family, base) -> None:
    cls = load_family(family)
    assert cls.from_pretrained(_save(tmp_path, base(pad_token_id=7))).pad_token_id == 7


def test_bloom_and_llama_keep_pad_none(tmp_path) -> None:
    assert load_family("llama").from_pretrained(_save(tmp_path, LlamaConfig(pad_token_id=None))).pad_token_id is None


def test_llama_always_sets_tp_and_cache(tmp_path) -> None:
    folder = _save(tmp_path, LlamaConfig(pretraining_tp=4, use_cache=False))
    cfg = load_family("llama").from_pretrained(folder)
    assert cfg.pretraining_tp == 1 and cfg.use_cache is True
    cfg = load_family("llama").from_pretrained(folder, use_cache=False)
    assert cfg.use_cache is True


def test_bloom_keeps_pretraining_tp(tmp_path) -> None:
    cfg = load_family("bloom").from_pretrained(_save(tmp_path, BloomConfig(pretraining_tp=4)))
    assert cfg.pretraining_tp == 4


def test_return_unused_kwargs_tuple(tmp_path) -> None:
    folder = _save(tmp_path, FalconConfig(pad_token_id=None))
    result = load_family("falcon").from_pretrained(folder, return_unused_kwargs=True, not_a_field=3)
    assert isinstance(result, tuple) and len(result) == 2
    config, unused = result
    assert config.pad_token_id == 0 and unused == {"not_a_field": 3}
    llama_cfg, _ = load_family("llama").from_pretrained(
        _save(tmp_path, LlamaConfig(pretraining_tp=2)), return_unused_kwargs=True)
    assert llama_cfg.pretraining_tp == 1


def _hub_cache(tmp_path, hub_id: str, commits: dict[str, int]) -> str:
    """A real Hugging Face cache folder holding snapshots of one repo (hidden_size marks each)."""
    cache = tmp_path / "hf-cache"
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    for commit, hidden in commits.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        FalconConfig(hidden_size=hidden, num_attention_heads=8).to_json_file(snap / "config.json")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    return str(cache)


@pytest.mark.parametrize("hub_id,commit", sorted(PINS.items()))
def test_pinned_revision_used_by_default(tmp_path, hub_id, commit) -> None:
    cls = load_family("falcon")
    assert cls.pinned_revision(hub_id) == commit
    cache = _hub_cache(tmp_path, hub_id, {commit: 64, MAIN_COMMIT: 32})
    pinned = cls.from_pretrained(hub_id, cache_dir=cache, local_files_only=True)
    assert pinned.hidden_size == 64
    assert pinned.dht_prefix == hub_id.split("/")[-1]
    explicit = cls.from_pretrained(hub_id, cache_dir=cache, local_files_only=True, revision="main")
    assert explicit.hidden_size == 32


def test_unpinned_model_uses_main(tmp_path) -> None:
    cls = load_family("falcon")
    assert cls.pinned_revision("tiiuae/falcon-180B") is None
    cache = _hub_cache(tmp_path, "tiiuae/falcon-180B", {MAIN_COMMIT: 32})
    assert cls.from_pretrained("tiiuae/falcon-180B", cache_dir=cache, local_files_only=True).hidden_size == 32


def test_only_falcon_pins_revisions() -> None:
    from distconf.loader.mixins import PinnedRevisionMixin

    assert issubclass(load_family("falcon"), PinnedRevisionMixin)
    assert load_family("falcon").__bases__[0] is PinnedRevisionMixin
    for family in ("bloom", "llama", "mixtral"):
        assert not issubclass(load_family(family), PinnedRevisionMixin)


NOTICE_CASES = [
    ("bloom", "bigscience/bloom", "BLOOM"),
    ("bloom", "bigscience/bloom-560m", "BLOOM"),
    ("llama", "meta-llama/Llama-2-7b-hf", "Llama terms of use"),
    ("falcon", "tiiuae/falcon-180B", "Falcon-180B license"),
    ("falcon", "tiiuae/falcon-180b-chat", "Falcon-180B license"),
]


def _preset_like(tmp_path, family: str):
    base = {"bloom": BloomConfig, "llama": LlamaConfig, "falcon": FalconConfig}[family]
    return _save(tmp_path, base())


def _cached(tmp_path, family: str, name: str):
    """A hub-cache layout holding ``name``'s config (a default config of ``family``)."""
    cache = tmp_path / "cache"
    repo = cache / ("models--" + name.replace("/", "--"))
    (repo / "snapshots" / MAIN_COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    src = _preset_like(tmp_path, family) / "config.json"
    (repo / "snapshots" / MAIN_COMMIT / "config.json").write_text(src.read_text())
    return cache


@pytest.mark.parametrize("family,name", [("llama", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                         ("bloom", "someone/multilingual-560m")])
def test_a_licence_notice_follows_the_model_not_the_family(tmp_path, caplog, family, name) -> None:
    """SmolLM2 is a llama-family model under Apache-2.0: no Llama terms-of-use notice."""
    with caplog.at_level(logging.INFO, logger="distconf.notices"):
        load_family(family).from_pretrained(name, cache_dir=str(_cached(tmp_path, family, name)), local_files_only=True)
    assert not [r for r in caplog.records if r.name == "distconf.notices"]


@pytest.mark.parametrize("family,name,text", NOTICE_CASES)
def test_notices_logged(tmp_path, caplog, family, name, text) -> None:
    cls = load_family(family)
    with caplog.at_level(logging.INFO, logger="distconf.notices"):
        cls.from_pretrained(name, cache_dir=str(_cached(tmp_path, family, name)), local_files_only=True)
    assert any(text in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("name", ["tiiuae/falcon-40b", "tiiuae/falcon-7b"])
def test_falcon_notice_only_for_180b(caplog, name) -> None:
    from distconf import load_preset

    with caplog.at_level(logging.INFO, logger="distconf.notices"):
        load_preset(name)
    assert not [r for r in caplog.records if r.name == "distconf.notices"]


def test_mixtral_logs_no_notice(caplog) -> None:
    from distconf import load_preset

    with caplog.at_level(logging.INFO, logger="distconf.notices"):
        load_preset("mistralai/Mixtral-8x7B-v0.1")
    assert not [r for r in caplog.records if r.name == "distconf.notices"]


def test_preset_values_match_public_configs() -> None:
    from distconf import load_preset

    bloom = load_preset("bigscience/bloom")
    assert (bloom.hidden_size, bloom.n_head, bloom.n_layer, bloom.vocab_size) == (14336, 112, 70, 250880)
    assert (bloom.layer_norm_epsilon, bloom.pretraining_tp, bloom.pad_token_id) == (1e-5, 4, 3)
    llama = load_preset("meta-llama/Llama-2-70b-hf")
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (8192, 28672, 80)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.vocab_size) == (64, 8, 32000)
    assert (llama.max_position_embeddings, llama.rms_norm_eps, llama.num_key_value_groups) == (4096, 1e-5, 8)
    f40 = load_preset("tiiuae/falcon-40b")
    assert (f40.hidden_size, f40.num_attention_heads, f40.num_kv_heads, f40.num_hidden_layers) == (8192, 128, 8, 60)
    assert f40.new_decoder_architecture and f40.parallel_attn and not f40.alibi and not f40.bias
    assert f40.num_key_value_groups == 16 and f40.vocab_size == 65024
    f7 = load_preset("tiiuae/falcon-7b")
    assert (f7.hidden_size, f7.num_attention_heads, f7.num_hidden_layers) == (4544, 71, 32)
    assert f7.multi_query and not f7.new_decoder_architecture and f7.num_key_value_groups == 71
    mx = load_preset("mistralai/Mixtral-8x7B-v0.1")
    assert (mx.hidden_size, mx.intermediate_size, mx.num_hidden_layers) == (4096, 14336, 32)
    assert (mx.num_attention_heads, mx.num_key_value_heads, mx.num_local_experts) == (32, 8, 8)
    assert (mx.num_experts_per_tok, mx.vocab_size, mx.max_position_embeddings) == (2, 32000, 32768)
    assert mx.rope_parameters["rope_theta"] == 1e6
    assert mx.num_key_value_groups == 4  # corrected: Petals 2.x uses 1


def test_preset_files_are_plain_config_json() -> None:
    from distconf.loader.presets import list_presets, preset_path

    for hub_id in list_presets():
        data = json.loads(preset_path(hub_id).read_text())
        assert "model_type" in data
