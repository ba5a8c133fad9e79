"""How the client's stand-in for the decoder-layer list fits the transformers model around it.

The list the family's ``block.prefix`` names (which the stand-in replaces), the plain layer attributes and
carried arguments the stand-in mirrors, and the hooks that hand it values the model computes outside its
layers (``hidden_state.carried[].computed_by``) or hand the model what the blocks grew (``grows.read_by``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from distconf.blocks.hf_compat import HF_INITIALIZED
from distconf.blocks.weights import layer_prefixes
from distconf.blocks.wire import CarriedSlot, ModelInputCapture, carried_layout
from distconf.loader.config_protocol import DistributedConfig

__all__ = [
    "plain_attributes", "carried_arguments", "model_input_capture", "hand_final_stacks", "decoder_layer_list",
    "check_collapse_module",
]


def plain_attributes(layer: torch.nn.Module) -> dict[str, Any]:
    """Plain attributes of a decoder layer (e.g. its attention type) that a layer loop may read."""
    skip = {"training", HF_INITIALIZED}
    found: dict[str, Any] = {}
    for owner in reversed(type(layer).__mro__[:type(layer).__mro__.index(torch.nn.Module)]):
        found.update(vars(owner))  # class attributes too (e.g. a layer's attention_type)
    found.update(vars(layer))
    return {k: v for k, v in found.items()
            if not k.startswith("_") and k not in skip and isinstance(v, (str, int, float, bool, type(None)))}


def carried_arguments(layer: torch.nn.Module, config: DistributedConfig,
                       ) -> tuple[tuple[CarriedSlot, int | None], ...]:
    """``(slot, position after the hidden states or None)`` of each carried value."""
    names = [p.name for p in list(inspect.signature(type(layer).forward).parameters.values())[2:]
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple((slot, names.index(slot.argument) if slot.argument in names else None)
                 for slot in carried_layout(config))


def model_input_capture(model: torch.nn.Module, config: DistributedConfig) -> ModelInputCapture | None:
    """The capture of the methods ``hidden_state.carried[].computed_by`` names (None: none named)."""
    layout = carried_layout(config)
    if not any(slot.computed_by for slot in layout):
        return None
    try:
        return ModelInputCapture(model, layout)
    except ValueError as exc:
        index = next(k for k, slot in enumerate(layout) if slot.computed_by)
        raise type(config).family_source.error(("hidden_state", "carried", index, "computed_by"), str(exc)) from None


def hand_final_stacks(model: torch.nn.Module, config: DistributedConfig, stand_in: Any) -> None:
    """The module each growing stack's ``grows.read_by`` names gets, as its first argument, the stack the blocks
    returned (the model's own loop grows a stack of its one stand-in layer only). ``stand_in``: the client's
    `distconf.client.model.RemoteLayers`, whose ``stacks`` hold the stacks of the last call."""
    streams = type(config).family_spec.hidden_state.carried if type(config).family_spec.hidden_state else ()
    for stream in streams:
        if stream.grows is None or stream.grows.read_by is None:
            continue
        try:
            reader = model.get_submodule(stream.grows.read_by)
        except AttributeError:
            raise type(config).family_source.error(
                ("hidden_state", "carried", streams.index(stream), "grows", "read_by"),
                f"{type(model).__name__} has no module {stream.grows.read_by!r}") from None

        def hand(module: torch.nn.Module, args: tuple[Any, ...], name: str = stream.argument) -> tuple[Any, ...]:
            stack = stand_in.stacks.get(name)
            return (stack.to(args[0].dtype), *args[1:]) if stack is not None and args else args
        reader.register_forward_pre_hook(hand)


def decoder_layer_list(model: torch.nn.Module, config: DistributedConfig) -> tuple[str, torch.nn.ModuleList]:
    """``(dotted name, module)`` of ``model``'s decoder-layer list: the one the family's ``block.prefix`` names."""
    modules = dict(model.named_modules())
    for prefix in layer_prefixes(config, 0):
        name = prefix[: -len(".0.")]
        module = modules.get(name)
        if isinstance(module, torch.nn.ModuleList) and len(module) == config.num_hidden_layers:
            return name, module
    spec = type(config).family_spec
    raise type(config).family_source.error(
        ("block", "prefix"), f"{type(model).__name__} has no list of {config.num_hidden_layers} layers at "
        f"{spec.block.prefix!r} (base model prefix {spec.block.base_model_prefix!r})")


def check_collapse_module(model: torch.nn.Module, config: DistributedConfig) -> None:
    """The module ``hidden_state.collapse_module`` names is a module of ``model`` outside its layer list (its
    weights load with the final norm, and the model's forward runs it after the last block)."""
    hidden_state = type(config).family_spec.hidden_state
    if hidden_state is None or hidden_state.collapse_module is None:
        return
    try:
        model.get_submodule(hidden_state.collapse_module)
    except AttributeError:
        raise type(config).family_source.error(
            ("hidden_state", "collapse_module"),
            f"{type(model).__name__} has no module {hidden_state.collapse_module!r}") from None
