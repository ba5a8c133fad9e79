"""Layer types the architecture has, though no real config of the family uses them.

A real config (a preset, or transformers' defaults) may build only some of the kinds of
layers its architecture has: a hybrid model's default config can be all attention, so its
convolution or recurrent layers never run in ``distconf check``. transformers names every
layer type it knows (``ALLOWED_ATTN_LAYER_TYPES``: ``full_attention``, ``sliding_attention``,
``conv``, ``linear_attention`` ...); a type written as a string in the modeling code of the
family's layer class or in its config class is a type of that architecture. For each one
no real config has, `named_layer_type_configs` gives a real config whose first layer is of
that type, so its kinds (mask, structure) count as kinds of the real model.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import logging
from typing import Any

__all__ = ["layer_types_named_by", "named_layer_types", "named_layer_type_configs", "model_refuses_layer_type"]

logger = logging.getLogger(__name__)

_LAYER_TYPES_FIELD = "layer_types"  # transformers' standard per-layer list of layer types


@functools.cache
def _module_layer_types(module_name: str) -> frozenset[str]:
    """The layer types transformers knows that ``module_name`` writes as string constants."""
    from transformers import configuration_utils

    known = set(getattr(configuration_utils, "ALLOWED_ATTN_LAYER_TYPES", ()))
    try:
        tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    except (ImportError, OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(node.value for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known)


def layer_types_named_by(*classes: type) -> tuple[str, frozenset[str]]:
    """``(where, types)``: the layer types transformers knows that the modules of ``classes`` name."""
    modules = list(dict.fromkeys(c.__module__ for c in classes))
    types = frozenset().union(*(_module_layer_types(m) for m in modules))
    return " and ".join(m.rpartition(".")[2] for m in modules), types


def named_layer_types(cls: type) -> tuple[str, frozenset[str]]:
    """``(where, types)``: the layer types named by the modules of ``cls``'s layer class and HF config class."""
    from distconf.loader.synthesis import import_object

    spec = cls.family_spec  # type: ignore[attr-defined]
    classes = [cls.hf_config_class]  # type: ignore[attr-defined]
    try:
        layer_class = import_object(spec.block.layer_class)
        if isinstance(layer_class, type):
            classes.insert(0, layer_class)
    except (ImportError, AttributeError):  # the check reports an unresolvable layer class itself
        pass
    return layer_types_named_by(*classes)


def _types_field(cls: type) -> str:
    return cls.family_spec.block.mask.layer_types_field or _LAYER_TYPES_FIELD  # type: ignore[attr-defined]


def _names_of(config_class: type, field: str) -> list[str]:
    """``field`` and the names the config class's ``attribute_map`` gives it (``layer_types`` is ZambaConfig's
    alias of ``layers_block_type``), the field first."""
    aliases = getattr(config_class, "attribute_map", None) or {}
    return [field, *(target for alias, target in aliases.items() if alias == field),
            *(alias for alias, target in aliases.items() if target == field)]


def named_layer_type_configs(cls: type, reals: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(name, config)``: a copy of the first real config per named layer type no real config has.

    Its first layer is of that type (the others as they were). Nothing when the real
    configs have no per-layer ``layer_types`` list.
    """
    field = _types_field(cls)
    lists = [(name, getattr(config, field, None)) for name, config in reals]
    lists = [(name, list(value)) for name, value in lists if isinstance(value, (list, tuple)) and value]
    if not lists:
        return []
    where, named = named_layer_types(cls)
    present = {str(t) for _, value in lists for t in value}
    base_name, base_types = lists[0]
    base = next(config for name, config in reals if name == base_name)
    out = []
    for layer_type in sorted(named - present):
        config = copy.deepcopy(base)
        try:
            setattr(config, field, [layer_type, *base_types[1:]])
        except Exception as exc:  # the config class refuses the type outright: it is not one of its layers
            logger.debug("%s refuses layer type %r: %s", type(config).__name__, layer_type, exc)
            continue
        out.append((f"layer type {layer_type!r} (named by {where}; no real config has it)", config))
    return out


def model_refuses_layer_type(cls: type, config: Any) -> str | None:
    """Why the architecture's own model cannot run a layer of the type of ``config``'s first layer (a config of
    `named_layer_type_configs`; None: it runs one).

    The family's tiny config with its first layer of that type, built as the transformers model and
    run on a few tokens with a cache: a type the modeling code names (in a mask mapping, say) but its
    layers refuse is not one of the architecture's layers.
    """
    import torch

    from distconf.blocks.hf_compat import causal_lm_from_config
    from distconf.tools.checker.reference import tiny_variants

    tiny = cls.family_spec.tiny_config  # type: ignore[attr-defined]
    if not tiny:
        return None
    _, values = tiny_variants(tiny)[0]
    field = _types_field(cls)
    layer_type = getattr(config, field)[0]
    field = next((name for name in _names_of(cls.hf_config_class, field) if name in values), field)  # type: ignore[attr-defined]
    types = values.get(field)
    if not isinstance(types, (list, tuple)) or not types:
        return None
    try:
        config = cls.hf_config_class(**{**values, field: [layer_type, *types[1:]]})  # type: ignore[attr-defined]
        model = causal_lm_from_config(config).float().eval()
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long), use_cache=True)
    except Exception as exc:  # the model's own refusal, reported as the reason
        return f"{type(exc).__name__}: {exc}"
    return None
