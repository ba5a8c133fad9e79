"""``check`` names the cause when a model carries a value from each layer into the next besides the hidden states.

The sweep's zaya hands every layer the router states of the layer before it
(``prev_router_hidden_states``). A family file that does not carry it (no ``hidden_state.carried``) has
blocks start that stream anew (None), so their outputs differ from the model's. The failure names the stream
instead of advising edits to fields that cannot help.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import new_from_defaults

from distconf.cli import main
from distconf.loader.registry import clear_cache


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_a_carried_stream_is_named_as_the_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert new_from_defaults("zaya", tmp_path, family="zaya_carried") == 0
    (draft,) = (tmp_path / "out").glob("*.yaml")
    text = draft.read_text()
    start = text.index("\nhidden_state:\n")  # the drafted section carrying the stream, taken out
    end = next(i for i in range(start + 1, len(text)) if text[i - 1] == "\n" and text[i] not in " -#\n"
               and i > start + len("\nhidden_state:\n"))
    draft.write_text(text[:start + 1] + text[end:])
    clear_cache()  # distconf new checked the draft in this process: forget the class synthesized from it
    capsys.readouterr()
    assert main(["check", str(draft)]) == 1
    out = capsys.readouterr()
    line = next(x for x in (out.out + out.err).splitlines() if x.startswith("zaya_carried ["))
    assert "prev_router_hidden_states" in line
    assert "check block.position" not in line and "Traceback" not in out.err
