"""``check`` names the cause when a model carries a value from each layer into the next besides the hidden states.

The sweep's zaya hands every layer the router states of the layer before it
(``prev_router_hidden_states``); a block starts that stream anew (None), so its outputs differ from the
model's. The failure names the stream and says no family file can cure it, instead of advising edits to
fields that cannot help.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import new_from_defaults

from distconf.cli import main


def test_a_carried_stream_is_named_as_the_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert new_from_defaults("zaya", tmp_path, family="zaya_carried") == 0
    (draft,) = (tmp_path / "out").glob("*.yaml")
    capsys.readouterr()
    assert main(["check", str(draft)]) == 1
    out = capsys.readouterr()
    line = next(x for x in (out.out + out.err).splitlines() if x.startswith("zaya_carried ["))
    assert "prev_router_hidden_states" in line and "no family file can cure" in line
    assert "check block.position" not in line and "Traceback" not in out.err
