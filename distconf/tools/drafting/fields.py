"""How drafting reads a ``config.json``: by the names transformers reads it by.

A config class's ``attribute_map`` maps transformers' standard names
(``num_attention_heads``, ``num_hidden_layers``, ``num_experts`` ...) to the name the
class stores (``n_head``, ``n_layers``, ``n_routed_experts`` ...). `FieldNames` inverts
it, so every field of a ``config.json`` is known by its standard name, and `role_of`
says what a field measures from the words of its names (``heads``, ``layers``,
``window``, ``experts``, ``size`` ...) and its value: which other sizes it must shrink
with. Nothing here knows a model family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distconf.tools.drafting.common import is_int

__all__ = ["ANCHOR_NAMES", "FieldNames", "Anchors", "config_class_for", "role_of", "has_experts"]

# transformers' standard names of the sizes every other size is relative to
ANCHOR_NAMES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings", "sliding_window",
                "moe_intermediate_size")
# words naming a width (a tensor dimension) in a field name
SIZE_WORDS = frozenset({"size", "dim", "dims", "rank", "inner", "intermediate", "hidden", "width", "channels",
                        "embd", "embed", "ffn", "ssm", "headdim", "state", "channel"})


def config_class_for(config: Mapping[str, Any]) -> type | None:
    """The transformers config class of ``config['model_type']``, or None when unknown."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def _derived_layer_count(config_class: type | None) -> str | None:
    """The one field a config class derives ``num_hidden_layers`` from (a property reading it, e.g. twice the
    layer modules, each holding two sublayers), or None."""
    import inspect
    import re

    prop = inspect.getattr_static(config_class, "num_hidden_layers", None) if config_class is not None else None
    if not isinstance(prop, property) or prop.fget is None:
        return None
    try:
        read = set(re.findall(r"self\.([A-Za-z_]\w*)", inspect.getsource(prop.fget)))
    except (OSError, TypeError):
        return None
    return read.pop() if len(read) == 1 else None


def _layer_count_twins(config_class: type | None) -> list[str]:
    """Fields the config class fills from ``num_hidden_layers`` when unset (``self.x = self.x if self.x is not
    None else self.num_hidden_layers``): other names of the layer count, which the model may build by."""
    import inspect
    import re

    hook = getattr(config_class, "__post_init__", None) if config_class is not None else None
    try:
        source = inspect.getsource(hook) if hook is not None else ""
    except (OSError, TypeError):
        return []
    return re.findall(r"self\.(\w+)\s*=\s*self\.\1\s+if\s+self\.\1\s+is\s+not\s+None\s+else\s+"
                      r"self\.num_hidden_layers\b", source)


@dataclass(frozen=True)
class FieldNames:
    """Standard names of stored fields, from a config class's ``attribute_map`` (identity without one)."""

    aliases: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, config_class: type | None) -> FieldNames:
        """The names of ``config_class`` (None: every name is its own standard name)."""
        attribute_map = getattr(config_class, "attribute_map", None) or {}
        aliases = {stored: standard for standard, stored in attribute_map.items()}
        counted_by = _derived_layer_count(config_class)
        if counted_by is not None:
            aliases.setdefault(counted_by, "num_hidden_layers")
        for twin in _layer_count_twins(config_class):
            aliases.setdefault(twin, "num_hidden_layers")
        return cls(aliases)

    def standard(self, key: str) -> str:
        """The standard name transformers reads ``key`` by (an anchor's own name stays itself)."""
        return key if key in ANCHOR_NAMES else self.aliases.get(key, key)

    def words(self, key: str) -> frozenset[str]:
        """The words of ``key`` and of its standard name."""
        return frozenset(key.lower().split("_")) | frozenset(self.standard(key).lower().split("_"))


@dataclass(frozen=True)
class Anchors:
    """The real model's sizes every other field is compared with (None when the config has none)."""

    hidden: int | None = None
    heads: int | None = None
    layers: int | None = None
    head_dim: int | None = None  # an explicit head_dim field
    keys: Mapping[str, str] = field(default_factory=dict)  # standard name -> key in the config.json

    @classmethod
    def read(cls, config: Mapping[str, Any], names: FieldNames) -> Anchors:
        """Anchors of ``config``, each found by its standard name."""
        keys = {}
        for key, value in config.items():
            standard = names.standard(key)
            if standard in ANCHOR_NAMES and standard not in keys and is_int(value):
                keys[standard] = key
        value = {name: config[key] for name, key in keys.items()}
        return cls(hidden=value.get("hidden_size"), heads=value.get("num_attention_heads"),
                   layers=value.get("num_hidden_layers"), head_dim=value.get("head_dim"), keys=keys)

    @property
    def natural_head_dim(self) -> int | None:
        """hidden_size / num_attention_heads, when both are known and divide."""
        if self.hidden and self.heads and self.hidden % self.heads == 0:
            return self.hidden // self.heads
        return None

    @property
    def head_size(self) -> int | None:
        """The size of one attention head: the explicit head_dim, else hidden / heads."""
        return self.head_dim or self.natural_head_dim


def has_experts(config: Mapping[str, Any], names: FieldNames) -> bool:
    """True when the config routes tokens to more than one expert."""
    return any(role_of(key, value, names) == "experts" and is_int(value) and value > 1
               for key, value in config.items())


def role_of(key: str, value: Any, names: FieldNames, *, moe: bool = False) -> str:
    """What field ``key`` measures, hence how it shrinks.

    An anchor's standard name (``hidden_size`` ...), or one of: ``kv_heads``,
    ``token_id``, ``experts``, ``experts_per_token``, ``shared_experts``,
    ``expert_groups``, ``head_count``, ``window``, ``positions``, ``vocab_size``,
    ``layer_pattern`` (a period or an offset of a pattern of layers: kept as is, the tiny
    layers being the first of the pattern), ``layer_count``, ``rope`` (a
    rotary-parameters mapping), ``size`` (decided by its words and value).
    """
    standard = names.standard(key)
    if standard in ANCHOR_NAMES:
        return standard
    words = names.words(key)
    if isinstance(value, Mapping):
        return "rope" if "rope" in words else "size"
    if ("kv" in words or {"key", "value"} <= words) and words & {"head", "heads"}:
        return "kv_heads"
    if "token" in words and words & {"id", "ids", "index"}:
        return "token_id"
    if words & _PATTERN_WORDS and not words & SIZE_WORDS:
        return "layer_pattern"  # before experts: "expert_layer_period" is a period, not a number of experts
    if words & {"experts", "expert"} and not words & SIZE_WORDS:
        if words & {"group", "groups"}:
            return "expert_groups"  # "num_expert_group" counts groups of experts, not experts
        if words & {"tok", "token", "tokens", "topk", "k"}:
            return "experts_per_token"
        return "shared_experts" if "shared" in words else "experts"
    if key.lower().split("_")[-1] in ("layer", "layers") and not words & SIZE_WORDS and "heads" not in words:
        return "layer_count"  # "max_window_layers" counts layers, whatever else its name says
    for role, role_words in _WORD_ROLES:
        if words & role_words and (role != "expert_groups" or moe):
            return role
    return "size"


_PATTERN_WORDS = frozenset({"period", "offset", "step", "interval", "freq", "frequency", "every"})
# first match wins: a field "hidden_size_per_layer" is a size, "sliding_window_size" a window
_WORD_ROLES = (
    ("expert_groups", frozenset({"group", "groups"})),
    ("head_count", frozenset({"heads"})),
    ("window", frozenset({"window", "chunk"})),
    ("positions", frozenset({"position", "positions", "seq", "sequence", "context"})),
    ("vocab_size", frozenset({"vocab"})),
    ("size", SIZE_WORDS),
    ("layer_count", frozenset({"layer", "layers"})),
)
