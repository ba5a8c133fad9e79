"""``kv_groups`` and ``kv_cache`` of a draft, from the config's KV-heads field and what tiny models cache.

The KV-heads field is the one transformers reads as ``num_key_value_heads`` (through
``attribute_map``), else a field whose name speaks of KV heads. What the tiny model
really caches decides the rest: the default layout (one entry per KV head, head_dim
wide), KV heads written once per query head (``layer_writes: repeat_interleave``),
another number of KV heads than the field says (``kv_groups`` from the cache), or
another geometry (a ``kv_cache`` section whose formulas are found among the config
fields and confirmed on a second, differently shaped tiny model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distconf.loader.formula import Formula, FormulaError, evaluate_on
from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.fields import SIZE_WORDS, FieldNames, role_of
from distconf.tools.drafting.indexer import indexer_kinds
from distconf.tools.drafting.probe_runs import TinyRun

__all__ = ["kv_groups_formula", "KVLayout", "kv_layout", "formula_value"]

_NATURAL_HEAD_DIM = "hidden_size // num_attention_heads"


def kv_groups_formula(config: Any, raw: Mapping[str, Any], names: FieldNames) -> int | str:
    """``num_attention_heads // <KV-heads field>``, or 1 when the config has no KV-heads field.

    The field is the one transformers reads as ``num_key_value_heads``, else a field of
    the config.json, then of the config class, whose name speaks of KV heads.
    """
    value = field_value(config, "num_key_value_heads")
    if is_int(value) and value > 0:
        return "num_attention_heads // num_key_value_heads"
    keys = [*raw, *(k for k in vars(config) if k not in raw and not k.startswith("_"))]
    for key in keys:
        value = field_value(config, key)
        if role_of(key, value, names) == "kv_heads" and is_int(value) and value > 0:
            return f"num_attention_heads // {key}"
    return 1


@dataclass
class KVLayout:
    """The draft's kv_groups and kv_cache, with what was found and what to review."""

    kv_groups: int | str
    kv_cache: dict[str, Any] = field(default_factory=dict)
    facts: list[str] = field(default_factory=list)
    review: list[str] = field(default_factory=list)
    from_cache: str | None = None  # why kv_groups follows the cache rather than the KV-heads field


def formula_value(formula: int | str, config: Any) -> Any:
    """``formula`` (an int or formula text) evaluated on ``config``; None when it cannot be."""
    try:
        return evaluate_on(Formula(formula) if isinstance(formula, str) else formula, config)
    except (FormulaError, ZeroDivisionError):
        return None


def _head_dim(config: Any) -> int | None:
    head_dim = field_value(config, "head_dim")
    return head_dim if is_int(head_dim) else formula_value(_NATURAL_HEAD_DIM, config)


def _repeated(key: Any, kv_heads: int) -> bool:
    """The cached key heads are each KV head repeated once per query head of its group, consecutively."""
    import torch

    batch, heads, tokens, dim = key.shape
    if kv_heads < 1 or heads % kv_heads:
        return False
    grouped = key.reshape(batch, kv_heads, heads // kv_heads, tokens, dim)
    return bool(torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)))


def kv_layout(groups: int | str, tiny: TinyRun, raw: Mapping[str, Any],
              probe: Callable[[], TinyRun | None]) -> KVLayout:
    """Decide kv_groups and kv_cache from ``tiny``'s cache; ``probe`` runs the second tiny model if needed."""
    layout = _kv_layout(groups, tiny, raw, probe)
    if tiny.indexer is not None:  # a sparse-attention indexer's keys cached next to K/V
        dim = int(tiny.indexer.shape[-1])
        found = _formula_for(dim, tiny, raw, probe,
                             lambda run: int(run.indexer.shape[-1]) if run.indexer is not None else None)
        layout.kv_cache = {**(layout.kv_cache or {}), "indexer_head_dim": found}
        layout.facts.append(f"an indexer caches [*, tokens, {dim}] keys next to K/V: kv_cache.indexer_head_dim")
        found_kinds = indexer_kinds(tiny)
        if found_kinds:
            field, kinds = found_kinds
            layout.kv_cache["indexer_layer_kinds"] = kinds
            if field is None:
                layout.facts.append(f"only layers of type {', '.join(kinds)} keep it: kv_cache.indexer_layer_kinds")
            else:
                layout.kv_cache["indexer_types_field"] = field
                layout.facts.append(f"only layers whose {field} is {', '.join(kinds)} keep it: "
                                    "kv_cache.indexer_types_field and indexer_layer_kinds")
        if not isinstance(found, str):
            layout.review.append(f"no config field gives the {dim} of kv_cache.indexer_head_dim on two tiny models; "
                                 "the tiny value is written: replace it with a formula over config fields")
    return layout


def _kv_layout(groups: int | str, tiny: TinyRun, raw: Mapping[str, Any],
               probe: Callable[[], TinyRun | None]) -> KVLayout:
    shape = tiny.shape
    if shape is None:
        return KVLayout(groups, review=["could not read the tiny model's cache; check kv_cache by hand"])
    k_heads, k_dim, v_heads, v_dim = shape
    config = tiny.config
    layout = KVLayout(groups, facts=[f"tiny model caches keys [*, {k_heads}, tokens, {k_dim}] and values "
                                     f"[*, {v_heads}, tokens, {v_dim}] per layer"])
    heads = field_value(config, "num_attention_heads")
    group_count = formula_value(groups, config)
    expected = heads // group_count if is_int(heads) and is_int(group_count) and group_count > 0 else None
    standard = k_dim == v_dim == _head_dim(config) and k_heads == v_heads
    if standard and k_heads == expected:
        return layout
    if standard and k_heads == heads and expected and expected < heads and _repeated(tiny.key, expected):
        layout.facts.append("the attention writes every KV head repeated per query head; the block stores one copy")
        layout.kv_cache = {"layer_writes": "repeat_interleave"}
    elif standard and is_int(heads):
        _groups_from_cache(layout, k_heads, heads, expected, tiny, raw, probe)
    else:
        _explicit_geometry(layout, shape, tiny, raw, probe)
    return layout


def _groups_from_cache(layout: KVLayout, cached: int, heads: int, expected: int | None, tiny: TinyRun,
                       raw: Mapping[str, Any], probe: Callable[[], TinyRun | None]) -> None:
    """Standard head size but another number of KV heads than the field says: kv_groups follows the cache."""
    if cached == 1:
        layout.kv_groups = "num_attention_heads"
    elif cached == heads and _all_heads_on_probe(probe):
        layout.kv_groups = 1
    else:
        found = _formula_for(cached, tiny, raw, probe, lambda run: run.shape[0] if run.shape else None, True)
        layout.kv_groups = f"num_attention_heads // {found}" if isinstance(found, str) else heads // cached
    layout.from_cache = (f"kv_groups {layout.kv_groups!s} follows the {cached} KV head(s) the tiny model caches"
                         + (f" (the config's KV-heads field gives {expected})" if expected else ""))


def _all_heads_on_probe(probe: Callable[[], TinyRun | None]) -> bool:
    """The probe model caches as many KV heads as query heads too (or does not run): the tiny model's full count
    is multi-head attention, not a KV-heads field that the tiny sizes make equal to the heads."""
    second = probe()
    if second is None or second.shape is None:
        return True
    return second.shape[0] == field_value(second.config, "num_attention_heads")


def _explicit_geometry(layout: KVLayout, shape: tuple[int, int, int, int], tiny: TinyRun, raw: Mapping[str, Any],
                       probe: Callable[[], TinyRun | None]) -> None:
    """A kv_cache section naming the config fields that give the cached heads and head sizes."""
    k_heads, k_dim, v_heads, v_dim = shape
    if k_heads != v_heads:
        layout.review.append(f"keys and values are cached with different head counts ({k_heads}, {v_heads}); "
                             "declare kv_cache.values_per_token")
    section: dict[str, Any] = {}
    for key, value, index in (("num_kv_heads", k_heads, 0), ("key_head_dim", k_dim, 1), ("value_head_dim", v_dim, 3)):
        found = 1 if value == 1 and index == 0 else _formula_for(
            value, tiny, raw, probe, lambda run, i=index: run.shape[i] if run.shape else None, index == 0)
        section[key] = found
        if not isinstance(found, str) and not (value == 1 and index == 0):
            layout.review.append(f"no config field gives the {value} of kv_cache.{key} on two tiny models; the "
                                 "tiny value is written: replace it with a formula over config fields")
    layout.kv_cache = section
    layout.facts.append("the cache is not num_kv_heads x (head_dim + head_dim): kv_cache names the config "
                        "fields that give the cached sizes on two differently shaped tiny models")


_HEAD_COUNT_ROLES = frozenset({"num_key_value_heads", "kv_heads", "head_count", "num_attention_heads"})
_WIDTH_ROLES = frozenset({"head_dim", "size", "hidden_size"})


def _means(key: str, value: Any, names: FieldNames, counts_heads: bool) -> bool:
    """``key`` is a field that can mean a number of heads (``counts_heads``) or a head width, by its names.

    A field equal to the measured value by coincidence (``num_experts_per_tok``, ``n_positions``)
    is not a guess.
    """
    role = role_of(key, value, names)
    if counts_heads:
        return role in _HEAD_COUNT_ROLES
    return role in _WIDTH_ROLES and bool(names.words(key) & (SIZE_WORDS | {"head"}))


def _candidates(config: Any, value: int, raw: Mapping[str, Any], counts_heads: bool = False) -> list[str]:
    """Fields (then simple formulas) equal to ``value`` on ``config`` whose names mean such a size.

    The config.json's own fields first.
    """
    names = FieldNames.of(type(config))
    found = [key for key in raw if not key.startswith("_") and is_int(field_value(config, key))
             and field_value(config, key) == value]
    if not counts_heads:
        if is_int(field_value(config, "head_dim")) and field_value(config, "head_dim") == value:
            found.append("head_dim")
        if formula_value(_NATURAL_HEAD_DIM, config) == value:
            found.append(_NATURAL_HEAD_DIM)
    found += [name for name, v in sorted(config.to_dict().items())
              if is_int(v) and v == value and not name.startswith("_") and "token" not in name]
    return [key for key in dict.fromkeys(found)
            if key == _NATURAL_HEAD_DIM or _means(key, field_value(config, key), names, counts_heads)]


def _formula_for(value: int, tiny: TinyRun, raw: Mapping[str, Any], probe: Callable[[], TinyRun | None],
                 measure: Callable[[TinyRun], int | None], counts_heads: bool = False) -> str | int:
    """The first candidate giving ``value`` on the tiny model and the probe's measure on the probe model."""
    candidates = _candidates(tiny.config, value, raw, counts_heads)
    second = probe() if candidates else None
    if second is not None and (target := measure(second)) is not None:
        candidates = [c for c in candidates if formula_value(c, second.config) == target]
    elif len(candidates) > 1:
        candidates = []  # ambiguous and not verifiable
    return candidates[0] if candidates else value
