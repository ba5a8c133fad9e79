"""Recurrent model types the architecture sweep refused, drafted and checked end to end.

As the sweep does: a transformers config class's defaults are saved, ``distconf new`` drafts a
family from them and ``distconf check`` proves the draft against transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import draft_and_check, drafted_tiny_blocks

from distconf.loader.formula import Formula, FormulaError


def test_formula_int_truncates_a_float_factor() -> None:
    formula = Formula("int(hidden_size * qk_dim_factor) // num_heads")
    assert formula.evaluate({"hidden_size": 100, "qk_dim_factor": 0.5, "num_heads": 8}) == 6
    with pytest.raises(FormulaError, match="one argument"):
        Formula("int(hidden_size, 2)")
    with pytest.raises(FormulaError, match="failed"):
        Formula("int(x)").evaluate({"x": float("inf")})


def test_layer_count_filled_from_num_hidden_layers_is_an_alias() -> None:
    from transformers import LlamaConfig, xLSTMConfig

    from distconf.tools.drafting.fields import FieldNames

    assert FieldNames.of(xLSTMConfig).standard("num_blocks") == "num_hidden_layers"
    assert FieldNames.of(LlamaConfig).standard("num_blocks") == "num_blocks"


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_state_tuple_each_layer_takes_and_returns_drafts_and_checks(tmp_path: Path, fresh_cache,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # before: xlstm's model takes an xLSTMCache of its own and new refused it before any tiny model ran;
    # its layers take their (C, n, m) states as a tuple and return the new one, sized by a float factor
    # (int(hidden_size * qk_dim_factor) // num_heads), and its num_blocks builds the layers
    import yaml

    code, draft = draft_and_check("xlstm", tmp_path)
    out = capsys.readouterr()
    spec = yaml.safe_load(draft)
    state = spec["state"]
    assert state["returned_tuple"] is True and state["recurrent_dtype"] == "float32"
    assert len(state["recurrent_shape"]) == 3
    assert "qk_dim_factor) // num_heads" in state["recurrent_shape"][0][1]
    assert state["recurrent_shape"][2][1] == 1  # not a quotient of two fields equal by chance
    assert "v_dim_factor) // num_heads" in state["recurrent_shape"][0][2]  # a factor of 1.0 told apart
    assert spec["block"]["call"]["cache_argument"] == "state"
    assert spec["tiny_config"]["num_blocks"] == spec["tiny_config"]["num_hidden_layers"]
    assert "TODO review" not in draft
    assert code == 0, out.err


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_blocks_keeping_a_returned_state_tuple_step_like_the_model(tmp_path: Path, fresh_cache) -> None:
    """A chain of the drafted xlstm blocks: the layers' outputs, any split into steps, beam reorder, restart."""
    import torch
    from blockhelpers import record_layers
    from sessionhelpers import session_with_beam_and_restart, steps

    from distconf.blocks.sizing import state_bytes_per_sequence
    from distconf.blocks.state import state_geometry

    config, model, blocks, _ = drafted_tiny_blocks("xlstm", tmp_path, check=False)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block, (inputs, outputs) in zip(blocks, record_layers(model, config, ids, use_cache=False)):
            torch.testing.assert_close(block(inputs)[0], outputs, rtol=1e-5, atol=1e-5)
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole, pasts = steps(blocks, hidden, [9])
    geometry = state_geometry(config, 0)
    assert pasts[0][0] is None  # no conv state
    assert [tuple(t.shape[1:]) for t in pasts[0][1:]] == list(geometry.recurrent_shapes)
    assert state_bytes_per_sequence(config, torch.bfloat16, 0) == 4 * geometry.recurrent_values  # float32 states
    for sizes in ([1] * 9, [4, 2, 1, 2], [3, 6]):
        stepped, _ = steps(blocks, hidden, sizes)
        torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)
    session_with_beam_and_restart(config, blocks)
