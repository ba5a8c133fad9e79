"""What the drafter writes for the model types the architecture sweep found it wrong on, one table row per fix.

Each row drafts a family from a transformers config class's defaults with ``distconf new`` and (unless the row
says not to) proves it with ``distconf check``, as the sweep does, then holds the draft to what the fix made it
say: texts it holds (``has``) or must not hold (``lacks``), patterns it matches, and values at paths of the
parsed YAML. Its id says what the row proves; the comment says what the draft did before the fix.
Model types refused in one line are in ``tests/test_sweep_refusals.py``; the fixes proved by running the
drafted blocks stay in the files named by what they prove (e.g. ``tests/test_layer_stack_loop.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
import yaml
from sweephelpers import draft_and_check, new_from_defaults

pytestmark = pytest.mark.slow  # each row drafts a model type from its defaults and checks it: seconds each


@dataclass(frozen=True)
class Drafted:
    """A model type's defaults drafted (and checked), and what its draft must say."""

    model_type: str
    proves: str
    has: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()
    matches: tuple[str, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)
    """Dotted path in the parsed draft (list indices as numbers) -> its value, or a predicate on it."""
    check: bool = True


def _at(draft: Any, path: str) -> Any:
    for part in path.split("."):
        draft = draft[int(part)] if isinstance(draft, list) else draft[part]
    return draft


DRAFTED = [
    # before: bamba's defaults list no attention layer (attn_layer_indices None), transformers' own cache code then
    # fails (get_seq_length needs an attention layer), and the layer class builds its mixer from a constructor
    # argument layer_type whose default is the state layer: no attention class was found
    Drafted("bamba", "state_only_defaults_get_an_attention_layer_built_from_the_layer_type",
            has=("attn_layer_indices:\n  - 1", "layer_type_argument: layer_type", "linear_attention: none",
                 "full_attention: causal", "attention_class: transformers.models.bamba.modeling_bamba.BambaAttention")),
    # before: bailing_hybrid's tiny model did not run (num_expert_group shrank as a count of experts: one expert per
    # group, topk(2) within a group failed), so its linear_attention layers were never mapped; then its layer passes
    # position_embeddings to the attention through **kwargs and the draft withheld them
    Drafted("bailing_hybrid", "linear_attention_layers_keep_state_and_attention_gets_rotary_through_kwargs",
            has=("linear_attention: none", "num_expert_group: 1", "rotary_class:"),
            lacks=("position_embeddings_argument",)),
    # before: zaya's modeling code names a 'conv' layer type its config class takes but its model cannot build
    # (KeyError: 'conv'): the draft had a variant for it that every check failed on. Its layers hand
    # prev_router_hidden_states on to the next one: the draft carries it on the wire
    Drafted("zaya", "named_layer_type_the_model_cannot_build_gets_no_variant",
            has=("argument: prev_router_hidden_states", "width: router_hidden_size"),
            lacks=("variant layer type conv", "- conv"), check=False),
    # before: blocks gave zaya's layer one tensor mask; its attention does `attention_mask or {}`, so every cached
    # run crashed ("Boolean value of Tensor with more than one value is ambiguous")
    Drafted("zaya", "dict_mask_is_drafted_and_checked",
            has=("    as_dict:\n      causal: attention\n      conv: padding\n",)),
    # before: beam's full-attention layers take no rotary (NoPE) but a query scaling the model computes from the
    # position ids: the block called the rotary module for them (KeyError: 'full_attention')
    Drafted("beam", "positions_computed_outside_the_layers_are_drafted_and_proven", values={
        "block.position.rotary_layer_kinds": ["sliding_attention"],
        "block.position.computed_arguments.attention_scaling.function":
            lambda v: v.endswith(".compute_attention_scaling"),
        "block.position.computed_arguments.attention_scaling.layer_kinds": ["full_attention"]}),
    # before: mapping a hybrid's layer types for its state turned lara_mini's sliding_attention layers causal
    Drafted("lara_mini", "a_hybrids_sliding_layers_keep_their_window", values={
        "block.mask.layer_kinds": {"linear_attention": "none", "sliding_attention": "sliding_window",
                                   "full_attention": "causal"}}),
    # before: MoshiDecoderLayer requires use_flexible_linear, which the model passes as a constant: the draft built
    # the layer without it ("missing 1 required positional argument")
    Drafted("moshi", "constant_constructor_arguments_are_read_from_the_model",
            values={"block.constructor.extra": {"use_flexible_linear": "False"}}),
    # the text model's cross-attention layers (listed in cross_attention_layers) are their own layer type, which
    # the model skips without image input; the check proves the blocks pass hidden states through there
    Drafted("mllama", "cross_attention_layers_are_drafted_as_skipped",
            has=("cross_attention: cross_attention_layers",), matches=(r"skipped_layer_kinds:\n  - cross_attention",)),
    # before: deepseek_v2's defaults leave num_experts_per_tok null; the tiny model failed in topk(k=None) and
    # check refused the base variant. A review note says the real value is unknown
    Drafted("deepseek_v2", "null_experts_per_token_is_filled_for_the_router",
            has=("\n  num_experts_per_tok: 2\n", "num_experts_per_tok is null in the config.json")),
    # before: sarvam_moe's checkpoint fuses q, k and v (GQA: k and v smaller than q) into query_key_value, which
    # transformers splits by each target's size; the loader took the converter for one parameter only, and
    # k_proj / v_proj were reported missing
    Drafted("sarvam_moe", "fused_qkv_split_into_unequal_gqa_parts"),
    # before: minimax's lightning-attention layers keep K^T V in MiniMaxCache.linear_cache through
    # get_linear_cache / set_linear_cache, outside transformers' cache layers; new refused it
    Drafted("minimax", "state_kept_by_methods_of_the_models_own_cache_drafts_and_checks",
            lacks=("TODO review",), values={
                "state.recurrent_methods": {"get": "get_linear_cache", "set": "set_linear_cache"},
                "state.layer_kinds": ["linear_attention"],
                "state": lambda state: "recurrent_dtype" not in state}),
    # before: distconf new failed ("Zamba2HybridLayer(shared_transformer, linear, mamba) is not built from the
    # config"); its shared blocks hold per-layer adapters picked by the layer index
    Drafted("zamba2", "shared_blocks_with_per_layer_adapters_draft_and_check", values={
        "block.constructor": {"from_model": True},
        "block.call.layer_idx_argument": "layer_idx",
        "hidden_state.carried.0.initial": "hidden"}),
]


@pytest.mark.parametrize("case", DRAFTED, ids=lambda case: f"{case.model_type}-{case.proves}")
def test_the_draft_says_what_the_fix_made_it_say(case: Drafted, tmp_path: Path, fresh_cache: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    if case.check:
        code, text = draft_and_check(case.model_type, tmp_path)
        assert code == 0, capsys.readouterr().err
    else:
        assert new_from_defaults(case.model_type, tmp_path) == 0
        (path,) = (tmp_path / "out").glob("*.yaml")
        text = path.read_text()
    for part in case.has:
        assert part in text, part
    for part in case.lacks:
        assert part not in text, part
    for pattern in case.matches:
        assert re.search(pattern, text), pattern
    draft = yaml.safe_load(text)
    for path, wanted in case.values.items():
        value = _at(draft, path)
        if isinstance(wanted, Callable):
            assert wanted(value), (path, value)
        else:
            assert value == wanted, (path, value)


def test_expert_group_count_is_a_group_role() -> None:
    # bailing_hybrid's row: num_expert_group shrinks as a count of groups, not of experts
    from transformers import BailingHybridConfig

    from distconf.tools.drafting.fields import FieldNames, role_of

    names = FieldNames.of(BailingHybridConfig)
    assert role_of("num_expert_group", 8, names) == "expert_groups"
    assert role_of("num_experts", 512, names) == "experts"
