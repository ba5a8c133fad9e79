"""Repairs of transformers' config defaults that do not build, for benchmarks/sweep_architectures.py.

Some config classes' defaults do not build their own model (a ``head_dim`` of None that the attention reads as a
number, a ``layer_types`` of None that the layers index). A published checkpoint's config.json sets those fields,
so the architecture is still servable; the sweep measures that too. ``sweep_architectures.yaml`` lists, per
model type, the fields to set and why (data, not code): the sweep counts a type as passing as drafted only from
the untouched defaults, and reports separately the types that pass once their defaults are repaired.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

__all__ = ["Repair", "read_repairs", "write_repaired"]


class Repair:
    """The fields one model type's defaults need set, and why."""

    def __init__(self, model_type: str, spec: dict[str, Any]) -> None:
        why, values = spec.get("why"), spec.get("set")
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"repairs.{model_type}.why: say why the defaults do not build (a sentence)")
        if not isinstance(values, dict) or not values:
            raise ValueError(f"repairs.{model_type}.set: a mapping of config fields to the values that repair them")
        self.model_type, self.why, self.values = model_type, why.strip(), values

    def apply(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with this repair's values set; a nested mapping (a sub-config) is merged key by key."""
        out = copy.deepcopy(config)
        _merge(out, self.values)
        return out


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def read_repairs(data: dict[str, Any]) -> dict[str, Repair]:
    """The ``repairs`` table of the sweep's data, checked."""
    return {model_type: Repair(model_type, spec) for model_type, spec in (data.get("repairs") or {}).items()}


def write_repaired(defaults: Path, repair: Repair, folder: Path) -> Path:
    """Write ``defaults`` (a config.json) with ``repair`` applied to ``folder/config.json``; return that path."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(defaults.read_text(encoding="utf-8"))
    target = folder / "config.json"
    target.write_text(json.dumps(repair.apply(config), indent=2) + "\n", encoding="utf-8")
    return target
