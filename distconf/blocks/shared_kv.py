"""K/V later layers reuse from an earlier one (``kv_cache.shared``), as the wire carries it and a block hands it on.

The wire holds, after the hidden state and its carried values, each stored type's keys then values of the step's
new tokens (`distconf.loader.kv_sharing.shared_kv_slots`: ``[batch, seq, heads * key_dim]`` then ``[batch, seq,
heads * value_dim]``), zeros until a layer stores it (`distconf.loader.wire_layout.WireLayout.split_shared`). A
storing layer's block reads what its layer put in the container (`stored_part`); a reusing
layer's block appends the part to its own K/V cache and fills the container with the whole (`reuse_into`), so the
reused K/V is cached, reordered, rewound and replayed like any block's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["stored_part", "reuse_into", "kv_of_part"]


def kv_of_part(part: torch.Tensor, heads: int, key_dim: int, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A wire part ``[batch, seq, heads * (key_dim + value_dim)]`` as keys and values ``[batch, heads, seq, dim]``."""
    if part.shape[-1] != heads * (key_dim + value_dim):
        raise ValueError(f"shared K/V of {part.shape[-1]} values per token does not hold {heads} heads of "
                         f"{key_dim} key and {value_dim} value values (kv_cache.shared.values_per_token)")
    keys, values = part.split([heads * key_dim, heads * value_dim], dim=-1)
    return (keys.unflatten(-1, (heads, key_dim)).transpose(1, 2).contiguous(),
            values.unflatten(-1, (heads, value_dim)).transpose(1, 2).contiguous())


def stored_part(container: Any, key: str, seq: int, width: int) -> torch.Tensor:
    """The last ``seq`` tokens' keys and values a storing layer put in ``container`` under ``key``, as the wire
    holds them (``width`` values per token)."""
    import torch

    stored = container.get(key) if container is not None else None
    if stored is None or len(stored) < 2:
        raise ValueError(f"the storing layer put no keys and values under {key!r} in the shared container")
    keys, values = stored[0][..., -seq:, :], stored[1][..., -seq:, :]
    part = torch.cat([keys.transpose(1, 2).flatten(2), values.transpose(1, 2).flatten(2)], dim=-1)
    if part.shape[-1] != width:
        raise ValueError(f"the storing layer's keys {list(keys.shape)} and values {list(values.shape)} are "
                         f"{part.shape[-1]} values per token, not {width} (kv_cache.shared.values_per_token)")
    return part


def reuse_into(container: Any, key: str, part: torch.Tensor, cache: Any, geometry: Any) -> None:
    """Fill ``container[key]`` for a reusing layer: the step's stored keys and values (``part``), appended to the
    block's own K/V ``cache`` (None: this step's alone)."""
    keys, values = kv_of_part(part, geometry.num_kv_heads, geometry.key_head_dim, geometry.value_head_dim)
    if cache is not None:
        keys, values = cache.update(keys, values, 0)
    container[key] = (keys, values)
