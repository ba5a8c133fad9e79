"""States a model's modules keep in attributes of their own (``state.module_attributes`` of a draft).

Some models keep no per-sequence state in a transformers ``Cache``: their recurrent modules store it
as attributes (``self.conv1d_state``, ``self.rg_lru.recurrent_states``) and reuse it at the next call,
while their attention layers write K/V into a cache the model builds and never returns.
`handed_cache` finds the cache a tiny run handed its layers; `module_states` reads,
per layer, the attributes named like a state (``state``, ``states``, ``cache``) that hold a
``[batch, ...]`` tensor after the run: their paths below the layer module (conv states when named
``conv*``, recurrent ones otherwise) and their shapes, so the state section is drafted as for any
state. `apply_module_states` writes the rest: the paths, ``counts_positions`` when a module keeping
them reads positions, and ``use_cache: true`` for a layer that keeps them only when told to cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.layer_state import LayerState

__all__ = ["ModuleStatesFound", "handed_cache", "module_states", "apply_module_states"]

_STATE_WORDS = frozenset({"state", "states", "cache"})
_POSITION_PARAMETERS = ("position_ids", "cache_position", "positions", "position")


@dataclass(frozen=True)
class ModuleStatesFound:
    """The attribute paths (below the layer module) of the conv and recurrent states, in order, and whether a
    module keeping them takes positions, and whether the layer's forward takes ``use_cache``."""

    conv: tuple[str, ...]
    recurrent: tuple[str, ...]
    reads_positions: bool
    takes_use_cache: bool


def handed_cache(calls: list[Any]) -> Any:
    """The transformers Cache a model handed its layers, from their calls (`probe.LayerCall`; None: none)."""
    from transformers.cache_utils import Cache

    return next((v for call in calls for v in (*call.args, *call.kwargs.values()) if isinstance(v, Cache)), None)


def _held(layer: Any, batch: int) -> list[tuple[str, Any, Any]]:
    """(path below ``layer``, tensor, owning module) of each attribute named like a state holding a ``[batch, ...]``
    tensor, in module order."""
    import torch

    found = []
    for name, module in layer.named_modules():
        for attribute, value in vars(module).items():
            words = set(attribute.lower().split("_"))
            if attribute.startswith("_") or not _STATE_WORDS & words:
                continue
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch:
                found.append((f"{name}.{attribute}" if name else attribute, value, module))
    return found


def _is_conv(path: str) -> bool:
    return any(word.startswith("conv") for word in path.rpartition(".")[2].lower().split("_"))


def _takes(module: Any, names: tuple[str, ...]) -> bool:
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in names)


def module_states(layers: Any, batch: int, cache_states: list[LayerState]) -> tuple[ModuleStatesFound | None,
                                                                                   list[LayerState]]:
    """(the attributes every state-keeping layer keeps, one `LayerState` per layer with the K/V ``cache_states``
    says it keeps); (None, []) when no layer keeps such attributes or two layers keep different ones."""
    per_layer, found = [], set()
    owners: list[Any] = []
    for i, layer in enumerate(layers):
        held = _held(layer, batch)
        convs = [(path, t) for path, t, _ in held if _is_conv(path)]
        recurrents = [(path, t) for path, t, _ in held if not _is_conv(path)]
        owners += [module for _, _, module in held]
        kv = i < len(cache_states) and cache_states[i].kv
        if held:
            found.add((tuple(p for p, _ in convs), tuple(p for p, _ in recurrents)))

        def shape(t: Any) -> tuple[int, ...]:
            return tuple(int(d) for d in t.shape[1:])

        per_layer.append(LayerState(
            conv=shape(convs[0][1]) if convs else None, recurrent=shape(recurrents[0][1]) if recurrents else None,
            conv_dtype=str(convs[0][1].dtype).removeprefix("torch.") if convs else None,
            recurrent_dtype=str(recurrents[0][1].dtype).removeprefix("torch.") if recurrents else None,
            kv=kv, extra_convs=tuple(shape(t) for _, t in convs[1:]),
            extra_recurrents=tuple(shape(t) for _, t in recurrents[1:])))
    if len(found) != 1:
        return None, []
    conv, recurrent = found.pop()
    return ModuleStatesFound(conv, recurrent, any(_takes(m, _POSITION_PARAMETERS) for m in owners),
                             _takes(layers[0], ("use_cache",))), per_layer


def apply_module_states(draft: Any, layout: Any, found: ModuleStatesFound) -> None:
    """Write ``state.module_attributes`` (and ``counts_positions``, ``use_cache: true``) into ``draft``."""
    attributes = {kind: list(paths) for kind, paths in (("conv", found.conv), ("recurrent", found.recurrent))
                  if paths}
    layout.state["module_attributes"] = attributes
    shown = ", ".join(path for paths in attributes.values() for path in paths)
    draft.facts.append(f"the layers' modules keep their states in attributes of their own ({shown}); blocks set "
                       "them to each session's rows before a call and take them back after")
    if found.reads_positions:
        layout.state["counts_positions"] = True
        draft.facts.append("a module keeping them reads positions: blocks count each sequence's tokens next to "
                           "its state (counts_positions)")
    if found.takes_use_cache:
        draft.call.setdefault("extra", {})["use_cache"] = True
