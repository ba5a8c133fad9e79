"""Helpers shared by the block, weight, sizing and check tests: real tiny HF models."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from distconf.blocks.weights import layer_prefixes
from distconf.loader import load_family
from distconf.tools.checker import tiny_variants

SEED_CASES = [
    ("bloom", 0), ("llama", 0),
    ("mixtral", 0),
    ("mixtral", 1),  # sliding window 4
    ("falcon", 0),  # new_decoder_architecture, 8 query heads share 2 KV heads
    ("falcon", 1),  # multi_query
    ("falcon", 2),  # alibi (falcon-rw style)
]


def family_config(family: str, variant: int = 0, **overrides: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(distributed config, plain HF config, values) of a family's tiny config variant."""
    cls = load_family(family)
    _, values = tiny_variants(cls.family_spec.tiny_config)[variant]
    values = {**values, **overrides}
    return cls(**values), cls.hf_config_class(**values), values


def hf_model(hf_config: Any, seed: int = 0) -> Any:
    """A float32 causal LM with random, non-trivial weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def hf_layer(model: Any, config: Any, layer_idx: int) -> Any:
    """The model's decoder layer ``layer_idx`` (found through the family prefix)."""
    modules = dict(model.named_modules())
    for prefix in layer_prefixes(config, layer_idx):
        if prefix.rstrip(".") in modules:
            return modules[prefix.rstrip(".")]
    raise LookupError(layer_idx)


def record_layers(model: Any, config: Any, input_ids: torch.Tensor, **kwargs: Any) -> list[tuple[Any, Any]]:
    """Run the model; return (input, output) hidden states of every layer."""
    records: list[tuple[Any, Any]] = []
    hooks = []
    for i in range(config.num_hidden_layers):
        def hook(module: Any, args: Any, kw: Any, output: Any) -> None:
            hidden = args[0] if args else kw["hidden_states"]
            out = output[0] if isinstance(output, (tuple, list)) else output
            records.append((hidden.detach().clone(), out.detach().clone()))
        hooks.append(hf_layer(model, config, i).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return records


def save_checkpoint(model: Any, directory: Path, *, shards: int = 4) -> Path:
    """Save as safetensors: one file (shards=1) or about ``shards`` files with an index."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    size = total * 4 if shards == 1 else max(total // shards, 4096)
    model.save_pretrained(directory, max_shard_size=size)
    return directory


def write_family(tmp_path: Path, source: str, name: str, edit: Any) -> Path:
    """Copy a built-in family file under a new family name, with ``edit(text) -> text`` applied."""
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "families" / f"{source}.yaml").read_text(encoding="utf-8")
    text = text.replace(f"family: {source}\n", f"family: {name}\n", 1)
    text = edit(text)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@functools.cache
def falcon_caches_expanded_heads() -> bool:
    """Whether the installed transformers' Falcon (``new_decoder_architecture``, 8 query heads on 2 KV heads) caches
    every KV head once per query head (transformers <= 5.24) rather than its 2 KV heads (5.25 on): probed, not
    read from a version number. Its family file's ``kv_cache.layer_writes: repeat_interleave`` is right for both."""
    from transformers import DynamicCache

    _, hf_config, _ = family_config("falcon", 0)
    model = hf_model(hf_config)
    cache = DynamicCache(config=hf_config)
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long), past_key_values=cache, use_cache=True)
    return int(cache.layers[0].keys.shape[1]) == hf_config.num_attention_heads
