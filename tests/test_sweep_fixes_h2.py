"""Recurrent / state-space / linear-attention types of the architecture sweep, each pinned end to end.

Each test drafts a family from a transformers config class's defaults with ``distconf new``
and proves it with ``distconf check``, as the sweep does; a type whose state the runtime
cannot hold must fail ``distconf new`` in one line naming where the state is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import draft_and_check, new_from_defaults


def test_state_only_defaults_get_an_attention_layer_built_from_the_layer_type(
        tmp_path: Path, fresh_cache, capsys: pytest.CaptureFixture[str]) -> None:
    # before: bamba's defaults list no attention layer (attn_layer_indices None), transformers' own cache
    # code then fails (get_seq_length needs an attention layer), and the layer class builds its mixer from
    # a constructor argument layer_type whose default is the state layer: no attention class was found
    code, draft = draft_and_check("bamba", tmp_path)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "attn_layer_indices:\n  - 1" in draft
    assert "layer_type_argument: layer_type" in draft
    assert "linear_attention: none" in draft and "full_attention: causal" in draft
    assert "attention_class: transformers.models.bamba.modeling_bamba.BambaAttention" in draft


def test_linear_attention_layers_keep_state_and_attention_gets_rotary_through_kwargs(
        tmp_path: Path, fresh_cache, capsys: pytest.CaptureFixture[str]) -> None:
    # before: bailing_hybrid's tiny model did not run (num_expert_group shrank as a count of experts: one
    # expert per group, topk(2) within a group failed), so its linear_attention layers were never mapped; then
    # its layer passes position_embeddings to the attention through **kwargs and the draft withheld them
    code, draft = draft_and_check("bailing_hybrid", tmp_path)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "linear_attention: none" in draft
    assert "num_expert_group: 1" in draft
    assert "rotary_class:" in draft and "position_embeddings_argument" not in draft


def test_expert_group_count_is_a_group_role() -> None:
    from transformers import BailingHybridConfig

    from distconf.tools.drafting.fields import FieldNames, role_of

    names = FieldNames.of(BailingHybridConfig)
    assert role_of("num_expert_group", 8, names) == "expert_groups"
    assert role_of("num_experts", 512, names) == "experts"


def test_constructor_layer_type_argument_needs_layer_types_field() -> None:
    from pydantic import ValidationError

    from distconf.loader.spec_block import BlockSpec

    with pytest.raises(ValidationError, match=r"layer_type_argument needs mask\.layer_types_field"):
        BlockSpec.model_validate({"layer_class": "transformers.A", "attention_class": "transformers.B",
                                  "prefix": "model.layers", "constructor": {"layer_type_argument": "layer_type"}})


def test_named_layer_type_the_model_cannot_build_gets_no_variant(tmp_path: Path) -> None:
    # before: zaya's modeling code names a 'conv' layer type its config class takes but its model cannot
    # build (KeyError: 'conv'): the draft had a variant for it that every check failed on
    assert new_from_defaults("zaya", tmp_path) == 0
    (draft,) = (tmp_path / "out").glob("*.yaml")
    text = draft.read_text()
    assert "variant layer type conv" not in text and "- conv" not in text
    # its layers hand prev_router_hidden_states on to the next one: the draft carries it on the wire
    assert "argument: prev_router_hidden_states" in text and "width: router_hidden_size" in text
