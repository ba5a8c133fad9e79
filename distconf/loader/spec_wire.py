"""The family-file model of the hidden state between layers (`HiddenStateSpec`) and what it says on a config.

A model whose layers hand each other several streams of ``hidden_size`` values (manifold hyper-connections:
``[batch, seq, streams, hidden_size]``) sends them flattened (`streams_of`, `stream_axis_of`). A value the model
carries from each layer to the next besides the hidden states (``hidden_state.carried``, `CarriedStream`) travels
on the wire after them (`carried_widths`); a stack the loop grows from the layers' inputs (``grows``,
`GrowingStack`) is carried at its largest, every entry the model makes: ``ceil(num_hidden_layers / every)``
entries of ``width`` (`stack_entries`), the ones not made yet zeros. The wire's order and width are
`distconf.loader.wire_layout`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from distconf.loader.formula import count_on
from distconf.loader.spec_types import IntOrFormula, StrictModel

__all__ = ["CarriedArgument", "CarriedStream", "GrowingStack", "HiddenStateSpec", "carried_widths", "stack_entries",
           "streams_of", "stream_axis_of", "loops_layers"]

_MODULE_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class GrowingStack(StrictModel):
    """A carried value the layer loop grows itself: a stack of earlier layers' inputs each layer reads whole.

    ``if layer.is_boundary: stack = torch.cat([stack, hidden_states.unsqueeze(-2)], dim=-2)`` after each layer
    whose index is a multiple of ``every``: layer ``i`` reads ``ceil(i / every)`` entries ``[batch, seq, n, width]``
    (the inputs of layers ``0, every, 2 * every, ...``). The layer does not return it: the block appends its
    layer's input itself. ``read_by``: the model-level module reading the whole stack after the last layer
    (its first argument), handed the blocks' stack by the client.
    """

    every: IntOrFormula = Field(description="The loop appends the input of each layer whose index is a multiple of "
                                            "this (an integer or a formula, e.g. n_layers_per_attn_res_block).")
    read_by: str | None = Field(default=None, pattern=_MODULE_PATH,
                                description="Dotted name, in the causal LM, of the module the model hands the "
                                            "final stack after the last layer (e.g. model.final_input).")


class CarriedStream(StrictModel):
    """A value the model's layer loop hands each layer from the layer before, carried on the wire.

    ``hidden_states, carried = layer(hidden_states, carried, ...)`` starting from None: the wire holds the
    value's ``width`` values per token after the hidden states; a block passes them to its layer as
    ``argument`` and puts the layer's ``output_index``-th output back in their place. The first layer gets
    ``initial`` (``zeros``: the model's None, for a layer that adds the value to one of its own).

    A value the model computes once, before the layers, and slices for each layer (``per_layer_input =
    per_layer_inputs[:, :, i, :]``) is ``computed_by`` the model method returning it: ``width`` is one layer's
    part, the wire holds ``num_hidden_layers * width`` values per token (every layer's part, the client's
    model computing them as the model does) and a block passes its layer's part, handing the whole on unchanged.
    With ``grows`` the value is a stack of ``width``-wide entries the loop appends to (`GrowingStack`), no output.
    Exactly one of ``output_index``, ``computed_by``, ``initial: token_ids`` and ``grows`` says where it comes from,
    except for the embeddings every layer gets alongside the hidden states (``initial: hidden``, none of them),
    which pass through every layer unchanged.
    """

    argument: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                          description="The decoder layer's argument the value is passed as (by keyword).")
    width: IntOrFormula = Field(description="Values per token (an integer or a formula over config fields, "
                                            "e.g. router_hidden_size); for token_ids, base-256 digits per id; "
                                            "with grows, of each entry.")
    output_index: int | None = Field(default=None, ge=1, description="Index of the value in the layer's output "
                                     "tuple (a value each layer hands the next; not with computed_by, token_ids or "
                                     "grows).")
    computed_by: str | None = Field(
        default=None, pattern=_MODULE_PATH,
        description="Dotted name, in the causal LM, of the model method whose result the model slices for each "
                    "layer (e.g. model.project_per_layer_inputs: [batch, seq, layers, width]); the client sends "
                    "every layer's slice, each block passes its layer's (not with output_index).")
    grows: GrowingStack | None = Field(
        default=None, description="The value is a stack the loop grows from layers' inputs, not a layer output "
                                  "(not with output_index, computed_by or token_ids).")
    initial: Literal["zeros", "token_ids", "hidden"] = Field(
        default="zeros", description="What the first layer gets: zeros, which the layer treats as the model's None; "
                                     "token_ids: the model's input ids [batch, seq], handed to every layer unchanged "
                                     "and sent as width base-256 digits per token (exact in bf16); hidden: the first "
                                     "layer's input hidden states (the embeddings), which then pass through every "
                                     "layer (no output_index, no computed_by).")

    @model_validator(mode="after")
    def _one_source(self) -> CarriedStream:
        sources = [self.output_index is not None, self.computed_by is not None, self.initial == "token_ids",
                   self.grows is not None]
        if self.initial == "hidden" and any(sources):
            raise ValueError(f"carried {self.argument!r}: initial: hidden (the embeddings, passed through every "
                             "layer) takes neither output_index nor computed_by nor grows")
        if self.initial != "hidden" and sum(sources) != 1:
            raise ValueError(f"carried {self.argument!r}: give exactly one of output_index (a layer's output handed "
                             "to the next layer), computed_by (a model method's per-layer result), initial: "
                             "token_ids (the model's ids, handed to every layer) and grows (a stack the loop grows)")
        return self


class HiddenStateSpec(StrictModel):
    """The hidden state the model's layers hand each other, when it is not one ``[batch, seq, hidden_size]``.

    With ``streams: N`` every layer takes and returns ``[batch, seq, N, hidden_size]`` (``[N, batch, seq,
    hidden_size]`` with ``stream_axis: 0``): the model expands
    its embedding output to N streams before the first layer and collapses them with ``collapse_module``
    after the last one, before the final norm. Blocks exchange the streams flattened (``N * hidden_size``
    values per token); the block reshapes them around its layer, the client's model expands and collapses
    them itself (the collapse module is a non-block module, loaded with the final norm).
    """

    streams: IntOrFormula = Field(
        default=1,
        description="Streams of hidden_size values the hidden state holds between layers (an integer or a "
                    "formula over config fields, e.g. hc_mult).",
    )
    stream_axis: Literal[0, 2] = Field(
        default=2,
        description="Where the streams sit in the layers' hidden state: 2, [batch, seq, streams, hidden_size] "
                    "(manifold hyper-connections); 0, [streams, batch, seq, hidden_size] (Gemma 3n's AltUp). "
                    "The wire holds them flattened either way.",
    )
    collapse_module: str | None = Field(
        default=None,
        pattern=_MODULE_PATH,
        description="Dotted name, in the causal LM, of the model-level module that collapses the streams to "
                    "[batch, seq, hidden_size] after the last layer (e.g. model.hc_head); its weights are "
                    "non-block tensors the client loads. Required with several streams.",
    )
    carried: list[CarriedStream] = Field(
        default_factory=list, description="Values the layer loop carries from each layer to the next, on the wire "
                                          "after the hidden states, in this order.")

    @model_validator(mode="after")
    def _several_streams(self) -> HiddenStateSpec:
        if isinstance(self.streams, int) and self.streams < 1:
            raise ValueError(f"streams must be at least 1, got {self.streams}")
        if self.streams != 1 and self.collapse_module is None:
            raise ValueError("several streams need collapse_module (the module collapsing them after the last layer)")
        if self.streams == 1 and self.stream_axis != 2:
            raise ValueError("stream_axis places several streams: it takes streams other than 1")
        if self.streams == 1 and not self.carried:
            raise ValueError("a hidden_state of one stream carrying nothing is the default: remove the section")
        names = [c.argument for c in self.carried]
        if len(set(names)) != len(names):
            raise ValueError(f"carried: an argument named twice in {names}")
        return self


class CarriedArgument(StrictModel):
    """A value the model hands each layer from the layer before it, which a block is not handed.

    ``stand_in: all_keys``: the block passes the indices of every key the layer attends to
    (``[batch, seq, keys]``, int32, ``0 .. keys - 1`` for each query), which is what a top-k selection
    of at most ``k`` keys hands on while there are no more than ``k`` keys (a sparse-attention layer
    reusing the previous layer's top-k indices then attends to every key, as the model does). Past
    ``exact_up_to`` keys the selection would drop some: the block refuses the step instead of differing.
    """

    stand_in: Literal["all_keys"] = Field(description="What the block passes in place of the carried value.")
    exact_up_to: IntOrFormula = Field(
        description="Keys (cached plus new tokens) up to which the stand-in equals the model's value (an integer "
                    "or a formula over config fields, e.g. index_topk); a longer sequence is refused.",
    )


def streams_of(config: Any) -> int:
    """Streams of ``hidden_size`` values the hidden state of ``config``'s family holds between layers (1: plain)."""
    spec = getattr(type(config), "family_spec", None)
    hidden_state = getattr(spec, "hidden_state", None)
    if hidden_state is None:
        return 1
    return count_on(config, spec.family, "hidden_state.streams", hidden_state.streams)


def stream_axis_of(config: Any) -> int:
    """Where the streams sit in the layers' hidden state of ``config``'s family: 2 (``[batch, seq, streams,
    hidden]``, also for one stream) or 0 (``[streams, batch, seq, hidden]``)."""
    hidden_state = getattr(getattr(type(config), "family_spec", None), "hidden_state", None)
    return 2 if hidden_state is None else hidden_state.stream_axis


def stack_entries(config: Any, index: int) -> tuple[int, int]:
    """``(every, entries)`` of the growing stack ``hidden_state.carried[index]``: the model's whole stack holds
    ``ceil(num_hidden_layers / every)`` entries."""
    from distconf.loader.naming import config_num_blocks

    spec = type(config).family_spec
    every = count_on(config, spec.family, f"hidden_state.carried[{index}].grows.every",
                      spec.hidden_state.carried[index].grows.every)
    return every, -(-config_num_blocks(config) // every)


def carried_widths(config: Any) -> tuple[int, ...]:
    """Values per token of each of ``hidden_state.carried`` on ``config`` (in the wire's order; () for none): a
    ``computed_by`` value's width for each of the model's layers, a growing stack's for each of its entries."""
    spec = getattr(type(config), "family_spec", None)
    hidden_state = getattr(spec, "hidden_state", None)
    carried = hidden_state.carried if hidden_state is not None else ()
    widths = []
    for index, stream in enumerate(carried):
        width = count_on(config, spec.family, f"hidden_state.carried[{index}].width", stream.width)
        if stream.grows is not None:
            width *= stack_entries(config, index)[1]
        elif stream.computed_by is not None:
            width *= int(config.num_hidden_layers)
        widths.append(width)
    return tuple(widths)


def loops_layers(config: Any) -> bool:
    """Whether ``config``'s family loops a range of layers (``block.layer_stack``): the wire then holds the
    stack's input after the hidden state and the carried values, as wide as the hidden state."""
    spec = getattr(type(config), "family_spec", None)
    return getattr(getattr(spec, "block", None), "layer_stack", None) is not None
