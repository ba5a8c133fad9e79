"""Tensors the model hands each layer besides the hidden states, made outside the layers (per-layer inputs).

A model may compute, once for the whole model, a tensor per layer (from the token ids and embeddings) and pass
each layer its slice next to the hidden states (``decoder_layer(hidden_states, per_layer_input, ...)`` with
``per_layer_input = per_layer_inputs[:, :, i, :]``). When the model's forward reads so and the method computing
the whole is found (`computing_method`), the drafter writes ``hidden_state.carried`` with ``computed_by``: the
client's model computes it, the wire carries every layer's part. Otherwise it refuses in one line naming the
argument (and the config field sizing it): a block gets the hidden states only.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import DraftingError, is_int
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["refuse_layer_inputs", "positional_inputs", "computing_method"]

_HANDLED = {"cache_argument": "cache", "mask_argument": "attention_mask", "position_ids_argument": "position_ids",
            "position_embeddings_argument": "position_embeddings", "alibi_argument": None}
"""Keywords the block passes itself (block.call's fields and their defaults)."""


def positional_inputs(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                      layer_class: type) -> tuple[Any, dict[str, Any]]:
    """(tiny config, {parameter: tensor}) of the tensors the first layer of the tiny model gets positionally after
    the hidden states ({} when the model does not build or run)."""
    import torch

    from distconf.tools.drafting.probe import CACHED_RUN, observe

    record = observe(config_class, tiny, attn_implementation, CACHED_RUN)
    if not record.built:
        return None, {}
    if record.error is not None:
        return record.config, {}
    seen = [call.args for call in record.of_layer(0)]
    try:
        names = [n for n in inspect.signature(layer_class.forward).parameters if n != "self"]
    except (TypeError, ValueError):
        return record.config, {}
    args = seen[0] if seen else ()
    return record.config, {names[i]: value for i, value in enumerate(args) if 0 < i < len(names)
                    and isinstance(value, torch.Tensor)}


def _sized_by(config: Any, name: str, size: int) -> str | None:
    """The config field of value ``size`` whose name holds ``name``'s words (``hidden_size_per_layer_input``)."""
    words = set(name.split("_"))
    fields = [key for key, value in sorted(config.to_dict().items())
              if is_int(value) and value == size and words <= set(key.split("_"))]
    return fields[0] if fields else None


def refuse_layer_inputs(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Raise `DraftingError` when the model hands each layer a tensor besides the hidden states that the block
    does not pass itself (positionally: a per-layer input computed outside the layers)."""
    config_class, tiny = facts.config_class, facts.tiny
    layer_class = facts.layer_class
    config, inputs = positional_inputs(config_class, tiny, draft.attn_implementation, layer_class)
    handled = {draft.call.get(k, default) for k, default in _HANDLED.items()} | set(draft.call.get("extra", {}))
    handled |= set(draft.position.get("computed_arguments", {})) | set(draft.call.get("fresh_arguments", {}))
    handled |= {carried["argument"] for carried in draft.hidden_state.get("carried", [])}  # on the wire
    refused = {name: tensor for name, tensor in inputs.items() if name not in handled}
    owner_path, _, attribute = draft.prefix.rpartition(".")
    carried = []
    for name, tensor in list(refused.items()):
        field = _sized_by(config, name, int(tensor.shape[-1])) if tensor.dim() else None
        method = computing_method(_owner_class(config_class, tiny, draft.attn_implementation, owner_path),
                                  attribute, name)
        if field is None or method is None:
            continue
        computed_by = f"{owner_path}.{method}" if owner_path else method
        carried.append({"argument": name, "width": field, "computed_by": computed_by})
        draft.facts.append(f"the model computes {name} for every layer before the layers ({computed_by}, "
                           f"{field} values per token and layer) and hands each layer its part: the wire carries "
                           f"every layer's part after the hidden state, each block passes its own "
                           "(hidden_state.carried)")
        del refused[name]
    if carried:
        draft.hidden_state = {**draft.hidden_state,
                              "carried": [*draft.hidden_state.get("carried", []), *carried]}
    if not refused:
        return
    name, tensor = next(iter(refused.items()))
    field = _sized_by(config, name, int(tensor.shape[-1])) if tensor.dim() else None
    sized = f" of {field} values per token" if field else ""
    raise DraftingError(f"the model hands each layer '{name}' (a tensor{sized}, computed once for the whole model "
                        f"outside the layers) besides the hidden states; a block gets the hidden states only (as "
                        "the Petals wire carries them), so no family file can serve this model")


def _owner_class(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, owner_path: str) -> Any:
    """The tiny model's module holding the layer list (None when it does not build)."""
    from distconf.tools.drafting.probe import CACHED_RUN, observe

    model = observe(config_class, tiny, attn_implementation, CACHED_RUN).model
    if model is None:
        return None
    try:
        return model.get_submodule(owner_path) if owner_path else model
    except AttributeError:  # no such module: the layer list's path was read on another model
        return None


def computing_method(owner: Any, layers_attribute: str, argument: str) -> str | None:
    """The method of ``owner`` whose result ``owner``'s forward slices for each layer and hands it as ``argument``.

    The layer loop reads ``part = whole[..., i, :]`` (``i`` the loop's index, maybe ``... if whole is not None else
    None``) and passes ``part`` as ``argument``; ``whole`` was last assigned ``self.<method>(...)``. None when the
    forward does not read so.
    """
    if owner is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or not any(isinstance(n, ast.Attribute) and n.attr == layers_attribute
                                                    for n in ast.walk(loop.iter)):
            continue
        index = _loop_index(loop)
        if index is None:
            continue
        whole = _sliced_name(loop, index, argument, getattr(owner, layers_attribute, None))
        if whole is None:
            continue
        assigned = sorted((node.lineno, node.value.func.attr) for node in ast.walk(tree)
                          if isinstance(node, ast.Assign) and _names(node.targets) == [whole]
                          and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                          and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "self")
        if assigned and callable(getattr(owner, assigned[-1][1], None)):  # the last assignment in the source
            return assigned[-1][1]
    return None


def _names(targets: list[ast.expr]) -> list[str]:
    """The plain names among assignment ``targets``."""
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _loop_index(loop: ast.For) -> str | None:
    """The index name of ``for i, layer in enumerate(...)`` (None for another loop)."""
    target, iterator = loop.target, loop.iter
    if (isinstance(iterator, ast.Call) and isinstance(iterator.func, ast.Name) and iterator.func.id == "enumerate"
            and isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name)):
        return target.elts[0].id
    return None


def _sliced_name(loop: ast.For, index: str, argument: str, layers: Any) -> str | None:
    """``whole`` of the loop's ``part = whole[..., index, :]`` whose ``part`` the layer call passes as
    ``argument`` (positionally by the signature of the first of ``layers``, or by keyword)."""
    parts: dict[str, str] = {}
    for node in ast.walk(loop):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value.body if isinstance(node.value, ast.IfExp) else node.value
            whole = _layer_slice(value, index)
            if whole is not None:
                parts[node.targets[0].id] = whole
    try:
        names = [n for n in inspect.signature(type(layers[0]).forward).parameters if n != "self"]
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    layer_name = loop.target.elts[1].id if isinstance(loop.target, ast.Tuple) and len(loop.target.elts) > 1 \
        and isinstance(loop.target.elts[1], ast.Name) else None
    for node in ast.walk(loop):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id != layer_name:
            continue
        passed = {k.arg: k.value for k in node.keywords if k.arg}
        passed.update({names[j]: arg for j, arg in enumerate(node.args) if j < len(names)})
        value = passed.get(argument)
        if isinstance(value, ast.Name) and value.id in parts:
            return parts[value.id]
    return None


def _layer_slice(value: ast.expr, index: str) -> str | None:
    """``whole`` of ``whole[:, ..., index, :]`` (full slices but the second-to-last, the loop's index)."""
    if not isinstance(value, ast.Subscript) or not isinstance(value.value, ast.Name):
        return None
    elements = value.slice.elts if isinstance(value.slice, ast.Tuple) else []
    if len(elements) < 2 or not (isinstance(elements[-2], ast.Name) and elements[-2].id == index):
        return None
    full = all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None
               for e in (*elements[:-2], elements[-1]))
    return value.value.id if full else None
