"""Human-readable summaries of a family and of a loaded config (used by ``distconf show``)."""

from __future__ import annotations

from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import config_num_blocks

__all__ = ["describe_class", "describe_config", "size_summary"]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_class(cls: type) -> list[tuple[str, str]]:
    """(label, value) pairs describing a synthesized config class."""
    spec = cls.family_spec  # type: ignore[attr-defined]
    return [
        ("family", spec.family),
        ("file", str(cls.family_source.path)),  # type: ignore[attr-defined]
        ("class", _qualname(cls)),
        ("bases", ", ".join(_qualname(b) for b in cls.__bases__)),
        ("model_type", spec.model_type),
        ("block class", _qualname(cls.block_class)),  # type: ignore[attr-defined]
        ("layer class", spec.block.layer_class),
        ("attention class", _qualname(cls.attn_class)),  # type: ignore[attr-defined]
        ("block prefix", f"{spec.block.prefix}.<i>."),
        ("kv groups", str(spec.kv_groups)),
    ]


def size_summary(config: DistributedConfig) -> list[tuple[str, str]]:
    """Block sizes (bf16, int8, nf4) and KV bytes per token (bf16) of a loaded config."""
    import torch

    from distconf.blocks.sizing import block_size_bytes, kv_cache_bytes_per_token

    rows = []
    for label, quant in (("bf16", None), ("int8", "int8"), ("nf4", "nf4")):
        size = block_size_bytes(config, dtype=torch.bfloat16, quant=quant)
        rows.append((f"block size ({label})", f"{size / 2**20:,.1f} MiB"))
    kv = kv_cache_bytes_per_token(config, torch.bfloat16)
    rows.append(("KV bytes/token/block (bf16)", f"{kv:,}"))
    return rows


def describe_config(config: DistributedConfig) -> list[tuple[str, str]]:
    """(label, value) pairs for a loaded config: KV groups, DHT prefix, block uids, sizes."""
    n = config_num_blocks(config)
    rows = [
        ("model", str(getattr(config, "name_or_path", "") or "-")),
        ("kv groups (value)", str(config.num_key_value_groups)),
        ("blocks", str(n)),
        ("dht prefix", str(config.dht_prefix)),
    ]
    if config.dht_prefix is not None and n:
        uids = config.block_uids()
        rows.append(("block uids", f"{uids[0]} ... {uids[-1]}" if n > 1 else uids[0]))
    return rows + size_summary(config)
