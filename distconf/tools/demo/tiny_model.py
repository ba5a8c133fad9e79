"""The demo's tiny model: which family, its DHT prefix, its checkpoint and a server memory budget."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from distconf.loader.config_protocol import DistributedConfig

__all__ = ["DEMO_LAYERS", "DEMO_DTYPE", "DEMO_SEED", "blocks_per_server", "demo_family", "demo_prefix",
           "make_tiny_checkpoint", "memory_for"]

DEMO_LAYERS = 8
"""Blocks of the demo model (the family's tiny config, with this many layers)."""
DEMO_DTYPE = "float32"
"""Dtype the servers plan for, load and run in (and the client computes in)."""
DEMO_SEED = 2
"""Seed of the random weights (one whose greedy continuation of the demo prompt does not repeat at once)."""


def demo_family(family: str | None = None) -> str:
    """The family the demo serves: ``family``, else the first built-in one with a ``tiny_config``."""
    from distconf.loader import list_families, load_family

    if family is not None:
        return family
    for name in list_families():
        if load_family(name).family_spec.tiny_config:
            return name
    raise LookupError("no family file has a tiny_config to build a demo model from")


def demo_prefix(family: str) -> str:
    """DHT prefix of the demo model of ``family`` (no '.', no space)."""
    return f"distconf-demo-tiny-{family}".replace("_", "-")


def blocks_per_server(num_servers: int, layers: int = DEMO_LAYERS) -> int:
    """Blocks each server is sized for: all but one server cover the model, the last is a spare.

    With 3 servers and 8 blocks: 4 each, so the first two cover blocks 0..7 and the
    placement rule puts the third on the weaker half, where it can replace a server that
    leaves. One server takes every block.
    """
    return layers if num_servers <= 2 else math.ceil(layers / (num_servers - 1))


WEIGHT_NOISE = 0.1
"""Standard deviation of the noise added to every initialized weight."""


def make_tiny_checkpoint(model_dir: str | Path, family: str, *, seed: int = DEMO_SEED) -> Any:
    """Write a tiny random model of ``family`` (safetensors) to ``model_dir``; return its config.

    The model is the family file's ``tiny_config`` (first variant) with `DEMO_LAYERS`
    layers, built from the family's HF config class, with an output layer of its own
    (untied from the input embeddings: a random tied model's greedy output repeats one
    token). Every weight gets `WEIGHT_NOISE` of extra random noise: at initialization
    scale the blocks are nearly the identity and the next-token distributions nearly
    uniform, which is nothing like a trained model (and leaves prompt tuning nothing to
    move). The saved ``config.json`` is the distributed config's, so it carries ``dht_prefix``.
    """
    import torch
    from transformers.utils import logging as hf_logging

    from distconf.blocks.hf_compat import causal_lm_from_config
    from distconf.loader import load_family
    from distconf.tools.checker import tiny_variants

    cls = load_family(family)
    _, values = tiny_variants(dict(cls.family_spec.tiny_config))[0]
    reference = cls.hf_config_class(**values)
    reference.num_hidden_layers = DEMO_LAYERS
    reference.tie_word_embeddings = False
    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    model = causal_lm_from_config(reference)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape) * WEIGHT_NOISE)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(model_dir, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    config = cls.from_pretrained(str(model_dir), dht_prefix=demo_prefix(family))
    config.save_pretrained(model_dir)
    return config


def memory_for(config: DistributedConfig, num_blocks: int, dtype: str) -> int:
    """A memory budget for which `plan_server` gives exactly ``num_blocks`` blocks."""
    from distconf.planning import plan_server

    probe = plan_server(config, 2**40, dtype)
    per_block = probe.block_bytes + probe.cache_bytes_per_block
    return int(probe.autograd_reserve_bytes + (num_blocks + 0.5) * per_block)
