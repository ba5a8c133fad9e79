"""Tensors the model hands each layer besides the hidden states, made outside the layers (per-layer inputs).

A model may compute, once for the whole model, a tensor per layer from the token ids and pass each layer
its slice next to the hidden states (``decoder_layer(hidden_states, per_layer_input, ...)``). A block gets
the hidden states only (as the Petals wire carries them), so no family file can serve such a model: the
drafter finds the argument on a tiny run and refuses in one line naming it (and the config field sizing it).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import DraftingError, field_value, is_int, quiet_transformers
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["refuse_layer_inputs", "positional_inputs"]

_HANDLED = {"cache_argument": "cache", "mask_argument": "attention_mask", "position_ids_argument": "position_ids",
            "position_embeddings_argument": "position_embeddings", "alibi_argument": None}
"""Keywords the block passes itself (block.call's fields and their defaults)."""


def positional_inputs(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                      layer_class: type) -> tuple[Any, dict[str, Any]]:
    """(tiny config, {parameter: tensor}) of the tensors the first layer of the tiny model gets positionally after
    the hidden states ({} when the model does not build or run)."""
    import torch

    from distconf.tools.drafting.probe import build_tiny_model
    from distconf.tools.drafting.scan import find_layer_list

    try:
        config, model = build_tiny_model(config_class, tiny, attn_implementation)
        _, layers = find_layer_list(model, field_value(config, "num_hidden_layers"))
    except Exception:  # the tiny run reports why the config does not build
        return None, {}
    seen: list[tuple[Any, ...]] = []

    def record(module: Any, args: tuple[Any, ...]) -> None:
        seen.append(tuple(args))

    handle = layers[0].register_forward_pre_hook(record)
    try:
        with torch.no_grad(), quiet_transformers():
            model(torch.randint(0, 8, (1, 5)), use_cache=True)
    except Exception:
        return config, {}
    finally:
        handle.remove()
    try:
        names = [n for n in inspect.signature(layer_class.forward).parameters if n != "self"]
    except (TypeError, ValueError):
        return config, {}
    args = seen[0] if seen else ()
    return config, {names[i]: value for i, value in enumerate(args) if 0 < i < len(names)
                    and isinstance(value, torch.Tensor)}


def _sized_by(config: Any, name: str, size: int) -> str | None:
    """The config field of value ``size`` whose name holds ``name``'s words (``hidden_size_per_layer_input``)."""
    words = set(name.split("_"))
    fields = [key for key, value in sorted(config.to_dict().items())
              if is_int(value) and value == size and words <= set(key.split("_"))]
    return fields[0] if fields else None


def refuse_layer_inputs(draft: FamilyDraft, config_class: type, tiny: Mapping[str, Any], layer_class: type) -> None:
    """Raise `DraftingError` when the model hands each layer a tensor besides the hidden states that the block
    does not pass itself (positionally: a per-layer input computed outside the layers)."""
    config, inputs = positional_inputs(config_class, tiny, draft.attn_implementation, layer_class)
    handled = {draft.call.get(k, default) for k, default in _HANDLED.items()} | set(draft.call.get("extra", {}))
    handled |= set(draft.position.get("computed_arguments", {})) | set(draft.call.get("fresh_arguments", {}))
    refused = {name: tensor for name, tensor in inputs.items() if name not in handled}
    if not refused:
        return
    name, tensor = next(iter(refused.items()))
    field = _sized_by(config, name, int(tensor.shape[-1])) if tensor.dim() else None
    sized = f" of {field} values per token" if field else ""
    raise DraftingError(f"the model hands each layer '{name}' (a tensor{sized}, computed once for the whole model "
                        f"outside the layers) besides the hidden states; a block gets the hidden states only (as "
                        "the Petals wire carries them), so no family file can serve this model")
