"""One ``kv_groups`` and ``kv_cache`` for a tiny config with variants (real models of one model_type).

Each variant's tiny model gives its own KV layout (`kv_layout`). A formula that gives
every variant its own number of groups is kept; else a conditional formula on a
boolean config field that tells the variants apart (``A if flag else B``). Layers that
write KV heads repeated per query head and layers that write them once share
``layer_writes: repeat_interleave`` (the block stores one copy either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import Any

from distconf.tools.drafting.kv import KVLayout, formula_value

__all__ = ["VariantKV", "merge_kv"]

_REPEAT = {"layer_writes": "repeat_interleave"}


@dataclass
class VariantKV:
    """The KV layout one variant's tiny model showed, with that tiny model's config."""

    name: str
    config: Any
    layout: KVLayout


def _fits(formula: int | str, run: VariantKV) -> bool:
    wanted = formula_value(run.layout.kv_groups, run.config)
    return wanted is not None and formula_value(formula, run.config) == wanted


def _flags(runs: list[VariantKV]) -> list[str]:
    """Boolean config fields whose value differs between the variants."""
    values: dict[str, set[bool]] = {}
    for run in runs:
        for name, value in run.config.to_dict().items():
            if isinstance(value, bool) and not name.startswith("_"):
                values.setdefault(name, set()).add(value)
    return sorted(name for name, seen in values.items() if len(seen) == 2)


def _common_groups(runs: list[VariantKV]) -> int | str | None:
    formulas = list(dict.fromkeys(run.layout.kv_groups for run in runs))
    for formula in formulas:
        if all(_fits(formula, run) for run in runs):
            return formula
    for flag in _flags(runs):
        for when_true, when_false in permutations(formulas, 2):
            formula = f"{when_true} if {flag} else {when_false}"
            if all(_fits(formula, run) for run in runs):
                return formula
    return None


def merge_kv(runs: list[VariantKV]) -> KVLayout:
    """The layout of the first (base) variant, made to hold for all of them; what cannot be is to review."""
    base = runs[0].layout
    merged = KVLayout(base.kv_groups, dict(base.kv_cache), list(base.facts), list(base.review))
    for run in runs[1:]:
        merged.facts.extend(f"variant {run.name}: {fact}" for fact in run.layout.facts)
        merged.review.extend(f"variant {run.name}: {item}" for item in run.layout.review)
    groups = _common_groups(runs)
    if groups is None:
        merged.review.append("the variants need different kv_groups ("
                             + "; ".join(f"{run.name}: {run.layout.kv_groups}" for run in runs)
                             + "): write a conditional formula")
    else:
        merged.kv_groups = groups
    sections = [run.layout.kv_cache for run in runs]
    indexer = _merged_indexer(sections)
    if indexer is not None:  # variants with sparse-attention layers: their indexer holds for the others too
        sections = [{k: v for k, v in section.items() if k not in indexer} for section in sections]
        merged.kv_cache = {**{k: v for k, v in merged.kv_cache.items() if k not in indexer}, **indexer}
    if any(section != sections[0] for section in sections):
        if all(section in ({}, _REPEAT) for section in sections):
            merged.kv_cache = dict(_REPEAT)
        else:
            merged.review.append("the variants cache different geometries ("
                                 + "; ".join(f"{run.name}: {run.layout.kv_cache}" for run in runs)
                                 + "): make kv_cache formulas that hold for all of them")
    reasons = [run.layout.from_cache for run in runs if run.layout.from_cache]
    if reasons and (groups is None or " if " not in str(groups)):
        merged.review.append(reasons[0] + ": if other settings of this architecture change the KV heads, make "
                             "kv_groups a conditional formula")
    return merged


_INDEXER_KEYS = ("indexer_head_dim", "indexer_layer_kinds", "indexer_types_field")


def _merged_indexer(sections: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The indexer fields of variants that differ only in which layer types keep an indexer: one size, and the
    union of their types (None when no variant has one, or they disagree on its size)."""
    with_indexer = [section for section in sections if "indexer_head_dim" in section]
    if not with_indexer or len({str(section["indexer_head_dim"]) for section in with_indexer}) != 1:
        return None
    if len(with_indexer) < len(sections) and not all("indexer_layer_kinds" in s for s in with_indexer):
        return None  # a variant keeping it on every layer, another on none: not a per-type rule
    fields = {section.get("indexer_types_field") for section in with_indexer}
    if len(fields) != 1:
        return None  # kinds told by different per-layer fields
    kinds = sorted({k for section in with_indexer for k in section.get("indexer_layer_kinds") or []})
    found = {"indexer_head_dim": with_indexer[0]["indexer_head_dim"]}
    field = fields.pop()
    return {**found, "indexer_layer_kinds": kinds, **({"indexer_types_field": field} if field else {})} if kinds \
        else found
