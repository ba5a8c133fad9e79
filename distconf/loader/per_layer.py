"""The config a layer is built and sized by: a heterogeneous config's own copy for that layer.

transformers lets a config hold some attributes per layer (``config.per_layer_config = {idx: {attr:
value}}``): such a config is ``is_heterogeneous``, names the attributes in ``per_layer_attributes``, and
refuses to read one of them globally (``AmbiguousGlobalPerLayerAttributeError``); each layer reads its
own copy, ``config.per_layer_config[idx]``, whose values are that layer's. This module is the one home of
the rule: whatever a family file's formulas say of one layer (KV geometry, state shapes, mask window,
constructor arguments) is read on `layer_config`, so ``head_dim`` there means the layer's head_dim;
a formula read once for the whole model that names a per-layer attribute fails in one line
(`global_read_problem`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_heterogeneous", "per_layer_attributes", "layer_config", "global_read_problem"]


def is_heterogeneous(config: object) -> bool:
    """Whether ``config`` holds some attributes per layer (a transformers heterogeneous config)."""
    try:
        return bool(getattr(config, "is_heterogeneous", False))
    except Exception:  # an object whose attribute access fails is no heterogeneous config
        return False


def per_layer_attributes(config: object) -> frozenset[str]:
    """The attributes ``config`` holds per layer (empty for a homogeneous config)."""
    if not is_heterogeneous(config):
        return frozenset()
    return frozenset(getattr(config, "per_layer_attributes", None) or ())


def layer_config(config: Any, layer_idx: int | None) -> Any:
    """The config layer ``layer_idx`` reads: ``config.per_layer_config[layer_idx]`` for a heterogeneous config
    (its own values of the per-layer attributes), else ``config`` itself (also for ``layer_idx`` None)."""
    if layer_idx is None or not is_heterogeneous(config):
        return config
    return config.per_layer_config[layer_idx]


def global_read_problem(config: object, name: str, what: str) -> str | None:
    """The one-line reason ``what`` (e.g. "formula 'head_dim'") cannot read ``name`` on ``config`` once for the
    whole model: ``name`` is one of its per-layer attributes; None when it is not."""
    if name not in per_layer_attributes(config):
        return None
    return (f"{what} reads {name!r} once for the whole model, but {type(config).__name__} holds {name} per layer "
            f"(per_layer_config: a heterogeneous config), with values that differ across layers")
