"""The ``block`` sections of a draft: constructor and call keywords, positions, mask rule.

Each is read from signatures and module classes of the model built on the meta
device, and from the config: the names a layer takes (``cache`` / ``layer_past``,
``alibi`` ...), the rotary module of the base model, the layer types of the config.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import MISSING, field_value, module_path, try_config
from distconf.tools.drafting.constructor_args import constant_arguments
from distconf.tools.drafting.layer_call import LayerCall, read_layer_call
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.scan import ModelScan, forward_parameters

__all__ = ["cache_argument_names", "draft_constructor", "draft_call", "draft_position", "draft_mask",
           "draft_mask_skip", "draft_model_inputs", "map_layer_kinds", "mask_kind_of"]

_CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past", "past_key_value")
_LAYER_IDX_ARGUMENTS = ("layer_idx", "layer_id", "layer_number", "layer_index")
# inputs the generic block passes (or the layer computes itself when left out)
_KNOWN_INPUTS = {*_CACHE_ARGUMENTS, "self", "hidden_states", "attention_mask", "position_ids", "position_embeddings",
                 "alibi", "use_cache", "output_attentions", "cache_position"}
# transformers' standard attention layer types -> mask kind, and the standard config field of each kind's size
_KNOWN_LAYER_TYPES = {"full_attention": "causal", "sliding_attention": "sliding_window", "chunked_attention": "chunked",
                      "indexed_attention": "causal"}  # sparse-attention layers: causal, their indexer narrows it


def cache_argument_names() -> tuple[str, ...]:
    """The keywords a decoder layer's cache goes by, the first preferred."""
    return _CACHE_ARGUMENTS


def mask_kind_of(layer_type: str) -> str:
    """The mask kind of a K/V layer of a known ``layer_types`` value; of another, the kind a word of its name
    says (``sliding`` / ``chunked``, e.g. a hybrid layer type ``hybrid_sliding``), else causal."""
    known = _KNOWN_LAYER_TYPES.get(layer_type)
    if known is not None:
        return known
    words = set(layer_type.lower().split("_"))
    return "sliding_window" if "sliding" in words else "chunked" if "chunked" in words else "causal"


_DEFAULT_LAYER_KINDS = {"full_attention": "causal", "sliding_attention": "sliding_window"}
_SIZE_FIELDS = {"sliding_window": "sliding_window", "chunked": "attention_chunk_size"}
_SIZE_KEYS = {"sliding_window": "sliding_window", "chunked": "chunk_size"}


def draft_constructor(draft: FamilyDraft, layer_class: type, owner: Any = None) -> None:
    """``block.constructor``: the config and layer-index argument names of the layer's ``__init__``."""
    try:
        params = [p for p in inspect.signature(layer_class.__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    config_name = _config_parameter(params)
    if config_name is None and names:
        draft.review.append(f"{layer_class.__name__}() takes no parameter that is a config ({', '.join(names)}): "
                            "set block.constructor.config_argument")
    elif config_name is not None and config_name != "config":
        draft.constructor["config_argument"] = config_name
    idx_name = next((n for n in _LAYER_IDX_ARGUMENTS if n in names), None)
    if idx_name is None:
        draft.constructor["layer_idx_argument"] = None
    elif idx_name != "layer_idx":
        draft.constructor["layer_idx_argument"] = idx_name
    required = [p.name for p in params if p.default is p.empty and p.name not in (idx_name, config_name or names[0])]
    passed = constant_arguments(owner, layer_class, names) if owner is not None else {}
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    # an optional argument counts when the model passes another value than its default
    extra = {name: formula for name, formula in passed.items() if name not in (idx_name, config_name)
             and (name in required or (name in defaults and formula != repr(defaults[name])))}
    if extra:
        draft.constructor["extra"] = extra
        given = ", ".join(f"{k}={v}" for k, v in extra.items())
        draft.facts.append(f"the model builds its layers with {given}")
        required = [name for name in required if name not in extra]
    if required:
        draft.review.append(f"{layer_class.__name__}() also requires {', '.join(required)}: add them under "
                            "block.constructor.extra as formulas over config fields")


def _config_parameter(params: list[inspect.Parameter]) -> str | None:
    """The constructor parameter that takes the config: named so, or annotated with a config class."""
    for p in params:
        if p.name == "config" or p.name.endswith("_config") or p.name in ("cfg", "configuration"):
            return p.name
    for p in params:
        annotation = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        if "Config" in str(annotation):
            return p.name
    return None


def draft_call(draft: FamilyDraft, layer_class: type) -> dict[str, inspect.Parameter]:
    """``block.call``: the keyword names of the layer's ``forward``; returns its parameters."""
    params = forward_parameters(layer_class)
    cache_arg = next((n for n in _CACHE_ARGUMENTS if n in params), None)
    if cache_arg is None and params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        draft.call["cache_argument"] = None
        draft.facts.append(f"{layer_class.__name__}.forward takes no cache: a block keeps the layer's input hidden "
                           "states and reruns the whole sequence at every step")
    elif cache_arg is None:
        draft.review.append(f"{layer_class.__name__}.forward takes no cache argument: incremental decoding "
                            "needs one")
    elif cache_arg != "cache":
        draft.call["cache_argument"] = cache_arg
        draft.facts.append(f"the layer takes its cache as '{cache_arg}' (a 'cache=' keyword would be ignored)")
    for key, name in (("mask_argument", "attention_mask"), ("position_ids_argument", "position_ids"),
                      ("position_embeddings_argument", "position_embeddings")):
        if name not in params:
            draft.call[key] = None
    return params


def draft_position(draft: FamilyDraft, scan: ModelScan, params: Mapping[str, Any], config: Any) -> None:
    """``block.position``: the base model's rotary module, and / or the layer's ALiBi argument."""
    rotary = scan.rotary_class
    if rotary is not None and "position_embeddings" not in params and _kwargs_get_rotary(scan, params):
        draft.call.pop("position_embeddings_argument", None)  # the layer passes its **kwargs to the attention
        params = {**params, "position_embeddings": None}
    if rotary is not None and "position_embeddings" in params:
        draft.position["rotary_class"] = module_path(rotary)
        if "layer_type" in forward_parameters(rotary):
            draft.position["rotary_layer_type_argument"] = True
    if "alibi" in params:
        draft.call["alibi_argument"] = "alibi"
        module = inspect.getmodule(scan.layer_class)
        if module is not None and callable(getattr(module, "build_alibi_tensor", None)):
            draft.position["alibi_function"] = f"{module.__name__}.build_alibi_tensor"
        else:
            draft.review.append("the layer takes an alibi tensor: set block.position.alibi_function")
    if "rotary_class" in draft.position:
        if "alibi_function" in draft.position:
            # a boolean config field named like the layer's argument says which one applies
            flag = "alibi" if isinstance(field_value(config, "alibi"), bool) else None
            draft.position["alibi_when"] = flag or "TODO_formula_true_when_alibi"
            if flag is None:
                draft.review.append("the layer supports rotary and ALiBi: set block.position.alibi_when")
    elif rotary is not None:
        draft.review.append(f"{rotary.__name__} exists but the layer takes no position_embeddings; check "
                            "block.position")


def _kwargs_get_rotary(scan: ModelScan, params: Mapping[str, Any]) -> bool:
    """The layer takes ``**kwargs`` and the base model passes ``position_embeddings=`` to its layers."""
    if not any(getattr(p, "kind", None) is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    try:
        source = inspect.getsource(type(scan.base_model).forward)
    except (OSError, TypeError):
        return False
    return "position_embeddings=" in source


def draft_mask(draft: FamilyDraft, config: Any, base_model: Any) -> None:
    """``block.mask``: per-layer types from ``layer_types``, a window on every layer, or causal."""
    try:
        source = inspect.getsource(type(base_model).forward)
    except (OSError, TypeError):
        source = ""
    layer_types = field_value(config, "layer_types")
    has_window = field_value(config, "sliding_window", MISSING) is not MISSING
    window = field_value(config, "sliding_window")
    # the model may read each layer's type through the layer (``decoder_layer.attention_type``), not in forward
    per_layer = "layer_types" in source or not source or bool(draft.position.get("rotary_layer_type_argument")) \
        or "layer_types" in _module_source(type(base_model))
    if has_window and _mask_builders(source) == {"create_sliding_window_causal_mask"}:
        # one mask for every layer whatever its type: the layer types name other differences (e.g. compression)
        draft.mask = {"kind": "sliding_window", "sliding_window": "sliding_window"}
        draft.facts.append(f"the model builds one sliding-window mask ({window} tokens) for all its layers")
    elif isinstance(layer_types, (list, tuple)) and layer_types and per_layer:
        draft.mask = _layer_types_rule([str(t) for t in layer_types], config, draft.review)
        counts = ", ".join(f"{layer_types.count(t)} {t}" for t in dict.fromkeys(layer_types))
        draft.facts.append(f"mask per layer from layer_types ({counts}); sliding_window={window}")
    elif has_window and "create_sliding_window_causal_mask" in source:
        draft.mask = {"kind": "sliding_window", "sliding_window": "sliding_window"}
        if window:
            draft.facts.append(f"every layer has sliding-window attention ({window} tokens: query q sees keys "
                               "q-window+1 .. q)")
    elif has_window and not source:
        draft.review.append("the config has sliding_window; check whether every layer slides (mask.kind)")


def _mask_builders(source: str) -> set[str]:
    """Names of the ``create_*mask`` functions ``source`` (a forward's) calls."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return set()
    return {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id.startswith("create_") and "mask" in node.func.id}


def map_layer_kinds(draft: FamilyDraft, types: list[str]) -> None:
    """Map layer types only a tiny variant builds (`mask_kind_of`) in ``block.mask.layer_kinds``."""
    if "layer_types_field" not in draft.mask:
        return
    kinds = dict(draft.mask.get("layer_kinds") or _DEFAULT_LAYER_KINDS)
    added = {t: mask_kind_of(t) for t in types if t not in kinds}
    if added:
        draft.mask["layer_kinds"] = {**kinds, **added}


def draft_mask_skip(draft: FamilyDraft, *classes: type | None) -> None:
    """``block.mask.allow_skip: false`` when the layer or its attention reads the mask's values or shape.

    Such code (``attention_mask.dtype``, ``attention_mask[...]``: a mask it combines with
    one of its own) needs the mask materialized: a plain causal mask skipped for sdpa
    (None + is_causal) would drop what it adds.
    """
    for cls in classes:
        found = _reads_mask(cls) if cls is not None else None
        if found:
            draft.mask["allow_skip"] = False
            draft.facts.append(f"{cls.__name__} reads the mask itself ({found}): the mask is always "
                               "materialized (allow_skip: false)")
            return


@functools.cache
def _reads_mask(cls: type) -> str | None:
    """The first ``attention_mask.<attr>`` or ``attention_mask[...]`` in ``cls``'s source, if any (read once per
    class: finding a class's source parses its whole module)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.value, ast.Name) \
                and node.value.id == "attention_mask":
            return ast.unparse(node)
    return None


def _module_source(cls: type) -> str:
    try:
        module = inspect.getmodule(cls)
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ""


def _layer_types_rule(types: list[str], config: Any, review: list[str]) -> dict[str, Any]:
    rule: dict[str, Any] = {"layer_types_field": "layer_types"}
    unknown = sorted(set(types) - set(_KNOWN_LAYER_TYPES))
    if unknown:
        review.append(f"layer_types has {unknown}; map each type in block.mask.layer_kinds "
                      "(causal, sliding_window or chunked) or the family cannot be served generically")
    kinds = {t: _KNOWN_LAYER_TYPES[t] for t in dict.fromkeys(types) if t in _KNOWN_LAYER_TYPES}
    has_window = field_value(config, "sliding_window", MISSING) is not MISSING
    if not set(kinds.items()) <= set(_DEFAULT_LAYER_KINDS.items()) or not has_window:
        rule["layer_kinds"] = kinds  # the default mapping names sliding layers, which need a window field
    for kind in ("sliding_window", "chunked"):
        field = _SIZE_FIELDS[kind]
        if field_value(config, field, MISSING) is not MISSING and _declares(config, field) \
                and (kind == "sliding_window" or kind in kinds.values()):
            rule[_SIZE_KEYS[kind]] = field
        elif kind in kinds.values():
            review.append(f"layer_types has {kind} layers but the config has no {field} field; set "
                          f"block.mask.{_SIZE_KEYS[kind]} to the field holding their size")
    return rule


def _declares(config: Any, name: str) -> bool:
    """Whether the config class itself has field ``name`` (a config.json may carry keys the class does not
    know; a formula can use only the class's fields)."""
    defaults = try_config(type(config))
    return defaults is MISSING or hasattr(defaults, name)  # a class without a default instance: trust the config


def draft_model_inputs(draft: FamilyDraft, scan: ModelScan, params: Mapping[str, inspect.Parameter]) -> None:
    """Inputs the model prepares for its layers, read from its source: a position bias, a boolean mask.

    A required input the block cannot pass becomes a review note.
    """
    required = [name for i, (name, p) in enumerate(params.items()) if i > 1 and name not in _KNOWN_INPUTS
                and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    call = read_layer_call(scan.base_model, scan.prefix.rpartition(".")[2])
    for name in required:
        if call is None or not _bias_input(draft, call, name):
            draft.review.append(f"{scan.layer_class.__name__}.forward requires {name!r}, which the block does not "
                                "pass: see how the model computes it and declare it (block.call / block.position)")
    mask_argument = draft.call.get("mask_argument", "attention_mask")
    if call is not None and mask_argument and call.casts_to_bool(mask_argument):
        draft.mask.update({"boolean": "masked", "allow_skip": False})
        draft.facts.append("the model casts its float attention mask to booleans (True = masked) for the layers")


def _bias_input(draft: FamilyDraft, call: LayerCall, name: str) -> bool:
    """``name`` is made by a function of the model's module from config values: the block makes it the same way."""
    found = call.function(call.origin(name))
    if found is None:
        return False
    function, node = found
    try:
        bound = inspect.signature(function).bind_partial(*node.args, **{k.arg: k.value for k in node.keywords
                                                                        if k.arg})
    except TypeError:
        return False
    arguments = {}
    for param, expr in bound.arguments.items():
        formula = call.formula(expr) if param != "device" else "device"
        if formula is None:
            return False
        if param != "device":
            arguments[param] = formula
    draft.call["alibi_argument"] = name
    draft.position["alibi_function"] = f"{function.__module__}.{function.__name__}"
    draft.position["alibi_arguments"] = arguments
    draft.facts.append(f"the layer takes {name!r}, which the model builds with {function.__name__}("
                       + ", ".join(f"{k}={v}" for k, v in arguments.items()) + "); the block builds it the same way")
    lengths = [formula for param, formula in arguments.items() if "len" in param or "seq" in param]
    if len(lengths) == 1:  # built once for a length from the config: no position past it has a bias
        draft.position["max_positions"] = lengths[0]
        draft.facts.append(f"the bias is built for {lengths[0]} positions: sessions hold at most that many")
    return True
