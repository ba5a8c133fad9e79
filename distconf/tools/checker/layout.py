"""Step 2 of the check: the family's checkpoint layout, and the blocks built from it alone.

``block.prefix`` must select exactly the tensors of each layer, the model's module there
must be a ``block.layer_class``, and every block loaded through the family file must hold
the layer's parameters and a ``block.attention_class`` that receives the KV cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distconf.blocks.build import make_block_class
from distconf.blocks.layer_types import any_layer_keeps_kv, layer_type
from distconf.errors import FamilyValidationError
from distconf.loader.config_protocol import DistributedConfig
from distconf.tools.checker.failures import located_failure, validation_failure
from distconf.tools.checker.reference import Reference

__all__ = ["attention_class", "check_layer_tensors", "load_blocks", "check_attention_gets_cache",
           "check_meta_build"]


def attention_class(cls: type) -> type:
    """The family's attention class, or a failure at ``block.attention_class``."""
    try:
        return cls.attn_class  # type: ignore[attr-defined]
    except FamilyValidationError as exc:  # its problem is located there already: its message, not its location twice
        raise validation_failure(exc) from None


def check_layer_tensors(cls: type, reference: Reference, files: dict[str, Path]) -> None:
    """Each layer is a ``block.layer_class`` at ``block.prefix``; layers claim disjoint tensors, none beyond."""
    from distconf.blocks.weights import layer_keys

    spec = cls.family_spec  # type: ignore[attr-defined]
    config = reference.config
    claimed: set[str] = set()
    for i in range(reference.layers):
        hf_layer = reference.layer(i)
        if hf_layer is None:
            raise located_failure(cls, ("block", "prefix"),
                                  f"the model has no module at {spec.block.prefix}.{i} (nor with/without the base "
                                  f"prefix {spec.block.base_model_prefix!r})")
        kind = layer_type(config, i) if spec.block.layer_classes else None
        layer_class = make_block_class(cls, kind).layer_class
        if not isinstance(hf_layer, layer_class):
            where = ("block", "layer_classes", kind) if kind in spec.block.layer_classes else ("block", "layer_class")
            raise located_failure(cls, where, f"the model's layer {i} is a "
                                  f"{type(hf_layer).__name__}, not {layer_class.__name__}")
        _, names = layer_keys(files, config, i)
        overlap = claimed.intersection(names)
        if overlap:
            raise located_failure(cls, ("block", "prefix"), f"tensors claimed by two layers: {sorted(overlap)[:3]}")
        claimed.update(names)
    prefix0, _ = layer_keys(files, config, 0)
    if prefix0 is None:
        return
    stem = prefix0[: -len("0.")]
    indices = ((n, n[len(stem):].split(".")[0]) for n in files if n.startswith(stem))
    beyond = [n for n, index in indices if index.isdigit() and int(index) >= reference.layers]
    if beyond:
        raise located_failure(cls, ("block", "prefix"), f"tensors beyond the last layer: {beyond[:3]}")


def _holds_attention(block: Any) -> bool:
    """Whether ``block`` must contain ``block.attention_class``: every block keeping K/V, and in a family whose
    layers keep only a state, every block (its recurrent mixer is then the class given the cache)."""
    return block.capabilities.keeps_kv or not any_layer_keeps_kv(type(block).config_class)


def first_attention_block(blocks: list[Any]) -> Any:
    """The first block that contains the attention class (`check_attention_gets_cache` probes it)."""
    return next((b for b in blocks if _holds_attention(b)), blocks[0])


def load_blocks(cls: type, directory: Path, reference: Reference, attn_class: type) -> list[Any]:
    """Load every block from the checkpoint through the family file; compare parameter counts."""
    import torch

    from distconf.blocks.weights import BlockWeightsError, load_block
    from distconf.loader.layer_stack import model_layer

    blocks = []
    for i in range(reference.blocks):
        try:
            block = load_block(directory, reference.config, i, dtype=torch.float32)
        except BlockWeightsError as exc:
            if exc.field is None and "without data" in str(exc):  # not a checkpoint problem: a computed buffer
                raise located_failure(cls, ("block",), f"{exc} (buffers the layer computes itself are not in "
                                      "checkpoints; transformers' model class must initialize them)") from None
            raise located_failure(cls, tuple((exc.field or "block.prefix").split(".")), str(exc)) from None
        own, loc = _attention_of(cls, reference.config, model_layer(reference.config, i), attn_class)
        if _holds_attention(block) and not any(isinstance(m, own) for m in block.modules()):
            found = sorted({type(m).__name__ for m in block.modules() if "atten" in type(m).__name__.lower()})
            raise located_failure(cls, loc,
                                  f"no {own.__name__} inside block {i} (attention-like modules: "
                                  f"{', '.join(found) or 'none'})")
        hf_params = sum(p.numel() for p in reference.layer(model_layer(reference.config, i)).parameters())
        params = sum(p.numel() for p in block.parameters())
        if params != hf_params:
            raise located_failure(cls, ("block", "constructor"),
                                  f"block {i} has {params} parameters, the model's layer {hf_params}")
        blocks.append(block)
    return blocks


def _attention_of(cls: type, config: Any, layer_idx: int, attn_class: type) -> tuple[type, tuple[str, ...]]:
    """The attention class of layer ``layer_idx`` (``block.attention_classes`` of its type, else
    ``attn_class``) and the field naming it."""
    from distconf.blocks.layer_types import layer_type
    from distconf.loader.synthesis import resolve_object

    kind = layer_type(config, layer_idx)
    classes = cls.family_spec.block.attention_classes  # type: ignore[attr-defined]
    if kind is None or kind not in classes:
        return attn_class, ("block", "attention_class")
    loc = ("block", "attention_classes", kind)
    try:
        return resolve_object(cls.family_source, loc, classes[kind], want_class=True), loc  # type: ignore[attr-defined]
    except FamilyValidationError as exc:
        raise validation_failure(exc) from None


def check_attention_gets_cache(cls: type, block: Any, attn_class: type, width: int) -> None:
    """The attention class must be the module the KV cache is handed to (not just any submodule); a layer that
    keeps no cache (``block.call.cache_argument: null``) is handed none. ``width``: the config's wire width."""
    import torch

    if cls.family_spec.block.call.cache_argument is None:  # type: ignore[attr-defined]
        return

    from distconf.blocks.hybrid_cache import BlockHybridCache
    from distconf.blocks.kvcache import BlockKVCache
    from distconf.blocks.state import BlockStateCache
    from distconf.blocks.state_carriers import LayerStateList, MethodStateCache
    from distconf.blocks.sublayer_cache import BlockSublayerKVCache

    got_cache: list[bool] = []
    state = cls.family_spec.state  # type: ignore[attr-defined]
    returned = state is not None and state.returned_tuple  # the layer gets its state tuple, not a cache

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        caches = (BlockKVCache, BlockSublayerKVCache, BlockStateCache, BlockHybridCache, MethodStateCache,
                  LayerStateList)
        values = (*args, *kwargs.values())
        got_cache.append(any(isinstance(v, caches) for v in values) or (returned and any(
            isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v) for v in values)))

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in block.modules() if isinstance(m, attn_class)]
    try:
        with torch.no_grad():
            _, past = block(torch.zeros(1, 2, width), use_cache=True)
            if returned:  # the first step hands it None: the next one, the tuple
                block(torch.zeros(1, 1, width), layer_past=past, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    if not any(got_cache):
        raise located_failure(cls, ("block", "attention_class"), f"{attn_class.__name__} occurs in the block but "
                              "is not the module that receives the KV cache")


def check_meta_build(cls: type, config: DistributedConfig) -> None:
    """Building a block on the meta device (as sizing does) must allocate no real tensors."""
    from distconf.blocks import build_block

    meta = build_block(config, 0, device="meta")
    if any(not p.is_meta for p in meta.parameters()):
        raise located_failure(cls, ("block", "layer_class"), "building on the meta device allocated real tensors")
