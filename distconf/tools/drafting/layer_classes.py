"""``block.layer_classes``: a decoder-layer class per layer type, for models whose layers are different classes.

The layer list of such a model holds modules of several classes (an attention layer
class and a state-space layer class, say). When the config's per-layer type field
says which is which (every layer of one type is of one class), each type whose class
is not the first layer's gets its own entry. A config that lists the indices of the
layers of a class instead (a list of ints naming exactly those layers, e.g.
``cross_attention_layers``) gives that class a type of its own through
``block.mask.layer_index_fields``. The block's call keywords are those any
of the classes takes: a keyword is left out only when no class takes it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from distconf.tools.drafting.common import field_value, module_path
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.scan import ModelScan, find_attention, forward_parameters

__all__ = ["layer_classes_by_type", "layer_classes_by_index_field", "merge_call_parameters", "draft_layer_classes"]

# block.call keys the drafter sets to null when the layer's forward lacks the argument, and that argument
_OPTIONAL_ARGUMENTS = {"mask_argument": "attention_mask", "position_ids_argument": "position_ids",
                       "position_embeddings_argument": "position_embeddings"}


def _classes(scan: ModelScan) -> list[type]:
    """The distinct classes of the layers, in order of first appearance."""
    return list(dict.fromkeys(type(layer) for layer in scan.layers))


def layer_classes_by_type(scan: ModelScan, layer_types: Any) -> dict[str, type] | str:
    """Layer type -> class of its layers; or why the types do not decide the classes (one line)."""
    classes = _classes(scan)
    names = ", ".join(sorted(cls.__name__ for cls in classes))
    if not isinstance(layer_types, Sequence) or isinstance(layer_types, str) or not layer_types:
        return f"layers have different classes ({names}) and the config lists no layer types to tell them apart"
    found: dict[str, set[type]] = {}
    for i, layer in enumerate(scan.layers):
        found.setdefault(str(layer_types[i % len(layer_types)]), set()).add(type(layer))
    mixed = {t: c for t, c in found.items() if len(c) > 1}
    if mixed:
        layer_type, mixed_classes = next(iter(mixed.items()))
        return (f"layers have different classes ({names}), and layers of type {layer_type!r} are of several "
                f"({', '.join(sorted(c.__name__ for c in mixed_classes))}): the layer types do not decide the class")
    return {t: next(iter(c)) for t, c in found.items()}


def _index_type_name(field: str) -> str:
    """The layer type named after an index field: 'cross_attention_layers' -> 'cross_attention'."""
    for suffix in ("_layer_indices", "_layer_ids", "_layers", "_indices"):
        if field.endswith(suffix) and len(field) > len(suffix):
            return field[: -len(suffix)]
    return field


def layer_classes_by_index_field(scan: ModelScan, config: Any) -> dict[str, tuple[str, type]] | None:
    """Layer type -> (config field listing its layers' indices, their class), one per class other than the first
    layer's; None unless every such class has a config field listing exactly its layers."""
    count = len(scan.layers)
    lists = {name: value for name in sorted(_config_fields(config)) if name != "layer_types"
             and isinstance(value := field_value(config, name), (list, tuple)) and value
             and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in value)}
    found: dict[str, tuple[str, type]] = {}
    for cls in _classes(scan)[1:]:
        indices = {i for i, layer in enumerate(scan.layers) if type(layer) is cls}
        fields = [name for name, value in lists.items() if set(value) == indices]
        if len(fields) != 1:
            return None
        found[_index_type_name(fields[0])] = (fields[0], cls)
    return found


def _config_fields(config: Any) -> list[str]:
    to_dict = getattr(config, "to_dict", None)
    return list(to_dict()) if callable(to_dict) else list(vars(config))


def merge_call_parameters(draft: FamilyDraft, scan: ModelScan,
                          params: dict[str, inspect.Parameter]) -> dict[str, inspect.Parameter]:
    """The forward parameters of every layer class; the call keys dropped for the first class, kept when another
    class takes the argument."""
    merged = dict(params)
    for cls in _classes(scan)[1:]:
        for name, param in forward_parameters(cls).items():
            merged.setdefault(name, param)
    for key, argument in _OPTIONAL_ARGUMENTS.items():
        if key in draft.call and draft.call[key] is None and argument in merged:
            del draft.call[key]
    return merged


def _constructor_mismatch(draft: FamilyDraft, cls: type) -> str | None:
    """Why ``cls`` cannot be built with the family's constructor arguments (None when it can)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    wanted = [draft.constructor.get("config_argument", "config")]
    idx = draft.constructor.get("layer_idx_argument", "layer_idx")
    if idx is not None:
        wanted.append(idx)
    missing = [name for name in wanted[:1] if name not in params]
    required = [p.name for p in params.values() if p.name != "self" and p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in wanted]
    if not missing and not required:
        return None
    taken = ", ".join(name for name in params if name != "self")
    return f"{cls.__name__}({taken})"


def _check_constructors(draft: FamilyDraft, classes: list[type]) -> None:
    """Layers of a class not built from the config are taken from the model (``block.constructor.from_model``)."""
    assembled = [problem for cls in classes if (problem := _constructor_mismatch(draft, cls)) is not None]
    if assembled:
        draft.constructor["from_model"] = True
        draft.facts.append(f"{', '.join(assembled)} not built from the config: the model assembles it from modules "
                           "of its own, so each block's layer is taken from the model built on the meta device "
                           "(block.constructor.from_model; tied tensors from the model's tie map)")


def draft_layer_classes(draft: FamilyDraft, scan: ModelScan, config: Any) -> None:
    """``block.layer_classes`` when the layers are of several classes and the layer types tell them apart.

    Otherwise (no layer-type field, types of mixed classes) one review note says why.
    A layer class not built from the config (the model assembles it from modules of its own) makes every
    block's layer come from the model (``block.constructor.from_model``).
    """
    classes = _classes(scan)
    if len(classes) < 2:
        return
    by_type = layer_classes_by_type(scan, field_value(config, draft.mask.get("layer_types_field") or "layer_types"))
    by_index = layer_classes_by_index_field(scan, config) if isinstance(by_type, str) else None
    if by_index is not None:
        _check_constructors(draft, classes)
        draft.mask["layer_index_fields"] = {kind: field for kind, (field, _) in by_index.items()}
        draft.layer_classes = {kind: module_path(cls) for kind, (_, cls) in by_index.items()}
        draft.facts.append("layers of different classes, listed by index: " + ", ".join(
            f"{field} -> {cls.__name__} (type {kind!r})" for kind, (field, cls) in by_index.items())
            + " (block.mask.layer_index_fields, block.layer_classes)")
        return
    if isinstance(by_type, str) or not draft.mask.get("layer_types_field"):
        draft.review.append((by_type if isinstance(by_type, str) else
                             f"layers have different classes ({', '.join(c.__name__ for c in classes)}) but the "
                             "mask names no layer-type field")
                            + ": a family has one layer class per layer type (block.layer_classes)")
        return
    _check_constructors(draft, classes)
    draft.layer_classes = {t: module_path(c) for t, c in by_type.items() if c is not scan.layer_class}
    layers = {type(layer): layer for layer in scan.layers}
    for t, c in by_type.items():
        own, _ = find_attention(layers[c])
        if c is not scan.layer_class and own is not None and own is not scan.attention_class:
            draft.attention_classes[t] = module_path(own)
            draft.facts.append(_own_attention_fact(t, own.__name__))
    draft.facts.append("layers of different classes, one per layer type: " + ", ".join(
        f"{t} -> {c.__name__}" for t, c in by_type.items()) + " (block.layer_classes)")


def _own_attention_fact(layer_type: str, class_name: str) -> str:
    return f"layers of type {layer_type} hold their own attention class, {class_name} (block.attention_classes)"


def settle_attention_classes(draft: FamilyDraft) -> None:
    """Drop the ``block.attention_classes`` entries that name the family's ``attention_class`` once that is
    settled (a hybrid whose first layer has no attention learns it after the tiny runs): they say nothing."""
    for kind, path in list(draft.attention_classes.items()):
        if path == draft.attention_class:
            del draft.attention_classes[kind]
            fact = _own_attention_fact(kind, path.rpartition(".")[2])
            draft.facts[:] = [f for f in draft.facts if f != fact]
