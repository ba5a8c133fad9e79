"""State shapes per layer type: ``state.layer_overrides``, when the state-keeping layers of different types keep
states of different shapes (conv windows sized by KV heads that differ per type).

Each layer type's shapes are drafted the way the section's are, on runs (tiny, probe, perturbed) whose layers
of the other types are masked out, so every formula is confirmed on that type's own layers; the first type's
shapes become the section, another type's (where they differ) its override. `differing_run` tells when the
tiny config hides such a difference (two fields sizing different layer types have one value there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from distconf.tools.drafting.common import field_value

__all__ = ["per_type_shapes", "differing_run", "listed_shapes"]

Run = Callable[[], "tuple[Any, list[Any]] | None"]
Perturb = Callable[[str, int], "tuple[Any, list[Any]] | None"]
Draft = Callable[[list[Any], Run, Perturb], "tuple[dict[str, Any] | None, str | None]"]
"""Drafts the shapes of the state-keeping layers of runs: (section, None) or (None, why not)."""

_TYPES_FIELD = "layer_types"


def _masked(states: list[Any], types: Any, kind: str) -> list[Any] | None:
    """``states`` with the layers of types other than ``kind`` keeping nothing (None: no type per layer)."""
    if not isinstance(types, (list, tuple)) or len(types) != len(states):
        return None
    return [s if str(t) == kind else dataclasses.replace(s, conv=None, recurrent=None, extra_convs=(),
                                                          extra_recurrents=(), kv=False)
            for t, s in zip(types, states, strict=True)]


def _masked_run(run: tuple[Any, list[Any]] | None, kind: str) -> tuple[Any, list[Any]] | None:
    if run is None:
        return None
    states = _masked(run[1], field_value(run[0], _TYPES_FIELD), kind)
    return None if states is None else (run[0], states)


def per_type_shapes(config: Any, states: list[Any], probe: Run, perturb: Perturb,
                    draft: Draft) -> tuple[dict[str, Any] | None, str | None] | None:
    """The state section with ``layer_overrides`` for the layer types whose shapes differ from the first type's:
    (section, None), (None, why not), or None when the layers have no types (or only one keeps a state)."""
    types = field_value(config, _TYPES_FIELD)
    if not isinstance(types, (list, tuple)) or len(types) != len(states):
        return None
    kinds = list(dict.fromkeys(str(t) for t, s in zip(types, states, strict=True) if s.keeps_state))
    if len(kinds) < 2:
        return None
    sections: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        section, problem = draft(_masked(states, types, kind) or [],
                                 lambda kind=kind: _masked_run(probe(), kind),  # type: ignore[misc]
                                 lambda name, value, kind=kind: _masked_run(perturb(name, value), kind))
        if section is None:
            return None, f"layers of type {kind}: {problem}"
        sections[kind] = section
    base = sections[kinds[0]]
    overrides = {kind: {key: value for key, value in section.items() if value != base.get(key)}
                 for kind, section in sections.items() if kind != kinds[0]}
    overrides = {kind: changed for kind, changed in overrides.items() if changed}
    if any(set(section) != set(base) for section in sections.values()):
        return None, ("the layer types keep different kinds of state (" + ", ".join(
            f"{kind}: {' and '.join(section)}" for kind, section in sections.items()) + ")")
    return ({**base, "layer_overrides": overrides} if overrides else base), None


def differing_run(perturbed: list[tuple[str, int, tuple[Any, list[Any]] | None]]) -> str | None:
    """In words, a perturbed run whose state-keeping layers keep states of different shapes (None: none does):
    the tiny model gives two fields the same value that size different layers (per layer type)."""
    for name, value, run in perturbed:
        if run is None:
            continue
        shapes = [(s.shapes("conv"), s.shapes("recurrent")) for s in run[1] if s.keeps_state]
        if len(set(shapes)) > 1:
            per_layer = ", ".join(f"{listed_shapes(c)} / {listed_shapes(r)}" for c, r in dict.fromkeys(shapes))
            return (f"the state-keeping layers keep states of different shapes once {name} is {value} ({per_layer}): "
                    "the state's size differs per layer type, which the tiny config, giving the fields the same "
                    "value, hides")
    return None


def listed_shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    """``shapes`` in words: one shape as it is, several as a list (None: none)."""
    if not shapes:
        return "None"
    return str(shapes[0]) if len(shapes) == 1 else str(list(shapes))
