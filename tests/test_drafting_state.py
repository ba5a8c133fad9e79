"""The drafter writes the ``state`` section of recurrent / state-space families from what tiny models cache."""

from __future__ import annotations

import json

import pytest

from distconf.loader.formula import Formula, evaluate_on
from distconf.loader.presets import preset_path
from distconf.tools.drafting import draft_family
from distconf.tools.drafting.common import DraftingError
from distconf.tools.drafting.layer_state import LayerState
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.state_layout import StateLayout, state_layout
from distconf.tools.drafting.state_section import apply_state


def _preset(hub_id: str) -> dict:
    return json.loads(preset_path(hub_id).read_text(encoding="utf-8"))


def _value(formula: int | str, config: object) -> int:
    return evaluate_on(Formula(formula) if isinstance(formula, str) else formula, config)


@pytest.mark.slow
def test_pure_state_space_draft_names_the_state_formulas() -> None:
    from transformers import Mamba2Config

    draft = draft_family("drafted_mamba2", _preset("mistralai/Mamba-Codestral-7B-v0.1"))
    assert not draft.review, draft.review
    assert draft.state["recurrent_shape"] == ["num_heads", "head_dim", "state_size"]
    assert draft.state["conv_shape"][1] == "conv_kernel"
    assert draft.state["recurrent_dtype"] == "float32"  # read from a bfloat16 run
    assert draft.mask["layer_kinds"] == {"linear_attention": "none"}
    assert draft.attention_class.endswith("Mamba2Mixer")  # the module given the cache
    assert "kv_groups" not in draft.to_yaml()
    real = Mamba2Config(**_preset("mistralai/Mamba-Codestral-7B-v0.1"))  # the formulas hold on the real sizes
    assert _value(draft.state["conv_shape"][0], real) == \
        int(real.expand * real.hidden_size) + 2 * real.n_groups * real.state_size


@pytest.mark.slow
def test_hybrid_draft_names_which_layer_types_keep_what() -> None:
    draft = draft_family("drafted_granite_h", _preset("ibm-granite/granite-4.0-h-tiny"))
    assert not draft.review, draft.review
    assert draft.state["layer_kinds"] == ["linear_attention"]
    assert draft.kv_cache["layer_kinds"] == ["full_attention"]
    assert draft.mask["layer_kinds"] == {"full_attention": "causal", "linear_attention": "none"}
    assert draft.attention_class.endswith("GraniteMoeHybridAttention")
    assert draft.state["recurrent_shape"] == ["mamba_n_heads", "mamba_d_head", "mamba_d_state"]


def test_a_size_no_field_gives_is_a_problem_not_a_guess() -> None:
    from transformers import Mamba2Config

    config = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
                          num_hidden_layers=2, vocab_size=256)
    states = [LayerState(conv=(9973, 4), recurrent=(8, 16, 16), recurrent_dtype="float32")] * 2
    layout = state_layout(config, {}, states, lambda: None, lambda name, value: None)
    assert layout is not None and layout.problem and "conv_shape[0]" in layout.problem


def test_layers_keeping_states_of_different_shapes_are_a_problem() -> None:
    from transformers import Mamba2Config

    config = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, num_hidden_layers=2, vocab_size=256)
    states = [LayerState(conv=(144, 4)), LayerState(conv=(96, 4))]
    layout = state_layout(config, {}, states, lambda: None, lambda name, value: None)
    assert layout is not None and "different shapes" in (layout.problem or "")


def test_no_state_no_section() -> None:
    from transformers import Mamba2Config

    assert state_layout(Mamba2Config(), {}, [LayerState(kv=True)], lambda: None, lambda n, v: None) is None


def test_a_perturbed_run_tells_coincident_fields_apart() -> None:
    from transformers import Mamba2Config

    # state_size and conv_kernel are both 4: only a run with one of them changed says which one the size is
    config = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=4, n_groups=2, conv_kernel=4,
                          num_hidden_layers=2, vocab_size=256)
    states = [LayerState(recurrent=(8, 16, 4), recurrent_dtype="float32")]

    def perturb(name: str, value: int) -> tuple[object, list[LayerState]] | None:
        try:
            changed = Mamba2Config(**{**config.to_dict(), name: value})
        except Exception:  # the class refuses inconsistent sizes, as the tiny run would
            return None
        return changed, [LayerState(recurrent=(changed.num_heads, changed.head_dim, changed.state_size))]

    layout = state_layout(config, {}, states, lambda: None, perturb)
    assert layout is not None and layout.state["recurrent_shape"][2] == "state_size"


def test_an_undeclarable_state_fails_the_draft_in_one_line() -> None:
    draft = FamilyDraft(family="x", model_type="x", config_class="x", layer_class="x", attention_class=None,
                        prefix="layers")
    with pytest.raises(DraftingError) as raised:
        apply_state(draft, StateLayout({}, problem="a layer keeps two conv states"), False)
    assert "\n" not in str(raised.value) and "two conv states" in str(raised.value)


@pytest.mark.slow
def test_a_selective_scan_reading_its_state_in_one_token_steps_drafts_one_token() -> None:
    from transformers import FalconMambaConfig

    config = {**FalconMambaConfig().to_dict(), "model_type": "falcon_mamba"}
    draft = draft_family("drafted_selective_scan", config)
    assert not draft.review, draft.review
    assert draft.state["continuation"] == "one_token"
    assert draft.state["recurrent_shape"] == ["intermediate_size", "state_size"]


@pytest.mark.slow
def test_a_hybrid_with_mlp_only_layers_maps_every_layer_type() -> None:
    from transformers import NemotronHConfig

    config = {**NemotronHConfig().to_dict(), "model_type": "nemotron_h"}
    draft = draft_family("drafted_hybrid_mlp", config)
    kinds = draft.mask["layer_kinds"]
    assert {"causal", "none"} <= set(kinds.values()) and len(kinds) > 2  # MLP-only layers get none too
    assert set(draft.kv_cache["layer_kinds"]) <= {t for t, k in kinds.items() if k != "none"}
    assert all(kinds[t] == "none" for t in draft.state["layer_kinds"])
