"""DHT prefix derivation for the four seed families, as Petals 2.x derives it."""

from __future__ import annotations

import json

import pytest
from transformers import BloomConfig, FalconConfig, LlamaConfig, MixtralConfig

from distconf import ConfigValueError, load_family
from distconf.loader.naming import derive_dht_prefix

CASES = {
    "bloom": [
        ("bigscience/bloom", "bigscience/bloom-petals"),
        ("bigscience/bloom-7b1", "bigscience/bloom-7b1-petals"),
        ("bigscience/bloomz-7b1-mt", "bigscience/bloomz-7b1-mt-petals"),
        ("someone/bloom-1.7b", "someone/bloom-1-7b-petals"),
        ("bloom", "bloom-petals"),
    ],
    "llama": [
        ("meta-llama/Llama-2-70b-hf", "Llama-2-70b-hf"),
        ("meta-llama/Llama-2-70b-chat-hf", "Llama-2-70b-chat-hf"),
        ("meta-llama/Meta-Llama-3.1-405B-Instruct", "Meta-Llama-3-1-405B-Instruct-hf"),
        ("meta-llama/Meta-Llama-3-70B", "Meta-Llama-3-70B-hf"),
        ("enoch/llama-65b-hf", "llama-65b-hf"),
        ("huggyllama/llama-65b", "llama-65b-hf"),
        ("Llama-2-7b", "Llama-2-7b-hf"),
        ("a/b/TinyLlama-1.1B", "TinyLlama-1-1B-hf"),
        ("org/model.hf", "model-hf"),
    ],
    "falcon": [
        ("tiiuae/falcon-180B-chat", "falcon-180B-chat"),
        ("tiiuae/falcon-40b", "falcon-40b"),
        ("tiiuae/falcon-7b-instruct", "falcon-7b-instruct"),
        ("tiiuae/falcon-11B.v2", "falcon-11B-v2"),
        ("falcon-rw-1b", "falcon-rw-1b"),
    ],
    "mixtral": [
        ("mistralai/Mixtral-8x22B-Instruct-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0-1"),
        ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-v0-1"),
        ("Mixtral-8x7B", "Mixtral-8x7B"),
    ],
}
BASES = {"bloom": BloomConfig, "llama": LlamaConfig, "falcon": FalconConfig, "mixtral": MixtralConfig}


@pytest.mark.parametrize(("family", "name", "expected"),
                         [(f, n, e) for f, cases in CASES.items() for n, e in cases])
def test_rule(family: str, name: str, expected: str) -> None:
    spec = load_family(family).family_spec
    assert derive_dht_prefix(spec.dht_prefix, name) == expected


def _hub_like_dir(tmp_path, family, saved_prefix=None):
    """A local model folder written by the plain HF class (optionally with a saved prefix)."""
    folder = tmp_path / f"{family}-model"
    BASES[family](num_hidden_layers=2).save_pretrained(folder)
    if saved_prefix is not None:
        path = folder / "config.json"
        data = json.loads(path.read_text())
        data["dht_prefix"] = saved_prefix
        path.write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("family", sorted(CASES))
def test_local_dir_keeps_saved_prefix(tmp_path, family: str) -> None:
    cls = load_family(family)
    folder = _hub_like_dir(tmp_path, family, saved_prefix="my-private-swarm")
    assert cls.from_pretrained(folder).dht_prefix == "my-private-swarm"
    assert cls.from_pretrained(str(folder)).dht_prefix == "my-private-swarm"


@pytest.mark.parametrize("family", sorted(CASES))
def test_local_dir_without_prefix_stays_none(tmp_path, family: str) -> None:
    cls = load_family(family)
    assert cls.from_pretrained(_hub_like_dir(tmp_path, family)).dht_prefix is None


@pytest.mark.parametrize("family", sorted(CASES))
def test_explicit_prefix_used_as_is(tmp_path, family: str) -> None:
    cls = load_family(family)
    folder = _hub_like_dir(tmp_path, family, saved_prefix="saved")
    assert cls.from_pretrained(folder, dht_prefix="Explicit_Prefix-1").dht_prefix == "Explicit_Prefix-1"


@pytest.mark.parametrize("hub_id", ["bigscience/bloom", "meta-llama/Llama-2-70b-hf", "tiiuae/falcon-40b",
                                    "tiiuae/falcon-7b", "mistralai/Mixtral-8x7B-v0.1"])
def test_presets_follow_hub_rules(hub_id: str) -> None:
    from distconf import load_preset

    cfg = load_preset(hub_id)
    assert cfg.dht_prefix == derive_dht_prefix(type(cfg).family_spec.dht_prefix, hub_id)
    assert load_preset(hub_id, dht_prefix="explicit").dht_prefix == "explicit"


@pytest.mark.parametrize("bad", ["has.dot", "has space", "", "tab\there"])
def test_invalid_prefix_rejected(tmp_path, bad: str) -> None:
    cls = load_family("llama")
    with pytest.raises(ConfigValueError, match="dht_prefix"):
        cls(dht_prefix=bad)
    with pytest.raises(ConfigValueError, match="dht_prefix"):
        cls.from_pretrained(_hub_like_dir(tmp_path, "llama"), dht_prefix=bad)
