"""``distconf new`` prints the layer-kind coverage of its draft, counted as ``distconf check`` counts it."""

from __future__ import annotations

import pytest

from distconf.cli import main
from distconf.loader.presets import preset_path


@pytest.mark.parametrize("hub_id", ["google/gemma-2-9b", "EleutherAI/gpt-neo-1.3B"])
def test_new_prints_layer_kind_coverage(hub_id: str, tmp_path, capsys, fresh_cache) -> None:
    assert main(["new", "drafted", "--from-config", str(preset_path(hub_id)), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "layer kinds:" in line)
    assert "(all)" in line and str(preset_path(hub_id)) in line, line
