"""Layer kinds: every kind of layer the real model has must run in the check.

A layer's kind is a set of labels, all found generically (no family knowledge):

- ``mask=<kind>`` and ``position=<rotary|alibi|none>``: what the family file's ``block``
  section resolves for that layer (`distconf.blocks.layer_settings.layer_settings`);
- ``<field>=<value>``: the layer's entry in every config attribute that is a per-layer list
  (one entry per layer) of categories — strings, booleans or 0/1 flags — such as
  ``layer_types``, ``no_rope_layers`` or ``attention_layers``;
- ``<child>:<Class>``: the class of each direct submodule of the block built on the meta
  device, which tells dense from mixture-of-experts layers whatever config fields decide it
  (index lists, ``first_k_dense_replace``-like counts, sparse steps).

The real config is each shipped preset of the family's ``model_type``; for a family
without one, the family's config class built from the tiny config's own values (its
patterns and per-layer settings) at full depth. A layer type the architecture's modeling
code names but no real config has counts too (`named_kinds`): a default config that is
all attention does not hide the convolution layers of its architecture. `check_coverage` fails at ``tiny_config``
naming the kinds no tiny variant runs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from distconf.loader.config_protocol import DistributedConfig
from distconf.tools.checker.failures import located_failure

__all__ = ["LayerKinds", "layer_kinds", "real_configs", "tiny_configs", "coverage", "compare_kinds", "check_coverage",
           "FULL_DEPTH"]

logger = logging.getLogger(__name__)

FULL_DEPTH = 48
"""Layers of the full-depth config built for a family that ships no preset."""
_CATEGORY_INTS = {0, 1}


@dataclass
class LayerKinds:
    """Kinds found in the real configs and those the tiny variants run."""

    real: dict[str, str] = field(default_factory=dict)
    """Label -> the real config that has it."""
    tiny: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    @property
    def missing(self) -> list[str]:
        """Labels of the real model no tiny variant runs, sorted."""
        return sorted(set(self.real) - self.tiny)

    def summary(self) -> str:
        """One line: how many kinds the tiny variants cover, and which real configs were read."""
        sources = sorted(set(self.real.values()))
        covered = len(set(self.real) & self.tiny)
        return f"{covered}/{len(self.real)} layer kinds of {', '.join(sources) or 'no real config'} covered"


def _per_layer_lists(config: DistributedConfig, layers: int) -> dict[str, list[Any]]:
    """Config attributes holding one category per layer."""
    if layers < 2:
        return {}
    found = {}
    for name, value in vars(config).items():
        if name.startswith("_") or not isinstance(value, (list, tuple)) or len(value) != layers:
            continue
        if all(isinstance(v, (str, bool)) for v in value) or (
                all(isinstance(v, int) for v in value) and set(value) <= _CATEGORY_INTS):
            found[name] = list(value)
    return found


def _structure(config: DistributedConfig, layer_idx: int) -> set[str]:
    """``child:Class`` of each direct submodule of block ``layer_idx`` built on the meta device."""
    import torch

    from distconf.blocks.build import block_class_for, constructor_kwargs

    with torch.device("meta"):
        block = block_class_for(config)(**constructor_kwargs(config, layer_idx))
    return {f"{name}:{type(child).__name__}" for name, child in block.named_children()}


def layer_kinds(config: DistributedConfig, first: int | None = None) -> list[frozenset[str]]:
    """The kind (set of labels) of every layer of ``config`` (a distributed config instance), or its first ``first``."""
    from distconf.blocks.build import block_class_for
    from distconf.blocks.layer_settings import layer_settings

    layers = int(config.num_hidden_layers)
    block_cls = block_class_for(config)
    lists = _per_layer_lists(config, layers)
    kinds = []
    for i in range(layers if first is None else min(first, layers)):
        settings = layer_settings(block_cls, config, i)
        position = "rotary" if settings.rotary_class else "alibi" if settings.alibi_function else "none"
        labels = {f"mask={settings.mask_kind}", f"position={position}"}
        labels.update(f"{name}={value[i]}" for name, value in lists.items())
        if settings.sharing.role is not None:  # kv_cache.shared: a storing and a reusing layer are kinds of their own
            labels.add(f"kv_sharing={settings.sharing.role}")
        labels.update(_structure(config, i))
        kinds.append(frozenset(labels))
    return kinds


def _layer_count_keys(cls: type) -> set[str]:
    hf = cls.hf_config_class  # type: ignore[attr-defined]
    mapped = getattr(hf, "attribute_map", {}).get("num_hidden_layers")
    return {"num_hidden_layers", *([mapped] if mapped else [])}


def real_configs(cls: type) -> list[tuple[str, Any]]:
    """``(name, config)`` of the real models of a family: its presets, else the tiny config at full depth."""
    from distconf.loader.presets import list_presets, preset_model_type, preset_path

    spec = cls.family_spec  # type: ignore[attr-defined]
    found = []
    for hub_id in list_presets():
        if preset_model_type(hub_id) != spec.model_type:
            continue
        with preset_path(hub_id).open(encoding="utf-8") as f:
            data = json.load(f)
        found.append((f"preset {hub_id}", cls(**data)))
    if found:
        return found
    tiny = {k: v for k, v in (spec.tiny_config or {}).items() if k != "variants"}
    count_keys = _layer_count_keys(cls)
    tiny_layers = next((int(tiny[k]) for k in count_keys if k in tiny), None)
    per_layer = {k: list(v) for k, v in tiny.items()
                 if isinstance(v, (list, tuple)) and tiny_layers is not None and len(v) == tiny_layers}
    values = {k: v for k, v in tiny.items() if k not in count_keys and k not in per_layer}
    values["num_hidden_layers"] = depth = max(FULL_DEPTH, 4 * (tiny_layers or 1))
    try:
        stretched = cls(**values)
        # a per-layer list the config class does not derive from other fields is stretched by repeating it
        underived = {k: (v * depth)[:depth] for k, v in per_layer.items() if getattr(stretched, k, None) is None}
        if underived:
            stretched = cls(**values, **underived)
        return [(f"the tiny config at {depth} layers", stretched)]
    except Exception as exc:  # a pattern the config class cannot stretch: say so, measure the tiny config itself
        logger.warning("family %r: cannot build its tiny config at full depth (%s: %s); layer kinds are taken "
                       "from the tiny config as written", spec.family, type(exc).__name__, exc)
        return [("the tiny config (it could not be built at full depth; add a preset)", cls(**tiny))]


def tiny_configs(cls: type) -> list[tuple[str, Any]]:
    """``(variant, config)`` of every tiny variant."""
    from distconf.tools.checker.reference import tiny_variants

    return [(name, cls(**values)) for name, values in tiny_variants(cls.family_spec.tiny_config or {})]  # type: ignore[attr-defined]


def coverage(cls: type) -> LayerKinds:
    """The layer kinds of the family's real configs, and those its tiny variants run."""
    try:
        reals = real_configs(cls)
    except Exception as exc:  # a preset the family's class cannot read is a defect of the family file
        raise located_failure(cls, ("config_class",), f"cannot build the real config (a preset of model_type "
                              f"{cls.family_spec.model_type!r}) to list its layer kinds: "  # type: ignore[attr-defined]
                              f"{type(exc).__name__}: {exc}") from None
    result = compare_kinds(reals, tiny_configs(cls))
    _add_named_layer_types(cls, reals, result)
    return result


def _add_named_layer_types(cls: type, reals: list[tuple[str, Any]], result: LayerKinds) -> None:
    """Kinds of the layer types the architecture names that no real config has (`named_kinds`)."""
    from distconf.errors import FamilyValidationError
    from distconf.tools.checker.named_kinds import model_refuses_layer_type, named_layer_type_configs

    for name, config in named_layer_type_configs(cls, reals):
        try:
            kinds = layer_kinds(config, first=1)
        except FamilyValidationError as exc:
            refusal = model_refuses_layer_type(cls, config)
            if refusal is not None:  # the modeling code names it, its layers do not run it
                result.notes.append(f"{name}: the model itself does not run it ({refusal.splitlines()[0]})")
                continue
            problem = exc.problems[0] if exc.problems else None
            raise located_failure(cls, ("block", "mask", "layer_kinds"), f"the architecture has layers of {name}, "
                                  f"which the family cannot build: {problem.message if problem else exc}; map "
                                  "the type, and make a tiny variant run it") from None
        except Exception:  # the layer class itself cannot be built of that type (a type named for another list)
            refusal = model_refuses_layer_type(cls, config)
            if refusal is None:
                raise
            result.notes.append(f"{name}: the model itself does not run it ({refusal.splitlines()[0]})")
            continue
        refusal = model_refuses_layer_type(cls, config) if set(kinds[0]) - result.tiny else None
        if refusal is not None:  # the family maps the type (its mask names it), the model's layers do not run it
            result.notes.append(f"{name}: the model itself does not run it ({refusal.splitlines()[0]})")
            continue
        for label in kinds[0]:
            result.real.setdefault(label, name)


def compare_kinds(reals: list[tuple[str, Any]], tinies: list[tuple[str, Any]]) -> LayerKinds:
    """The layer kinds of ``reals`` and of ``tinies`` (``(name, distributed config)`` pairs), side by side.

    For tools that draft a family from a real config: ``compare_kinds([("config.json", real)],
    tiny_variants).missing`` lists what the drafted tiny config does not run yet.
    """
    result = LayerKinds()
    for name, config in reals:
        for kinds in layer_kinds(config):
            for label in kinds:
                result.real.setdefault(label, name)
    for _name, config in tinies:
        for kinds in layer_kinds(config):
            result.tiny.update(kinds)
    return result


def check_coverage(cls: type) -> LayerKinds:
    """Fail at ``tiny_config`` when no tiny variant runs some layer kind of the real model."""
    result = coverage(cls)
    missing = result.missing
    if missing:
        where = {}
        for label in missing:
            where.setdefault(result.real[label], []).append(label)
        detail = "; ".join(f"{', '.join(labels)} (in {source})" for source, labels in where.items())
        raise located_failure(
            cls, ("tiny_config",),
            f"the tiny variants never run these layer kinds of the real model: {detail}. Add layers, shrink the "
            "per-layer lists or patterns consistently, or add a variant, so that every kind runs")
    return result
