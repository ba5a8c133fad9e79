"""A layer stack sized by a nested sub-config (``block.config_section``), as the architecture sweep found it.

BLT (Byte Latent Transformer) counts no layers at its top level: a local encoder, a global transformer
and a local decoder (and an entropy patcher) are each sized by a sub-config of their own. The family
serves the global transformer's layers (the stack holding the most parameters), the client keeps the
rest; the family's config reads the attributes its top level lacks from ``global_config``. The global
layers run on patches of bytes, so the check runs them on the sequence length they really see.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
import yaml
from sweephelpers import draft_and_check

from distconf.errors import FamilyValidationError
from distconf.loader import load_family


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_blt_drafts_the_global_stack_and_passes_check(tmp_path: Path, fresh_cache,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # before: distconf new failed ("counts no layers at its top level"): no num_hidden_layers at the top level
    code, text = draft_and_check("blt", tmp_path)
    out = capsys.readouterr()
    assert code == 0, out.err + out.out
    block = yaml.safe_load(text)["block"]
    assert block["prefix"] == "model.global_transformer.layers"
    assert block["config_section"] == "global_config"
    assert "512/512" in out.out  # K/V bytes per token of a tiny block, counted on the patches it caches

    cls = load_family(next((tmp_path / "out").glob("*.yaml")))
    values = cls.family_spec.tiny_config
    config = cls(**{k: v for k, v in values.items() if k != "variants"})
    assert config.num_hidden_layers == config.global_config.num_hidden_layers == 2
    assert config.hidden_size == config.global_config.hidden_size
    assert config.wire_width == config.global_config.hidden_size  # the wire carries the global stack's width
    assert config.vocab_size == values["vocab_size"]  # the top level keeps what it has


def test_layer_section_is_the_stack_with_most_parameters_and_ties_follow_it() -> None:
    from transformers import BltConfig

    from distconf.loader.layer_section import sectioned_config_class
    from distconf.tools.drafting.scan import find_layer_list, layer_section, meta_model

    full, model = meta_model(BltConfig, BltConfig().to_dict())
    assert layer_section(full, model) == "global_config"
    # in a tiny model every stack has 2 layers of the same width: the section, not the size, picks the list
    stack = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    tiny = {**{f"{part}_config": dict(stack) for part in ("encoder", "decoder", "patcher", "global")},
            "encoder_hash_byte_group_vocab": 64}
    sectioned = sectioned_config_class(BltConfig, "global_config")
    config = sectioned(**tiny)
    _, model = meta_model(sectioned, {"model_type": "blt", **tiny})
    assert find_layer_list(model, config.num_hidden_layers)[0] == "model.global_transformer.layers"
    _, plain = meta_model(BltConfig, {"model_type": "blt", **tiny})
    assert find_layer_list(plain, 2)[0] != "model.global_transformer.layers"  # what sizes alone would pick


def test_config_section_must_name_a_sub_config(tmp_path: Path) -> None:
    family = {"family": "blt_wrong_section", "model_type": "blt", "config_class": "transformers.BltConfig",
              "block": {"layer_class": "transformers.models.blt.modeling_blt.BltTransformerLayer",
                        "attention_class": "transformers.models.blt.modeling_blt.BltSelfAttention",
                        "prefix": "model.global_transformer.layers", "config_section": "patch_size"},
              "kv_groups": "num_attention_heads // num_key_value_heads", "dht_prefix": {"name": "repo"}}
    path = tmp_path / "blt_wrong_section.yaml"
    path.write_text(json.dumps(family))
    with pytest.raises(FamilyValidationError, match=r"block\.config_section: 'patch_size' is not a sub-config"):
        load_family(path)
    family["block"]["config_section"] = "global_config"  # the formula's names are the sub-config's fields
    path.write_text(json.dumps(family))
    assert load_family(path)().num_key_value_groups == 1


def test_shadowed_fields_are_listed_for_review() -> None:
    from transformers import BltConfig

    from distconf.tools.drafting.draft import _shadowed_section_fields

    assert _shadowed_section_fields(BltConfig(), "global_config") == []
    notes = _shadowed_section_fields(BltConfig(max_position_embeddings=64), "global_config")
    assert len(notes) == 1 and notes[0].startswith("max_position_embeddings is 64 at the top level but 4096")


def test_chunked_run_follows_the_sequence_the_stack_sees() -> None:
    from distconf.tools.checker.runs import CHUNKS, chunk_sizes

    assert chunk_sizes(sum(CHUNKS)) == list(CHUNKS)
    assert chunk_sizes(10) == [4, 2, 1, 2, 1]
    assert chunk_sizes(5) == [4, 1]
    assert chunk_sizes(3) == [3]


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_blt_client_generates_without_a_cache_and_says_why_not_with_one(tmp_path: Path, fresh_cache,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client runs BLT's local encoder and decoder around the served global stack: exact on a forward and
    on generation without a cache; with one, the model-level layers ask for K/V the client does not keep."""
    import torch
    from client_swarm import make_model_dir, prompts
    from local_remote import local_client_model

    from distconf.loader.search import FAMILIES_PATH_ENV

    code, _ = draft_and_check("blt", tmp_path)
    assert code == 0
    monkeypatch.setenv(FAMILIES_PATH_ENV, str(tmp_path / "out"))
    model_dir, local = make_model_dir(tmp_path / "blt", "blt", layers=2, noise=0.05)
    model, remote = local_client_model(model_dir)
    ids = prompts(2, 5, vocab=local.config.vocab_size, seed=1)
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, local(ids).logits, atol=1e-5)
        assert (model.generate(ids, use_cache=False, **greedy).tolist()
                == local.generate(ids, use_cache=False, **greedy).tolist())
        with pytest.raises(NotImplementedError, match=r"outside the served blocks.*use_cache=False"):
            model.generate(ids, **greedy)
    assert remote.inputs  # the global stack ran as blocks
