"""One wire layout for client, server and blocks: every part's width adds up to the config's ``wire_width``, and
splitting a wire into its parts and joining them again gives the same wire, for every built-in family."""

from __future__ import annotations

import pytest
import torch
from blockhelpers import family_config

from distconf.blocks.wire import split_carried
from distconf.loader import list_families
from distconf.loader.wire_layout import WireLayout, wire_layout


@pytest.mark.parametrize("family", list_families())
def test_the_parts_of_the_wire_add_up_and_come_apart_losslessly(family: str) -> None:
    config, _, _ = family_config(family)
    layout = wire_layout(config)
    assert layout.width == config.wire_width
    wire = torch.randn(2, 3, layout.width)
    rest, loop_input = layout.split_loop(wire)
    assert (loop_input is None) == (not layout.loops)
    rest, shared = layout.split_shared(rest)
    assert sorted(shared) == sorted(slot.key for slot in layout.shared)
    hidden, carried = layout.split_carried(rest)
    assert hidden.shape[-1] == layout.hidden == layout.streams * config.hidden_size
    assert [part.shape[-1] for part in carried] == [slot.width for slot in layout.carried]
    again = layout.join_loop(layout.join_shared(torch.cat([hidden, *carried], dim=-1), shared), loop_input)
    assert torch.equal(again, wire)


def test_a_wire_too_narrow_for_its_parts_is_one_clear_error() -> None:
    layout = WireLayout(4, carried=(), loops=True)
    with pytest.raises(ValueError, match="cannot hold 4 values of a looped stack's input"):
        layout.split_loop(torch.zeros(1, 1, 4))
    assert split_carried(torch.zeros(1, 1, 4), ())[0].shape[-1] == 4
