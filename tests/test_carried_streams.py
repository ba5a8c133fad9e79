"""hidden_state.carried: a value the layer loop carries from layer to layer travels on the wire (zaya)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from sweephelpers import new_from_defaults

from distconf.loader.spec_wire import HiddenStateSpec


def test_carried_spec_needs_no_streams_and_streams_need_collapse() -> None:
    spec = HiddenStateSpec.model_validate(
        {"carried": [{"argument": "prev_router_hidden_states", "width": "router_hidden_size", "output_index": 1}]})
    assert spec.streams == 1 and spec.collapse_module is None
    try:
        HiddenStateSpec.model_validate({"streams": 4})
    except ValueError as exc:
        assert "collapse_module" in str(exc)
    else:
        raise AssertionError("several streams without collapse_module validated")


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_zaya_drafts_the_carried_router_states(tmp_path: Path) -> None:
    new_from_defaults("zaya", tmp_path)
    family = yaml.safe_load((tmp_path / "out" / "zaya.yaml").read_text())
    assert family["hidden_state"]["carried"] == [
        {"argument": "prev_router_hidden_states", "width": "router_hidden_size", "output_index": 1}]
