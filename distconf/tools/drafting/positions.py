"""Positions computed outside the layers: what the model passes each layer, read from a tiny run.

Some models compute position inputs once, outside their layers, and give them only to some
layer types: rotary embeddings for some types and None for the others (layers without
positions), or a tensor made by a module-level function of the position ids (e.g. a
position-dependent query scaling for those layers). The drafter watches the keyword
arguments every layer of the tiny model receives and writes ``block.position.
rotary_layer_kinds`` and ``block.position.computed_arguments`` for what it sees. The same run shows what a
layer taking ``**kwargs`` gets there (its mask, positions, cache: `_kwargs_inputs`), a dict of rotary
embeddings (``block.position.rotary_keys``) and the token ids (``hidden_state.carried``, ``initial: token_ids``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import field_value
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_computed_positions"]

_HANDLED = {"cache_argument": "cache", "mask_argument": "attention_mask", "position_ids_argument": "position_ids",
            "alibi_argument": None}
"""Keywords the block passes itself (block.call's fields and their defaults)."""


def draft_computed_positions(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Add the position knobs the tiny model's layer calls show (nothing when all layers get the same), and what
    a layer taking ``**kwargs`` gets through them (`_kwargs_inputs`); ``vocab_size``: the real config's."""
    config_class, tiny = facts.config_class, facts.tiny
    layer_class, vocab_size = facts.layer_class, facts.vocab_size
    seen = _layer_calls(config_class, tiny, draft.attn_implementation)
    if seen is None:
        return
    config, calls, input_ids = seen
    _kwargs_inputs(draft, layer_class, calls)
    _rotary_keys(draft, config, calls)
    _token_ids(draft, calls, input_ids, vocab_size)
    field = draft.mask.get("layer_types_field")
    types = field_value(config, field) if field else None
    if not isinstance(types, (list, tuple)) or len(types) != len(calls):
        types = None
    rotary_argument = draft.call.get("position_embeddings_argument", "position_embeddings")
    if types is not None and "rotary_class" in draft.position and rotary_argument:
        with_rotary = {str(t) for t, kwargs in zip(types, calls, strict=True)
                       if kwargs.get(rotary_argument) is not None}
        if with_rotary and with_rotary != {str(t) for t in types}:
            draft.position["rotary_layer_kinds"] = sorted(with_rotary)
            draft.facts.append(f"only layers of type {', '.join(sorted(with_rotary))} get rotary embeddings "
                               "(the others get none: rotary_layer_kinds)")
    handled = {draft.call.get(k, default) for k, default in _HANDLED.items()} | {rotary_argument}
    handled |= set(draft.call.get("extra", {}))
    handled |= {carried["argument"] for carried in draft.hidden_state.get("carried", [])}
    names = sorted({k for kwargs in calls for k, v in kwargs.items() if _is_tensor(v)} - handled)
    if "position_ids" in names and "position_ids_argument" in draft.call:  # through the layer's **kwargs
        del draft.call["position_ids_argument"]
        names.remove("position_ids")
        draft.facts.append("the model passes position_ids to its layers, whose forward hands them on in **kwargs: "
                           "the block passes them too")
    computed = {}
    for name in names:
        found = _function_of_positions(layer_class, calls, name)
        if found is None and _relative_distances(calls, name):
            draft.position["relative_distance_argument"] = name
            draft.facts.append(f"the model passes its layers '{name}', each query's index minus each key's "
                               "(block.position.relative_distance_argument): the block computes it")
            continue
        if found is None:
            draft.review.append(f"the model passes its layers a tensor '{name}' the block does not compute: "
                                "declare it in block.position.computed_arguments")
            continue
        if types is None:
            kinds, every = ["every"], True
        else:
            kinds = sorted({str(t) for t, kwargs in zip(types, calls, strict=True) if _is_tensor(kwargs.get(name))})
            every = set(kinds) == {str(t) for t in types}
        entry: dict[str, Any] = {"function": found}
        if not every:
            entry["layer_kinds"] = kinds
        computed[name] = entry
        draft.facts.append(f"the model computes '{name}' from the position ids ({found.rsplit('.', 1)[-1]}) "
                           f"for layers of type {', '.join(kinds)}")
    if computed:
        draft.position["computed_arguments"] = computed


def _takes_kwargs(layer_class: type) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(layer_class.forward).parameters.values())
    except (TypeError, ValueError):
        return False


def _kwargs_inputs(draft: FamilyDraft, layer_class: type, calls: list[dict[str, Any]]) -> None:
    """A layer taking ``**kwargs`` (for its attention) that the model hands the mask, the position ids or its
    cache there: the block passes them the same way. A cache whose layers are the model's own classes (state
    beyond K/V, e.g. a compressor's) has no stand-in: the block keeps the layer's inputs and reruns them."""
    if not calls or not _takes_kwargs(layer_class):
        return
    for key, name in (("mask_argument", "attention_mask"), ("position_ids_argument", "position_ids")):
        if draft.call.get(key, name) is None and all(_is_tensor(kwargs.get(name)) for kwargs in calls):
            draft.call.pop(key)
            draft.facts.append(f"the layer passes '{name}' on to its attention through **kwargs: the block "
                               f"passes it so")
    from distconf.tools.drafting.scan import forward_parameters
    from distconf.tools.drafting.sections import cache_argument_names

    if "cache_argument" in draft.call or set(cache_argument_names()) & set(forward_parameters(layer_class)):
        return  # drafted already, or a parameter the layer names itself
    keyword = next((name for name in cache_argument_names() if all(kwargs.get(name) is not None for kwargs in calls)),
                   None)
    if keyword is None:
        return
    note = f"{layer_class.__name__}.forward takes no cache argument"
    draft.review[:] = [line for line in draft.review if not line.startswith(note)]
    own = sorted({type(layer).__name__ for layer in getattr(calls[0][keyword], "layers", ())
                  if type(layer).__module__ == layer_class.__module__})
    if own:
        draft.call["cache_argument"] = None
        draft.facts.append(f"the layer's cache ('{keyword}', through **kwargs) keeps layers of the model's own "
                           f"classes ({', '.join(own)}): a block keeps the layer's input hidden states and reruns "
                           "the whole sequence at every step (cache_argument: null)")
    elif keyword != "cache":
        draft.call["cache_argument"] = keyword
        draft.facts.append(f"the layer takes its cache as '{keyword}' through **kwargs")


def _rotary_keys(draft: FamilyDraft, config: Any, calls: list[dict[str, Any]]) -> None:
    """``block.position.rotary_keys`` when the layers get a dict of rotary embeddings: for each key, the rotary
    type (third argument of the rotary module) whose result it is."""
    import torch

    from distconf.loader.synthesis import import_object

    argument = draft.call.get("position_embeddings_argument", "position_embeddings")
    got = calls[0].get(argument) if calls and argument else None
    if not isinstance(got, dict) or not got or "rotary_class" not in draft.position:
        return
    positions = calls[0].get("position_ids")
    try:
        rotary = import_object(draft.position["rotary_class"])(config=config)
    except Exception:
        rotary = None
    if not _is_tensor(positions) or rotary is None:
        draft.review.append(f"the layers get a dict of rotary embeddings ({', '.join(map(str, got))}): set "
                            "block.position.rotary_keys (key -> rotary type)")
        return
    keys: dict[str, str] = {}
    for key, value in got.items():
        want = value if isinstance(value, (tuple, list)) else (value,)
        like = next((v for v in want if _is_tensor(v)), None)
        for kind in got:
            try:
                with torch.no_grad():
                    made = rotary(like, positions, kind)
            except Exception:
                continue
            made = made if isinstance(made, (tuple, list)) else (made,)
            if len(made) == len(want) and all(_is_tensor(a) and a.shape == b.shape and torch.allclose(a, b)
                                              for a, b in zip(made, want, strict=True)):
                keys[str(key)] = str(kind)
                break
        else:
            draft.review.append(f"the layers get rotary embeddings under {key!r} that {type(rotary).__name__} "
                                "computes for none of the keys: set block.position.rotary_keys")
            return
    draft.position.pop("rotary_layer_type_argument", None)
    draft.position["rotary_keys"] = keys
    shown = ", ".join(f"{k}: type {v}" for k, v in keys.items())
    draft.facts.append(f"the layers get a dict of rotary embeddings, {shown} (rotary_keys)")


def _token_ids(draft: FamilyDraft, calls: list[dict[str, Any]], input_ids: Any, vocab_size: int | None) -> None:
    """``hidden_state.carried`` of ``initial: token_ids`` for a keyword every layer gets the model's input ids as
    (e.g. a router choosing experts by token): the wire carries them to every block, as base-256 digits."""
    if not calls or not isinstance(vocab_size, int) or vocab_size < 1:
        return
    names = [name for name, value in calls[0].items() if _is_tensor(value) and not value.is_floating_point()
             and value.shape == input_ids.shape and bool((value == input_ids).all())]
    names = [name for name in names if all(_is_tensor(kwargs.get(name)) for kwargs in calls)]
    if not names:
        return
    digits = 1
    while 256 ** digits < vocab_size:
        digits += 1
    carried = [entry for entry in draft.hidden_state.get("carried", []) if entry.get("argument") not in names]
    carried += [{"argument": name, "width": digits, "initial": "token_ids"} for name in names]
    draft.hidden_state = {**draft.hidden_state, "carried": carried}
    draft.facts.append(f"every layer gets the token ids ({', '.join(names)}): blocks carry them on the wire after "
                       f"the hidden state, {digits} base-256 digits per token for a vocabulary of {vocab_size} "
                       "(hidden_state.carried, initial: token_ids)")


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _layer_calls(config_class: type, tiny: Mapping[str, Any],
                 attn_implementation: str) -> tuple[Any, list[dict[str, Any]], Any] | None:
    """The tiny config, the keyword arguments each layer got in one cached forward and the input ids it ran on
    (None if it fails)."""
    from distconf.tools.drafting.probe import Forward, observe

    # ids unlike any positions, so a layer's copy of them is recognized
    record = observe(config_class, tiny, attn_implementation, Forward(use_cache=True, ids=((5, 1, 7, 2, 6),)))
    if record.error is not None:
        return None
    calls: list[dict[str, Any]] = [{} for _ in range(record.layer_count)]
    for call in record.calls:
        calls[call.index] = call.kwargs
    return record.config, calls, record.input_ids


def _relative_distances(calls: list[dict[str, Any]], name: str) -> bool:
    """Every layer got ``name`` as each query's index minus each key's (a run from an empty cache)."""
    import torch

    values = [kwargs.get(name) for kwargs in calls]
    if not values or not all(_is_tensor(v) and v.ndim == 2 and v.shape[0] == v.shape[1] for v in values):
        return False
    index = torch.arange(values[0].shape[0])
    return all(torch.equal(v.cpu().long(), index[:, None] - index[None, :]) for v in values)


def _function_of_positions(layer_class: type, calls: list[dict[str, Any]], name: str) -> str | None:
    """The dotted path of a module-level function of the layer's module that, given the position ids
    the layer got, returns the tensor it got as ``name`` (None when none does)."""
    import torch

    module = inspect.getmodule(layer_class)
    call = next((kwargs for kwargs in calls if _is_tensor(kwargs.get(name))), None)
    if module is None or call is None:
        return None
    positions = call.get("position_ids")
    if not _is_tensor(positions):
        positions = torch.arange(5).unsqueeze(0)
    for attribute, function in sorted(vars(module).items()):
        if not inspect.isfunction(function) or function.__module__ != module.__name__:
            continue
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            continue
        if len(parameters) != 1 or parameters[0].name != "position_ids":
            continue
        try:
            value = function(positions)
        except Exception:
            continue
        expected = call[name]
        if _is_tensor(value) and value.shape == expected.shape and torch.allclose(value, expected):
            return f"{module.__name__}.{attribute}"
    return None
