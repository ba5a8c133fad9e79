"""Loader and builder bugs the architecture sweep found, each pinned end to end.

Each test drafts a family from a transformers config class's defaults with ``distconf new``
and proves it with ``distconf check`` (a tiny checkpoint saved by transformers, blocks
loaded from it and compared with the transformers model), as the sweep does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import draft_and_check


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_blocks_stored_under_transformers_renamed_layout_load(tmp_path: Path, fresh_cache,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # before: exaone's checkpoint keeps layers under 'transformer.h' (transformers renames them to
    # 'model.layers' on load): the prefix was matched before renaming and no layer was found
    code, draft = draft_and_check("exaone", tmp_path)
    out = capsys.readouterr()
    assert "prefix: model.layers" in draft
    assert code == 0, out.err
    from safetensors import safe_open

    from distconf.blocks.weights import load_block_weights
    from distconf.loader import load_family
    from distconf.tools.checker.reference import build_reference, tiny_variants

    cls = load_family(next((tmp_path / "out").glob("*.yaml")))
    (_, values), *_ = tiny_variants(cls.family_spec.tiny_config)
    reference = build_reference(cls, values)
    config = reference.config
    reference.model.save_pretrained(tmp_path / "tiny")
    with safe_open(tmp_path / "tiny" / "model.safetensors", "pt") as f:
        assert any(k.startswith("transformer.h.1.attn.attention.") for k in f.keys())  # the stored layout
    state = load_block_weights(tmp_path / "tiny", config, 1)
    assert "self_attn.q_proj.weight" in state


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_parameters_drawn_outside_the_device_context_stay_on_meta(tmp_path: Path, fresh_cache) -> None:
    # before: diffllama draws its lambda parameters with torch.normal(..., size=...), which the meta
    # device context misses: the meta build held real tensors and check refused the family
    from distconf.blocks import build_block
    from distconf.loader import load_family
    from distconf.tools.checker.kinds import tiny_configs

    code, _ = draft_and_check("diffllama", tmp_path)
    assert code == 0
    (_, config), *_ = tiny_configs(load_family(next((tmp_path / "out").glob("*.yaml"))))
    block = build_block(config, 0, device="meta")
    assert all(p.is_meta for p in block.parameters())
    assert any("lambda_q1" in name for name, _ in block.named_parameters())


@pytest.mark.parametrize("edit, message", [
    ({"rotary_layer_kinds": ["nope"]}, "block.position.rotary_layer_kinds names 'nope'"),
    ({"computed_arguments": {"scale": {"function": "transformers.models.beam.modeling_beam.compute_attention_scaling",
                                       "layer_kinds": ["nope"]}}},
     "block.position.computed_arguments.scale.layer_kinds names 'nope'"),
])
def test_position_layer_kinds_must_be_mapped_layer_types(tmp_path: Path, fresh_cache, family_text,
                                                          edit: dict, message: str) -> None:
    import yaml

    from distconf.errors import FamilyValidationError
    from distconf.loader import load_family

    data = yaml.safe_load(family_text("gemma2"))
    data["block"]["position"].update(edit)
    path = tmp_path / "gemma2.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FamilyValidationError) as info:
        load_family(path)
    assert message in str(info.value)
