"""The formula over config fields that gives one dimension of a layer's state, confirmed on several tiny models.

A candidate is a field, a product of up to three, a sum of two products, a quotient of two fields, a field minus
one, a product split into heads (``a * b // c``) or a width times a float factor; the simplest that still gives
the measured size on the second tiny model and on tiny models with one field doubled wins
(`distconf.tools.drafting.state_layout` measures the shapes).

Float factors: some layers size their heads from a width times a float field of the config, truncated, then
divided by a count (``int(hidden_size * qk_dim_factor) // num_heads``); those forms are tried when no product,
sum or quotient of integer fields gives a state's dimension.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from typing import Any

from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.fields import FieldNames, role_of
from distconf.tools.drafting.layer_state import LayerState

__all__ = ["Run", "Perturb", "dimension_formula", "float_fields", "factor_candidates", "evaluate_factor"]

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


def dimension_formula(config: Any, raw: Mapping[str, Any], value: int, where: tuple[str, int, int, int], probe: Run,
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

_MAX_FACTOR = 64.0


def float_fields(config: Any, raw: Mapping[str, Any]) -> dict[str, float]:
    """Positive float fields of ``config`` that can scale a width (config.json's own first)."""
    found: dict[str, float] = {}
    for key in dict.fromkeys([*raw, *sorted(config.to_dict())]):
        value = field_value(config, key)
        if not key.startswith("_") and isinstance(value, float) and 0 < value <= _MAX_FACTOR:
            found[key] = value
    return found


def factor_candidates(ints: Mapping[str, int], floats: Mapping[str, float], value: int,
                      whole: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """Formulas ``int(a * f)`` and ``int(a * f) // b`` (``a``, ``b`` integer fields, ``f`` a float one) giving
    ``value``; ``whole``: with factors of a whole value only (1.0, which doubling the factor tells apart)."""
    found = []
    for a, width in ints.items():
        for f, factor in floats.items():
            if whole and not factor.is_integer():
                continue
            scaled = int(width * factor)
            if scaled == value:
                found.append((f"int({a} * {f})", (a, f)))
            found += [(f"int({a} * {f}) // {b}", (a, f, b)) for b, count in ints.items()
                      if b != a and 1 < count < scaled and scaled // count == value]
    return found


def evaluate_factor(term: str, fields: Mapping[str, float]) -> int:
    """A term ``int(a * f)`` or ``int(a * f) // b`` of `factor_candidates` evaluated on ``fields``."""
    inner, _, rest = term.removeprefix("int(").partition(")")
    a, f = inner.split(" * ")
    scaled = int(fields[a] * fields[f])
    divisor = rest.removeprefix(" // ").strip()
    return scaled // int(fields[divisor]) if divisor else scaled
