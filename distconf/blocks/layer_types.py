"""Which cache each layer of a family keeps: K/V, a per-sequence state, both, or nothing.

A layer's type is its entry in the config field ``block.mask.layer_types_field`` (e.g.
``layer_types``), or the type whose ``block.mask.layer_index_fields`` field lists its index.
The family file says which types keep what (``kv_cache.layer_kinds``,
``state.layer_kinds``), so a hybrid model (attention layers between recurrent ones, layers
that run both side by side, MLP-only layers) needs no code of its own:

- a layer keeps the ``state`` when the family has one and ``state.layer_kinds`` is null
  (every layer) or names the layer's type;
- a layer keeps K/V when ``kv_cache.layer_kinds`` names its type, or, when that is null,
  when it keeps no state;
- a layer of a type in ``block.skipped_layer_kinds`` keeps nothing (the model skips it for
  hidden states alone; its block passes them through).
"""

from __future__ import annotations

from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_kind import layer_type

__all__ = ["layer_type", "skipped_at", "keeps_kv_at", "keeps_state_at", "any_layer_keeps_kv"]


def _spec(config: DistributedConfig | type) -> object:
    cls = config if isinstance(config, type) else type(config)
    return getattr(cls, "family_spec", None)


def skipped_at(config: DistributedConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is of a type the model skips for hidden states alone
    (``block.skipped_layer_kinds``)."""
    spec = _spec(config)
    kinds = spec.block.skipped_layer_kinds if spec is not None else None
    return bool(kinds) and layer_type(config, layer_idx) in kinds


def keeps_state_at(config: DistributedConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` keeps the family's per-sequence ``state``."""
    spec = _spec(config)
    state = spec.state if spec is not None else None
    if state is None or skipped_at(config, layer_idx):
        return False
    if state.layer_kinds is None:
        return True
    return layer_type(config, layer_idx) in state.layer_kinds


def keeps_kv_at(config: DistributedConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` keeps a K/V cache."""
    spec = _spec(config)
    if spec is None:
        return True
    if skipped_at(config, layer_idx):
        return False
    kinds = spec.kv_cache.layer_kinds
    if kinds is not None:
        return layer_type(config, layer_idx) in kinds
    return not keeps_state_at(config, layer_idx)


def any_layer_keeps_kv(config: DistributedConfig | type) -> bool:
    """Whether some layer of the family can keep K/V (False only for a family whose every layer keeps a state)."""
    spec = _spec(config)
    if spec is None:
        return True
    state = spec.state
    return spec.kv_cache.layer_kinds is not None or state is None or state.layer_kinds is not None
