"""The drafter writes ``block.layer_classes`` and ``block.model_buffers`` (issue 23), each pinned end to end.

Each test drafts a family from a transformers config class's defaults with ``distconf new``
and proves it with ``distconf check``, as the architecture sweep does; the unit tests
run the inference on the real transformers models built on the meta device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from sweephelpers import draft_and_check


def _draft_and_check(model_type: str, folder: Path) -> tuple[int, dict]:
    """`sweephelpers.draft_and_check`, with the draft parsed."""
    code, text = draft_and_check(model_type, folder)
    return code, yaml.safe_load(text)


def _scan(model_type: str) -> tuple[Any, Any]:
    """The scan of ``model_type``'s default model (built on the meta device) and its config."""
    from transformers import AutoConfig

    from distconf.tools.drafting.common import field_value
    from distconf.tools.drafting.scan import meta_model, scan_model

    config_class = type(AutoConfig.for_model(model_type))
    full, model = meta_model(config_class, AutoConfig.for_model(model_type).to_dict())
    return scan_model(model, field_value(full, "num_hidden_layers")), full


@pytest.mark.parametrize("model_type", ["jamba", "olmo_hybrid"])
@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_layer_class_per_layer_type_is_drafted(model_type: str, tmp_path: Path, fresh_cache,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # before: the drafter wrote the first layer's class for every layer, and check failed at block.layer_class
    code, draft = _draft_and_check(model_type, tmp_path)
    out = capsys.readouterr()
    classes = draft["block"]["layer_classes"]
    assert list(classes) == ["full_attention"]
    assert classes["full_attention"].endswith("AttentionDecoderLayer")
    assert draft["block"]["layer_class"] != classes["full_attention"]
    assert code == 0, out.err


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_model_buffers_are_drafted(tmp_path: Path, fresh_cache, capsys: pytest.CaptureFixture[str]) -> None:
    # before: the block lacked the mixer's mup_vector (the model registers it after building its layers),
    # and a layer type keeping both K/V and a state got no kv_cache.layer_kinds (its blocks kept no K/V)
    code, draft = _draft_and_check("falcon_h1", tmp_path)
    out = capsys.readouterr()
    (path, function), = draft["block"]["model_buffers"].items()
    assert path == "mamba.mup_vector" and function.endswith(".compute_mup_vector")
    assert draft["kv_cache"]["layer_kinds"] == ["hybrid"]
    assert code == 0, out.err


def test_buffers_a_layer_builds_itself_are_not_model_buffers() -> None:
    from distconf.tools.drafting.model_buffers import added_buffers
    from distconf.tools.drafting.render import FamilyDraft

    scan, full = _scan("falcon_h1")
    draft = FamilyDraft(family="x", model_type="x", config_class="x", layer_class="x", attention_class=None,
                        prefix=scan.prefix)
    assert any(True for _ in scan.layers[0].named_buffers())
    assert set(added_buffers(draft, scan, full)) == {"mamba.mup_vector"}


def test_layer_classes_by_type_refuses_types_of_mixed_classes() -> None:
    from distconf.tools.drafting.layer_classes import layer_classes_by_type

    scan, full = _scan("jamba")
    by_type = layer_classes_by_type(scan, full.layer_types)
    assert isinstance(by_type, dict) and set(by_type) == {"full_attention", "linear_attention"}
    assert isinstance(layer_classes_by_type(scan, None), str)
    mixed = layer_classes_by_type(scan, ["one"] * len(scan.layers))
    assert isinstance(mixed, str) and "layers of type 'one' are of several" in mixed


def test_layer_assembled_from_modules_is_taken_from_the_model() -> None:
    # zamba2's hybrid layers are built by the model from modules of its own (not from the config): each block's
    # layer comes from the model built on meta (block.constructor.from_model), said in the draft's facts
    from transformers import AutoConfig

    from distconf.tools.drafting import draft_family

    draft = draft_family("zamba2", AutoConfig.for_model("zamba2").to_dict(), run_tiny=False)
    assert draft.constructor == {"from_model": True}
    assert any("Zamba2HybridLayer(shared_transformer, linear, mamba) not built from the config" in fact
               for fact in draft.facts)
