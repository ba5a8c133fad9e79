"""``distconf check``: prove a family file on a tiny real model.

For each variant of the family's ``tiny_config`` (a dict of config values; an optional
``variants`` list holds dicts applied on top of the rest, one model each):

1. build the Hugging Face model (float32, random weights) and save it as a sharded
   safetensors checkpoint in a temporary folder;
2. check that ``block.prefix`` selects exactly the tensors of each layer, that the
   model's layer there is a ``block.layer_class``, and that ``block.attention_class``
   occurs in the block;
3. build and load every block through the family metadata only, run them in sequence
   and compare with the HF model's per-layer hidden states: full sequence, token by token
   with the KV cache, and in multi-token steps after a prefix; check that the attention
   class is the module the cache is handed to;
4. compare the cache each block really holds with ``kv_cache_bytes_per_token`` and each
   loaded block's size with ``block_size_bytes``.

Any mismatch becomes a `CheckFailure` naming the family-file field to fix.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distconf.errors import FamilyValidationError

__all__ = ["CheckResult", "CheckFailure", "check_family", "tiny_variants", "TOLERANCE"]

logger = logging.getLogger(__name__)

TOLERANCE = 1e-5
"""Largest allowed |block - reference| relative to max(1, |reference|), in float32."""

_SEQ_LEN = 9
_CHUNKS = (4, 2, 1, 2)  # sums to _SEQ_LEN
_BATCH = 2
_WEIGHT_NOISE = 0.05


class CheckFailure(Exception):
    """A family file does not describe its model correctly; ``field`` names what to fix."""

    def __init__(self, field: str, message: str, location: str | None = None) -> None:
        self.field = field
        self.location = location
        where = f"{location}: " if location else ""
        super().__init__(f"{where}{field}: {message}")


@dataclass
class CheckResult:
    """Outcome of checking one tiny-config variant of one family."""

    family: str
    variant: str
    layers: int = 0
    params_per_block: int = 0
    full_diff: float | None = None
    incremental_diff: float | None = None
    kv_declared: int | None = None
    kv_actual: int | None = None
    size_declared: int | None = None
    size_actual: int | None = None
    shards: int = 0
    seconds: float = 0.0
    failure: CheckFailure | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every comparison passed."""
        return self.failure is None


def _fail(cls: type, loc: tuple[str, ...], message: str) -> CheckFailure:
    problem = cls.family_source.problem(loc, message)
    return CheckFailure(problem.field, message, f"{problem.path}:{problem.line}:{problem.column}")


def _run_in_steps(blocks: list[Any], hidden: Any, sizes: list[int]) -> tuple[Any, list[Any]]:
    """Feed ``hidden`` through the chain in steps of ``sizes`` tokens, carrying each block's cache."""
    import torch

    caches: list[Any] = [None] * len(blocks)
    outputs, start = [], 0
    for size in sizes:
        step = hidden[:, start:start + size]
        for i, block in enumerate(blocks):
            step, caches[i] = block(step, layer_past=caches[i], use_cache=True)
        outputs.append(step)
        start += size
    return torch.cat(outputs, dim=1), caches


def _crash_failure(cls: type, spec: Any, exc: Exception) -> CheckFailure:
    """Name the most likely field when running a block raised an exception."""
    import inspect

    from distconf.family.synthesis import import_object

    message = f"{type(exc).__name__}: {exc}"
    call, position = spec.block.call, spec.block.position
    try:
        parameters = inspect.signature(import_object(spec.block.layer_class).forward).parameters
    except (ImportError, TypeError, ValueError):
        parameters = {}
    wants_rotary = call.position_embeddings_argument in parameters
    if isinstance(exc, TypeError) and wants_rotary and position.rotary_class is None and not position.alibi_function:
        return _fail(cls, ("block", "position", "rotary_class"),
                     f"{message} (the layer takes {call.position_embeddings_argument!r} but the family declares "
                     "no block.position.rotary_class, so it got None)")
    return _fail(cls, ("block",), f"{message} (check block.call, block.position and block.mask)")


def tiny_variants(tiny: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Expand a ``tiny_config`` into named variants (``variants`` entries applied on the base)."""
    base = {k: v for k, v in tiny.items() if k != "variants"}
    extra = tiny.get("variants") or []
    if not extra:
        return [("tiny", base)]
    out = []
    for entry in extra:
        name = ",".join(f"{k}={v}" for k, v in entry.items()) or "base"
        out.append((name, {**base, **entry}))
    return out


def _find_layer_module(model: Any, config: Any, layer_idx: int) -> Any:
    from distconf.blocks.weights import layer_prefixes

    modules = dict(model.named_modules())
    for prefix in layer_prefixes(config, layer_idx):
        module = modules.get(prefix.rstrip("."))
        if module is not None:
            return module
    return None


def _max_rel_diff(a: Any, b: Any) -> float:
    scale = max(1.0, float(b.abs().max()))
    return float((a - b).abs().max()) / scale


def _perturb(model: Any) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * _WEIGHT_NOISE)


def _save_sharded(model: Any, directory: Path) -> None:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=max(total // 4, 4096))


def _kv_field(cls: type, spec: Any, name: str) -> tuple[str, ...]:
    if getattr(spec.kv_cache, name) is not None:
        return ("kv_cache", name)
    return ("kv_groups",) if name == "num_kv_heads" else ("kv_cache", name)


def _check_attention_gets_cache(cls: type, block: Any, attn_class: type, config: Any) -> None:
    """The attention class must be the module the KV cache is handed to (not just any submodule)."""
    import torch

    from distconf.blocks.kvcache import BlockKVCache

    got_cache: list[bool] = []

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        got_cache.append(any(isinstance(v, BlockKVCache) for v in (*args, *kwargs.values())))

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in block.modules() if isinstance(m, attn_class)]
    try:
        with torch.no_grad():
            block(torch.zeros(1, 2, config.hidden_size), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    if not any(got_cache):
        raise _fail(cls, ("block", "attention_class"),
                    f"{attn_class.__name__} occurs in the block but is not the module that receives the KV cache")


def _check_variant(cls: type, variant: str, values: dict[str, Any], result: CheckResult) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from distconf.blocks import build_block
    from distconf.blocks.kvcache import kv_geometry
    from distconf.blocks.sizing import block_size_bytes, kv_cache_bytes_per_token
    from distconf.blocks.weights import BlockWeightsError, checkpoint_files, layer_keys, load_block

    spec = cls.family_spec
    base_cls = next(k for k in cls.__mro__[1:] if k.__module__.startswith("transformers."))
    try:
        config = cls(**values)
        reference_config = base_cls(**values)
    except Exception as exc:
        raise _fail(cls, ("tiny_config",), f"cannot build the config: {exc}") from None
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(reference_config).float().eval()
    except Exception as exc:
        raise _fail(cls, ("config_class",), f"cannot build a causal LM from the tiny config: {exc}") from None
    _perturb(model)
    layers = config.num_hidden_layers
    result.layers = layers
    layer_class = cls.block_class.layer_class
    try:
        attn_class = cls.attn_class
    except FamilyValidationError as exc:
        raise _fail(cls, ("block", "attention_class"), str(exc)) from None

    with tempfile.TemporaryDirectory(prefix="distconf-check-") as tmp:
        directory = Path(tmp)
        _save_sharded(model, directory)
        files = checkpoint_files(directory)
        result.shards = len(set(files.values()))
        claimed: set[str] = set()
        for i in range(layers):
            hf_layer = _find_layer_module(model, config, i)
            if hf_layer is None:
                raise _fail(cls, ("block", "prefix"),
                            f"the model has no module at {spec.block.prefix}.{i} (nor with/without the base "
                            f"prefix {spec.block.base_model_prefix!r})")
            if not isinstance(hf_layer, layer_class):
                raise _fail(cls, ("block", "layer_class"),
                            f"the model's layer {i} is a {type(hf_layer).__name__}, not {layer_class.__name__}")
            _, names = layer_keys(files, config, i)
            overlap = claimed.intersection(names)
            if overlap:
                raise _fail(cls, ("block", "prefix"), f"tensors claimed by two layers: {sorted(overlap)[:3]}")
            claimed.update(names)
        prefix0, _ = layer_keys(files, config, 0)
        if prefix0 is not None:
            stem = prefix0[: -len("0.")]
            beyond = [n for n in files if n.startswith(stem) and n[len(stem):].split(".")[0].isdigit()
                      and int(n[len(stem):].split(".")[0]) >= layers]
            if beyond:
                raise _fail(cls, ("block", "prefix"), f"tensors beyond the last layer: {beyond[:3]}")
        blocks = []
        for i in range(layers):
            try:
                block = load_block(directory, config, i, dtype=torch.float32)
            except BlockWeightsError as exc:
                raise _fail(cls, tuple((exc.field or "block.prefix").split(".")), str(exc)) from None
            if not any(isinstance(m, attn_class) for m in block.modules()):
                found = sorted({type(m).__name__ for m in block.modules() if "atten" in type(m).__name__.lower()})
                raise _fail(cls, ("block", "attention_class"),
                            f"no {attn_class.__name__} inside block {i} (attention-like modules: "
                            f"{', '.join(found) or 'none'})")
            hf_layer = _find_layer_module(model, config, i)
            hf_params = sum(p.numel() for p in hf_layer.parameters())
            params = sum(p.numel() for p in block.parameters())
            if params != hf_params:
                raise _fail(cls, ("block", "constructor"),
                            f"block {i} has {params} parameters, the model's layer {hf_params}")
            blocks.append(block)
        result.params_per_block = sum(p.numel() for p in blocks[0].parameters())
        _check_attention_gets_cache(cls, blocks[0], attn_class, config)

        # Reference hidden states: inputs and outputs of each HF layer.
        records: dict[int, list[tuple[Any, Any]]] = {i: [] for i in range(layers)}
        hooks = []
        for i in range(layers):
            def hook(module: Any, args: Any, kwargs: Any, output: Any, i: int = i) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                out = output[0] if isinstance(output, (tuple, list)) else output
                records[i].append((hidden.detach().clone(), out.detach().clone()))
            hooks.append(_find_layer_module(model, config, i).register_forward_hook(hook, with_kwargs=True))
        generator = torch.Generator().manual_seed(2)
        input_ids = torch.randint(0, config.vocab_size, (_BATCH, _SEQ_LEN), generator=generator)
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
        for h in hooks:
            h.remove()
        ref_in = records[0][0][0]
        ref_out = [records[i][0][1] for i in range(layers)]

        with torch.no_grad():
            hidden = ref_in
            worst = 0.0
            for i, block in enumerate(blocks):
                hidden, _ = block(hidden)
                diff = _max_rel_diff(hidden, ref_out[i])
                worst = max(worst, diff)
                if diff > TOLERANCE:
                    result.full_diff = diff
                    raise _fail(cls, ("block",),
                                f"block {i} output differs from the model's layer {i} by {diff:.2e} (full sequence; "
                                f"tolerance {TOLERANCE:.0e}): check block.position, block.mask and block.call")
                hidden = ref_out[i]  # compare each layer on its own reference input
            result.full_diff = worst

            incremental, caches = _run_in_steps(blocks, ref_in, [1] * _SEQ_LEN)
            if any(c is None for c in caches):
                keyword = spec.block.call.cache_argument
                raise _fail(cls, ("block", "call", "cache_argument"),
                            f"block {caches.index(None)} kept no KV cache: the layer never wrote to the cache "
                            f"passed as {keyword}=...; its forward takes the cache under another keyword")
            # Multi-token steps after a prefix (masks sized on past + new tokens).
            chunked, _ = _run_in_steps(blocks, ref_in, list(_CHUNKS))
            # Full-sequence chain through our blocks, for a like-for-like comparison.
            chained = ref_in
            for block in blocks:
                chained, _ = block(chained)
            diff = max(_max_rel_diff(incremental, ref_out[-1]), _max_rel_diff(chunked, ref_out[-1]),
                       _max_rel_diff(chained, ref_out[-1]))
            result.incremental_diff = diff
            if diff > TOLERANCE:
                raise _fail(cls, ("block",),
                            f"token-by-token outputs with the KV cache differ from the model by {diff:.2e} "
                            f"(tolerance {TOLERANCE:.0e}): check kv_cache.layer_writes, block.position and block.mask")

        # Cache geometry: what the blocks really hold against the family's KV section.
        geometry = kv_geometry(config)
        declared = kv_cache_bytes_per_token(config, torch.float32)
        result.kv_declared = declared
        held = [(k.numel() + v.numel()) * k.element_size() // (_BATCH * _SEQ_LEN) for k, v in caches]
        worst = max(range(layers), key=lambda i: abs(held[i] - declared))
        key, value = caches[worst]
        actual = held[worst]
        result.kv_actual = actual
        if actual != declared:
            if key.shape[1] != geometry.num_kv_heads:
                loc = _kv_field(cls, spec, "num_kv_heads")
                if (key.shape[1] == config.num_attention_heads and geometry.num_kv_heads < key.shape[1]
                        and spec.kv_cache.layer_writes == "kv_heads"):
                    hint = (" (the layer writes every KV head once per query head: set kv_cache.layer_writes: "
                            "repeat_interleave)")
                elif spec.kv_cache.num_kv_heads is None and key.shape[1] < geometry.num_kv_heads:
                    hint = (" (if the attention caches a compressed or latent representation, declare "
                            "kv_cache.num_kv_heads, kv_cache.key_head_dim and kv_cache.value_head_dim)")
                else:
                    hint = ""
                raise _fail(cls, loc, f"blocks cache {key.shape[1]} KV heads but the family declares "
                                      f"{geometry.num_kv_heads}{hint}")
            if key.shape[-1] != geometry.key_head_dim:
                raise _fail(cls, ("kv_cache", "key_head_dim"),
                            f"blocks cache keys of {key.shape[-1]} values per head, declared {geometry.key_head_dim}")
            if value.shape[-1] != geometry.value_head_dim:
                raise _fail(cls, ("kv_cache", "value_head_dim"), f"blocks cache values of {value.shape[-1]} "
                            f"values per head, declared {geometry.value_head_dim}")
            raise _fail(cls, ("kv_cache", "values_per_token"),
                        f"blocks cache {actual} bytes per token, the family declares {declared}")

        for i, block in enumerate(blocks):
            declared_size = block_size_bytes(config, torch.float32, layer_idx=i)
            actual_size = int(sum(p.numel() * p.element_size() for p in block.parameters()) * 1.01)
            if declared_size != actual_size:
                raise _fail(cls, ("block", "constructor"),
                            f"block_size_bytes gives {declared_size} for block {i}, the loaded block takes "
                            f"{actual_size}")
        result.size_declared = block_size_bytes(config, torch.float32)
        result.size_actual = max(int(sum(p.numel() * p.element_size() for p in b.parameters()) * 1.01)
                                 for b in blocks)
        meta = build_block(config, 0, device="meta")
        if any(not p.is_meta for p in meta.parameters()):
            raise _fail(cls, ("block", "layer_class"), "building on the meta device allocated real tensors")


def check_family(name_or_path: str | Path) -> list[CheckResult]:
    """Check every tiny-config variant of a family; failures are recorded, not raised."""
    import time

    from distconf.family import load_family

    try:
        cls = load_family(name_or_path)
    except FamilyValidationError as exc:
        result = CheckResult(str(name_or_path), "-")
        first = exc.problems[0] if exc.problems else None
        result.failure = CheckFailure(first.field if first else "<file>", str(exc))
        return [result]
    spec = cls.family_spec
    if not spec.tiny_config:
        result = CheckResult(spec.family, "-")
        result.failure = _fail(cls, ("tiny_config",), "no tiny_config: add a few-layer, small-dimension config")
        return [result]
    results = []
    for variant, values in tiny_variants(spec.tiny_config):
        result = CheckResult(spec.family, variant)
        start = time.perf_counter()
        try:
            _check_variant(cls, variant, values, result)
        except CheckFailure as exc:
            result.failure = exc
        except FamilyValidationError as exc:
            first = exc.problems[0] if exc.problems else None
            result.failure = CheckFailure(first.field if first else "<file>", str(exc))
        except Exception as exc:
            logger.debug("check of %s crashed", spec.family, exc_info=True)
            result.failure = _crash_failure(cls, spec, exc)
        result.seconds = time.perf_counter() - start
        results.append(result)
    return results
