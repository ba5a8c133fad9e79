"""The family-file model of a looped layer stack (``block.layer_stack``): layers the model runs several times.

A model may run a contiguous range of its decoder layers ``[start, end)`` ``count`` times in one forward pass
(a recurrent section). A chain of blocks runs each block once, so distconf serves the unrolled stack: its blocks
are the model's layers in the order the forward pass runs them, ``start`` layers, then the looped range ``count``
times, then the rest, each block built and loaded from the model layer it runs
(`distconf.loader.layer_stack`, the one home of the block/layer arithmetic). At each pass's entry the model
combines the hidden state with the stack's input (the hidden state entering layer ``start``): ``entry:
module_sum`` is ``entry_module(hidden) + entry_module(input)``; that input travels on the wire after the hidden
state (`distconf.loader.wire_layout.wire_width_of`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distconf.loader.spec_types import Identifier, IntOrFormula, ScalarValue, StrictModel

__all__ = ["LayerStackSpec", "LoopSpec"]

_MODULE_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class LoopSpec(StrictModel):
    """Layers ``[start, end)`` of the model run ``count`` times in a row, each pass entered by ``entry``."""

    start: IntOrFormula = Field(description="First looped layer (an integer or a formula, e.g. n_input_layers).")
    end: IntOrFormula = Field(description="One past the last looped layer (e.g. n_input_layers + "
                                          "n_recurrent_layers).")
    count: IntOrFormula = Field(description="Passes through the looped layers (e.g. n_recurrent_loops).")
    entry: Literal["module_sum"] = Field(
        default="module_sum",
        description="How a pass starts: module_sum, hidden = entry_module(hidden) + entry_module(input), input "
                    "being the hidden state entering the first pass.")
    entry_module: str = Field(pattern=_MODULE_PATH,
                              description="Dotted name, in the causal LM, of the weightless module applied at "
                                          "each pass's entry (e.g. model.norm).")
    requires: dict[Identifier, ScalarValue] = Field(
        default_factory=dict,
        description="Config field -> the value the loop's blocks are exact for (e.g. a cache mode); a config "
                    "with another value is refused.")


class LayerStackSpec(StrictModel):
    """How the model runs its layer list, when it is not each layer once in order."""

    loop: LoopSpec = Field(description="A range of layers the model runs several times in one forward pass.")
