"""What the drafter and the family schema refuse, in one line naming the cause, for the cases the architecture
sweep found; one table row per refusal, its id saying what it proves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
from sweephelpers import new_fails

NEW_FAILS = [
    # has: texts the one line of `distconf new` holds; lacks: texts it must not hold
    pytest.param("cpmant", ("the model is not causal", "bidirectional"), (),
                 id="cpmant-a_model_that_is_not_causal_fails_new_in_one_line"),
    # its middle layers run three passes in one forward (no chain of blocks runs a layer twice): the stack is
    # drafted, then the loop's own state shapes stop the draft in one line
    pytest.param("inkling2_loop_text", (), ("block_states",), marks=pytest.mark.slow,  # seconds: a looped stack
                 id="inkling2_loop_text-a_looped_stack_with_state_shapes_of_its_own_fails_in_one_line"),
]


@pytest.mark.parametrize(("model_type", "has", "lacks"), NEW_FAILS)
def test_new_fails_in_one_line(model_type: str, has: tuple[str, ...], lacks: tuple[str, ...], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    line = new_fails(model_type, tmp_path, capsys)
    assert all(part in line for part in has), line
    assert not any(part in line for part in lacks), line


_BLOCK = {"layer_class": "transformers.A", "attention_class": "transformers.B", "prefix": "model.layers"}

BLOCK_REFUSED = [
    pytest.param({"constructor": {"layer_type_argument": "layer_type"}},
                 r"layer_type_argument needs mask\.layer_types_field",
                 id="constructor_layer_type_argument_needs_layer_types_field"),
    pytest.param({"call": {"mask_argument": None}, "mask": {"as_dict": {"causal": "attention"}}},
                 r"mask\.as_dict needs call\.mask_argument", id="dict_mask_needs_the_mask_keyword"),
]


@pytest.mark.parametrize(("block", "message"), BLOCK_REFUSED)
def test_the_block_section_refuses(block: dict[str, Any], message: str) -> None:
    from pydantic import ValidationError

    from distconf.loader.spec_block import BlockSpec

    with pytest.raises(ValidationError, match=message):
        BlockSpec.model_validate({**_BLOCK, **block})


_NO_SOURCE = r"exactly one of output_index .*, computed_by .* and grows"

CARRIED_REFUSED = [
    pytest.param({}, _NO_SOURCE, id="no_source"),
    pytest.param({"output_index": 1, "grows": {"every": 2}}, "exactly one", id="output_index_and_grows"),
    pytest.param({"computed_by": "model.f", "grows": {"every": 2}}, "exactly one", id="computed_by_and_grows"),
    pytest.param({"output_index": 1, "computed_by": "model.f"}, "exactly one", id="output_index_and_computed_by"),
]


@pytest.mark.parametrize(("source", "message"), CARRIED_REFUSED)
def test_a_carried_value_is_a_layer_output_a_computed_value_or_a_growing_stack(source: dict[str, Any],
                                                                                 message: str) -> None:
    """Exactly one of output_index, computed_by and grows says where a carried value comes from."""
    from distconf.loader.spec_wire import CarriedStream

    with pytest.raises(ValueError, match=message):
        CarriedStream.model_validate({"argument": "s", "width": 4, **source})


def test_a_growing_stack_alone_is_a_carried_value() -> None:
    from distconf.loader.spec_wire import CarriedStream

    assert CarriedStream.model_validate({"argument": "s", "width": 4, "grows": {"every": 2}}).grows.every == 2
