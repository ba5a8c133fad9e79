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

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.fields import FieldNames, role_of
from distconf.tools.drafting.state_factors import evaluate_factor, factor_candidates, float_fields
from distconf.tools.drafting.state_types import differing_run, listed_shapes, per_type_shapes

__all__ = ["LayerState", "layer_states", "foreign_cache_class", "foreign_state", "StateLayout", "state_layout"]

_SKIPPED_ROLES = frozenset({"token_id", "vocab_size", "positions", "layer_count", "num_hidden_layers",
                            "max_position_embeddings", "layer_pattern"})
_CONV_LAST_WORDS = frozenset({"conv", "kernel"})
_STATE_WORDS = frozenset({"state", "ssm", "head", "heads", "headdim", "mamba", "linear", "inner"})
_MAX_MONOMIAL_FIELDS = 3
_SPLIT_FIELDS = 3  # fields in a product split into heads (a * b // c)
_MAX_SUMMED = 200  # more single products than this giving the size: sums are not searched
_MAX_PERTURBED = 16  # fields changed one at a time to tell coincident candidates apart
Run = Callable[[], "tuple[Any, list[LayerState]] | None"]
Perturb = Callable[[str, int], "tuple[Any, list[LayerState]] | None"]


@dataclass(frozen=True)
class LayerState:
    """What one layer of a tiny model's cache holds (shapes without the batch dimension)."""

    conv: tuple[int, ...] | None = None
    recurrent: tuple[int, ...] | None = None
    recurrent_dtype: str | None = None  # torch dtype name
    conv_dtype: str | None = None  # torch dtype name of the first conv state
    kv: bool = False
    extra_convs: tuple[tuple[int, ...], ...] = ()  # conv states of cache state_idx 1 and up
    extra_recurrents: tuple[tuple[int, ...], ...] = ()  # recurrent states of state_idx 1 and up
    gap: bool = False  # a state_idx below a kept one keeps nothing

    @property
    def keeps_state(self) -> bool:
        """The layer keeps a conv or a recurrent state."""
        return self.conv is not None or self.recurrent is not None

    def shapes(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The shapes of the layer's ``kind`` (``conv`` / ``recurrent``) states, one per ``state_idx``."""
        first = getattr(self, kind)
        return () if first is None else (first, *getattr(self, f"extra_{kind}s"))


def layer_states(cache: Any) -> list[LayerState]:
    """One `LayerState` per layer of a transformers cache (empty when it has no layers)."""
    found = []
    for layer in getattr(cache, "layers", None) or []:
        convs, conv_gap = _by_index(getattr(layer, "conv_states", None))
        recurrents, recurrent_gap = _by_index(getattr(layer, "recurrent_states", None))
        keys = getattr(layer, "keys", None)
        found.append(LayerState(
            conv=convs[0] if convs else None, recurrent=recurrents[0] if recurrents else None,
            recurrent_dtype=_first_dtype(getattr(layer, "recurrent_states", None)),
            conv_dtype=_first_dtype(getattr(layer, "conv_states", None)),
            kv=getattr(keys, "dim", lambda: 0)() == 4, extra_convs=tuple(convs[1:]),
            extra_recurrents=tuple(recurrents[1:]), gap=conv_gap or recurrent_gap))
    return found


def _by_index(states: Mapping[int, Any] | None) -> tuple[list[tuple[int, ...]], bool]:
    """The shapes (without the batch dimension) of a cache layer's states in ``state_idx`` order, up to the last
    kept one, and whether a lower ``state_idx`` keeps nothing."""
    items = sorted((states or {}).items())
    kept = [i for i, (_, t) in enumerate(items) if t is not None]
    if not kept:
        return [], False
    listed = items[:kept[-1] + 1]
    gap = any(t is None for _, t in listed)
    return [tuple(int(d) for d in t.shape[1:]) for _, t in listed if t is not None], gap


def _first_dtype(states: Mapping[int, Any] | None) -> str | None:
    """The torch dtype name of a cache layer's first kept state (None: none kept)."""
    first = next((t for _, t in sorted((states or {}).items()) if t is not None), None)
    return None if first is None else str(first.dtype).removeprefix("torch.")


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
                formula = _formula(config, raw, value, (key, state_idx, index, len(shape)), probe, tracked)
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


def _fields(config: Any, raw: Mapping[str, Any]) -> dict[str, int]:
    """Positive int fields of ``config`` that can be sizes (config.json's own first)."""
    names = FieldNames.of(type(config))
    keys = [*raw, *sorted(config.to_dict())]
    found: dict[str, int] = {}
    for key in dict.fromkeys(keys):
        value = field_value(config, key)
        if key.startswith("_") or not is_int(value) or isinstance(value, bool) or value <= 0:
            continue
        if role_of(key, value, names) in _SKIPPED_ROLES or "token" in key or "id" in key.split("_"):
            continue
        found[key] = int(value)
    return found


def _monomials(fields: Mapping[str, int]) -> list[tuple[str, tuple[str, ...], int]]:
    """(text, fields, value) of products of up to three fields, with a factor 2 (simplest first)."""
    out = []
    for size in range(1, _MAX_MONOMIAL_FIELDS + 1):
        for combo in itertools.combinations(fields, size):
            if sum(1 for name in combo if fields[name] == 1) > 1:
                continue  # a perturbed run tells one factor 1 apart, not several
            value = 1
            for name in combo:
                value *= fields[name]
            out.append((" * ".join(combo), combo, value))
    out += [(f"2 * {text}", combo, 2 * value) for text, combo, value in list(out) if len(combo) < 3]
    return out


def _candidates(config: Any, raw: Mapping[str, Any], value: int) -> list[tuple[str, tuple[str, ...]]]:
    """Formulas giving ``value`` on ``config``: one product, or a sum of two (fewest fields first), a quotient of two
    fields, or a field minus one (a convolution window of the earlier inputs only)."""
    fields = _fields(config, raw)
    monomials = _monomials(fields)
    found = [(text, combo) for text, combo, v in monomials if v == value]
    if len(found) < _MAX_SUMMED:
        by_value: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
        for text, combo, v in monomials:
            if v < value:
                by_value.setdefault(v, []).append((text, combo))
        for text, combo, v in monomials:
            for other, other_combo in by_value.get(value - v, []):
                if other != text:
                    found.append((f"{text} + {other}", combo + other_combo))
    found += [(f"{a} - 1", (a,)) for a in fields if fields[a] - 1 == value > 1]  # a window but the current input
    found += [(f"{a} // {b}", (a, b)) for a, b in itertools.permutations(fields, 2)  # equal ones give 1 by chance
              if fields[b] and fields[a] > fields[b] and fields[a] % fields[b] == 0 and fields[a] // fields[b] == value]
    return found


def _field_count(formula: str | int) -> int:
    """How many config fields a drafted formula names (0 for an integer)."""
    return 0 if isinstance(formula, int) else len(re.findall(r"\b(?!int\b)[A-Za-z_]\w*", formula))


def _split_candidates(config: Any, raw: Mapping[str, Any], value: int) -> list[tuple[str, tuple[str, ...]]]:
    """Formulas ``a * b // c`` giving ``value`` on ``config`` (a width split into heads): tried only when no simpler
    formula is confirmed, since such a quotient often equals a single field by chance."""
    fields = _fields(config, raw)
    return [(f"{text} // {b}", (*combo, b)) for text, combo, v in _monomials(fields)
            if len(combo) == 2 and not text[0].isdigit() for b in fields
            if b not in combo and 1 < fields[b] < v and v % fields[b] == 0 and v // fields[b] == value]


def _score(text: str, combo: tuple[str, ...], key: str, index: int, length: int,
           order: list[str]) -> tuple[int, int, int, int]:
    """Simplest first (fields and literal factors), then fields named like the dimension."""
    words = [frozenset(name.lower().split("_")) for name in combo]
    if key == "conv_shape" and index == length - 1:
        liked = sum(1 for w in words if w & _CONV_LAST_WORDS)
    else:
        liked = sum(1 for w in words if w & _STATE_WORDS) - sum(1 for w in words if w & _CONV_LAST_WORDS)
    position = sum(order.index(n) if n in order else len(order) for n in combo)
    literals = sum(1 for part in text.split() if part.isdigit())  # a factor 2 that is a field's value by chance
    return (literals + len(combo), -liked, len(combo), position)


def _measure(run: tuple[Any, list[LayerState]] | None, raw: Mapping[str, Any], key: str, state_idx: int,
             length: int) -> tuple[dict[str, int], tuple[int, ...]] | None:
    """The fields of a run's config and the ``key`` shape of ``state_idx`` its first state-keeping layer holds."""
    if run is None:
        return None
    run_config, run_states = run
    shapes = next((s.shapes(key.removesuffix("_shape")) for s in run_states if s.keeps_state), ())
    measured = shapes[state_idx] if state_idx < len(shapes) else None
    if measured is None or len(measured) != length:
        return None
    return {**_fields(run_config, raw), **float_fields(run_config, raw)}, measured


def _formula(config: Any, raw: Mapping[str, Any], value: int, where: tuple[str, int, int, int], probe: Run,
             perturb: Perturb) -> str | int | None:
    """The best formula for entry ``index`` of state ``state_idx`` of ``state.<key>`` (``where`` is ``(key,
    state_idx, index, length)``), confirmed on the probe model and on perturbed ones."""
    candidates = _candidates(config, raw, value)
    if not candidates and value == 1:
        return value
    candidates += factor_candidates(_fields(config, raw), float_fields(config, raw), value, whole=True)
    found = _confirmed(config, raw, where, candidates, probe, perturb)
    if value > 1 and (found is None or _field_count(found) > _SPLIT_FIELDS):
        # a product split into heads, only when nothing as simple holds (a sum of products of more fields can match
        # the tiny models by chance: zamba's head size)
        split = _confirmed(config, raw, where, _split_candidates(config, raw, value), probe, perturb)
        found = split if split is not None else found
    if found is None and value > 1:  # a width times any float factor of the config, as a last resort
        factors = factor_candidates(_fields(config, raw), float_fields(config, raw), value)
        found = _confirmed(config, raw, where, factors, probe, perturb)
    return found


def _confirmed(config: Any, raw: Mapping[str, Any], where: tuple[str, int, int, int],
               candidates: list[tuple[str, tuple[str, ...]]], probe: Run, perturb: Perturb) -> str | int | None:
    """The best of ``candidates`` still right on the probe model and on perturbed ones (None: none is)."""
    key, state_idx, index, length = where

    def keep(run: tuple[Any, list[LayerState]] | None) -> None:
        found = _measure(run, raw, key, state_idx, length)
        if found is not None:
            fields, measured = found
            candidates[:] = [(t, c) for t, c in candidates
                             if all(n in fields for n in c) and _evaluate(t, fields) == measured[index]]

    keep(probe())
    order = list(raw)
    fields = {**_fields(config, raw), **float_fields(config, raw)}
    tried: set[str] = set()
    for _ in range(_MAX_PERTURBED):
        candidates.sort(key=lambda c: _score(c[0], c[1], key, index, length, order))
        name = _splitting_field(candidates, fields, tried)
        if name is None:
            break
        tried.add(name)
        keep(perturb(name, fields[name] * 2))
    if not candidates:
        return None
    text, combo = candidates[0]
    return combo[0] if text == combo[0] else text


def _splitting_field(candidates: list[tuple[str, tuple[str, ...]]], fields: Mapping[str, int],
                     tried: set[str]) -> str | None:
    """A field not tried yet whose doubling makes the best candidate differ from another one."""
    if len(candidates) < 2:
        return None
    best = candidates[0][0]
    for other, other_combo in candidates[1:]:
        for name in dict.fromkeys((*candidates[0][1], *other_combo)):
            if name in tried or name not in fields:
                continue
            changed = {**fields, name: fields[name] * 2}
            if _evaluate(best, changed) != _evaluate(other, changed):
                return name
    return None


def _evaluate(text: str, fields: Mapping[str, int]) -> int | None:
    """A candidate formula (products, sums, a field or product floor-divided by a field, a field minus one) evaluated
    on ``fields``."""
    total = 0
    for term in text.split(" + "):
        if term.startswith("int("):
            total += evaluate_factor(term, fields)
            continue
        if term.endswith(" - 1"):
            total += fields[term[:-4]] - 1
            continue
        if " // " in term:
            a, b = term.split(" // ")
            numerator = 1
            for factor in a.split(" * "):
                numerator *= fields[factor]
            total += numerator // fields[b] if fields[b] else 0
            continue
        product = 1
        for factor in term.split(" * "):
            product *= int(factor) if factor.isdigit() else fields[factor]
        total += product
    return total
