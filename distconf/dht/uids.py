"""Block uids of a config, tolerant of configs that do not (yet) have ``block_uids``."""

from __future__ import annotations

from typing import Any

from distconf.dht.records import block_uid

__all__ = ["config_block_uids", "config_dht_prefix", "config_num_blocks"]


def config_dht_prefix(config: Any) -> str:
    """The config's ``dht_prefix``; `ValueError` if it has none (nothing to announce or find)."""
    prefix = getattr(config, "dht_prefix", None)
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(
            f"{type(config).__name__} has no dht_prefix: load it by hub name (which derives one) "
            "or pass dht_prefix=... explicitly"
        )
    return prefix


def config_num_blocks(config: Any) -> int:
    """Number of transformer blocks (``num_hidden_layers``, or ``n_layer`` for old configs)."""
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        n = getattr(config, "n_layer", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{type(config).__name__} has no valid num_hidden_layers (got {n!r})")
    return n


def config_block_uids(config: Any, start: int = 0, end: int | None = None) -> list[str]:
    """Uids of blocks ``start..end-1``: the config's own ``block_uids`` when it has one."""
    method = getattr(config, "block_uids", None)
    if callable(method):
        return list(method(start=start, end=end))
    prefix = config_dht_prefix(config)
    end = config_num_blocks(config) if end is None else end
    return [block_uid(prefix, i) for i in range(start, end)]
