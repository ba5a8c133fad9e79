"""The ``state`` section of a draft: what recurrent / state-space / convolution layers keep per sequence.

The tiny model's transformers cache says it: each layer of a ``DynamicCache`` that holds
``conv_states`` / ``recurrent_states`` keeps a state, one holding 4-D keys keeps K/V. Each
dimension of the first state-keeping layer becomes a formula over config fields (a field,
a product or a sum of two products) that gives it on the tiny model and, when the second
differently shaped tiny model runs, on that one too. Layer types (``layer_types``) that keep
no K/V get mask kind ``none``; in a hybrid, ``state.layer_kinds`` and ``kv_cache.layer_kinds``
name the types keeping each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import field_value
from distconf.tools.drafting.layer_state import LayerState
from distconf.tools.drafting.state_formula import Perturb, Run, dimension_formula
from distconf.tools.drafting.state_layer_overrides import differing_run, listed_shapes, per_type_shapes

__all__ = ["foreign_cache_class", "foreign_state", "StateLayout", "state_layout"]

_STATE_ATTRIBUTE_WORDS = frozenset({"state", "states", "cache"})  # a module attribute kept between calls
_CACHE_OUTPUTS = ("cache", "past_key_values", "cache_params", "state")  # where a model output returns its cache


def _holds_tensors(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(_holds_tensors(item) for item in items)


def foreign_state(result: Any, model: Any) -> str | None:
    """Where a tiny model's per-sequence state lives when it is outside transformers' cache layers, in words.

    None when every state is in the layers of a transformers ``Cache`` (``conv_states`` /
    ``recurrent_states`` / keys and values), the only kind a server's block cache holds.
    """
    from transformers.cache_utils import Cache

    get = getattr(result, "get", None)
    cache = next((found for found in (get(name) for name in _CACHE_OUTPUTS) if found is not None), None) \
        if callable(get) else None
    if isinstance(cache, Cache):
        extra = sorted(name for name, value in vars(cache).items() if name != "layers" and _holds_tensors(value))
        if extra:
            return (f"its {type(cache).__name__} keeps it in {', '.join(extra)}, outside the cache's layers "
                    "(transformers' DynamicCache layer API)")
        return None
    if cache is not None:
        return f"the model returns it as a {type(cache).__name__}, not a transformers Cache"
    kept = sorted({f"{type(module).__name__}.{name}" for module in model.modules()
                   for name, value in vars(module).items()
                   if _STATE_ATTRIBUTE_WORDS & set(name.lower().split("_")) and _holds_tensors(value)})
    if kept:
        return f"its modules keep it themselves ({', '.join(kept[:3])}), not in a transformers Cache"
    return None


def foreign_cache_class(model_class: type) -> str | None:
    """In words, the cache class of its own that ``model_class.forward`` takes when it is no transformers Cache.

    Read off the annotation of the cache parameter, so it is known before any tiny model runs.
    """
    import inspect
    import typing

    from transformers.cache_utils import Cache

    try:
        params = inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in _CACHE_OUTPUTS:
        annotation = params[name].annotation if name in params else None
        for option in (typing.get_args(annotation) or (annotation,)):
            if isinstance(option, type) and option.__module__ == model_class.__module__ \
                    and not issubclass(option, Cache):
                return f"the model takes it as a {option.__name__} of its own, not a transformers Cache"
    return None


@dataclass
class StateLayout:
    """The draft's state section, per-type kinds and what was found or is left to a human."""

    state: dict[str, Any]
    state_types: list[str] | None = None  # layer types keeping a state (None: no layer_types)
    kv_types: list[str] | None = None  # layer types keeping K/V
    all_types: list[str] | None = None  # every layer type of the tiny model
    problem: str | None = None  # why the draft cannot declare the state
    beyond_runtime: bool = False  # the problem is a limit of the server's block cache, not of the draft


def state_layout(config: Any, raw: Mapping[str, Any], states: list[LayerState],
                 probe: Run, perturb: Perturb) -> StateLayout | None:
    """The state section for a tiny model whose cache layers are ``states`` (None: no layer keeps a state).

    ``probe`` runs the second tiny model, ``perturb(field, value)`` the tiny model with one field changed:
    a formula must give the measured size on every run that builds.
    """
    keeping = [s for s in states if s.keeps_state]
    if not keeping:
        return None
    if any(s.gap for s in keeping):
        return StateLayout({}, problem="a layer keeps a conv or recurrent state at a cache state_idx above one "
                                       "it leaves empty, and a server's block cache holds states 0, 1, ... in "
                                       "order", beyond_runtime=True)
    section, problem, per_type = _section(config, raw, states, probe, perturb)
    if per_type:  # the shapes differ per layer type: drafted per type (state.layer_overrides), if types tell
        found = per_type_shapes(config, states, probe, perturb, lambda s, p, q: _section(config, raw, s, p, q)[:2])
        section, problem = found if found is not None else (section, problem)
    if section is None:
        return StateLayout({}, problem=problem)
    layout = StateLayout(section)
    layout.state_types, layout.kv_types, layout.all_types = _types(config, states)
    return layout


def _section(config: Any, raw: Mapping[str, Any], states: list[LayerState], probe: Run,
             perturb: Perturb) -> tuple[dict[str, Any] | None, str | None, bool]:
    """(section, None, False) for the state-keeping layers of ``states``, else (None, why not, whether their
    shapes differ from layer to layer)."""
    keeping = [s for s in states if s.keeps_state]
    first = keeping[0]
    perturbed: list[tuple[str, int, tuple[Any, list[LayerState]] | None]] = []

    def tracked(name: str, value: int) -> tuple[Any, list[LayerState]] | None:
        run = perturb(name, value)
        perturbed.append((name, value, run))
        return run

    if len({(s.shapes("conv"), s.shapes("recurrent")) for s in keeping}) > 1:
        return None, ("the state-keeping layers keep states of different shapes (" + ", ".join(
            f"{listed_shapes(s.shapes('conv'))} / {listed_shapes(s.shapes('recurrent'))}" for s in keeping) + ")"), True
    section: dict[str, Any] = {}
    for kind in ("conv", "recurrent"):
        key, shapes = f"{kind}_shape", first.shapes(kind)
        listed = []
        for state_idx, shape in enumerate(shapes):
            formulas = []
            for index, value in enumerate(shape):
                formula = dimension_formula(config, raw, value, (key, state_idx, index, len(shape)), probe, tracked)
                if formula is None:
                    where = f"state.{key}[{index}]" if len(shapes) == 1 else f"state.{key}[{state_idx}][{index}]"
                    return None, f"no formula over config fields gives {where} ({value}) on the tiny models", False
                formulas.append(formula)
            listed.append(formulas)
        if listed:
            section[key] = listed[0] if len(listed) == 1 else listed
    differing = differing_run(perturbed)
    return (None, differing, True) if differing is not None else (section, None, False)


def _types(config: Any, states: list[LayerState]) -> tuple[list[str] | None, list[str] | None, list[str] | None]:
    types = field_value(config, "layer_types")
    if not isinstance(types, (list, tuple)) or len(types) != len(states):
        return None, None, None
    state_types = list(dict.fromkeys(str(t) for t, s in zip(types, states, strict=True) if s.keeps_state))
    kv_types = list(dict.fromkeys(str(t) for t, s in zip(types, states, strict=True) if s.kv))
    return state_types, kv_types, list(dict.fromkeys(str(t) for t in types))
