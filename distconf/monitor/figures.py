"""Per-model cache figures for the swarm page: K/V bytes per token and state bytes per sequence.

The monitor reads only DHT records, which carry no model config. When a model's listing names
a repository that is a shipped preset, the figures come from its config (the listing is text
any peer writes: the monitor never reads a local path or the hub it names) with `distconf.blocks.sizing`, in bfloat16:
what a K/V-keeping block keeps per token and what a state-keeping block keeps per sequence
(a hybrid family has both kinds of blocks; the counts say how many of each). Otherwise the
figures stay unknown (null).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from distconf.blocks import sizing
from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import config_num_blocks

__all__ = ["CacheFigures", "cache_figures", "figures_of_repository"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheFigures:
    """What one block of a model keeps per session, in bfloat16 (0: no block keeps that kind)."""

    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    kv_blocks: int
    state_blocks: int


def cache_figures(config: object) -> CacheFigures:
    """The figures of a distributed config (family-level sizes, per-layer counts)."""
    import torch

    layers = [model_layer(config, i) for i in range(config_num_blocks(config))]  # the layer each block runs
    return CacheFigures(
        kv_bytes_per_token=sizing.kv_cache_bytes_per_token(config, torch.bfloat16),  # type: ignore[arg-type]
        state_bytes_per_sequence=sizing.state_bytes_per_sequence(config, torch.bfloat16),  # type: ignore[arg-type]
        kv_blocks=sum(keeps_kv_at(config, i) for i in layers),  # type: ignore[arg-type]
        state_blocks=sum(keeps_state_at(config, i) for i in layers),  # type: ignore[arg-type]
    )


@functools.lru_cache(maxsize=256)
def figures_of_repository(repository: str | None) -> CacheFigures | None:
    """The figures of a listed repository that names a shipped preset, else None."""
    from distconf.loader.auto import load_preset

    if not repository:
        return None
    try:
        return cache_figures(load_preset(repository))
    except Exception as exc:  # an unknown repository leaves the figures unknown
        logger.debug("no cache figures for %r: %s", repository, exc)
        return None
