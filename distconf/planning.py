"""Capacity planning: how many blocks a server can hold, and which ones it should take.

`plan_server` follows Petals 2.x's server rule with one fix: the attention cache is
sized with the block's real KV geometry (``sizing.kv_cache_bytes_per_token``:
``num_kv_heads * (key_head_dim + value_head_dim)`` values per token per block) instead
of Petals' ``2 * hidden_size / num_key_value_groups``. The plan also carries what Petals'
formula would reserve, for a side-by-side (where Petals hard-codes ``groups = 1`` for a
grouped-query family, it over-reserves by the real group count, e.g. 4x for 32 query
heads sharing 8 KV heads).

`choose_blocks` is Petals' placement rule: a new server of ``n`` blocks starts at
the window whose sorted per-block throughputs are lexicographically smallest, i.e. it
fills the weakest part of the chain.

torch is imported only when a dtype must be resolved from a string or sizes must be
computed from a block; importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from distconf.blocks import sizing
from distconf.blocks.device import canonical_dtype
from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
from distconf.blocks.sizing import QUANT_BYTES
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import config_num_blocks
from distconf.loader.wire_layout import wire_width_of

__all__ = [
    "GIB",
    "ServerPlan",
    "autograd_reserve_bytes",
    "batch_activation_bytes",
    "choose_blocks",
    "default_attn_cache_tokens",
    "default_max_length",
    "dtype_bytes",
    "petals_kv_groups",
    "parse_memory",
    "plan_server",
    "resolve_dtype",
]

GIB = 1024**3

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def resolve_dtype(dtype: Any) -> str:
    """Canonical dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``) of a torch dtype or alias."""
    return canonical_dtype(dtype)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per value of a dtype (torch dtype or alias)."""
    return _DTYPE_BYTES[resolve_dtype(dtype)]


def _torch_dtype(dtype: Any) -> Any:
    import torch

    return getattr(torch, resolve_dtype(dtype))


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str | int) -> int:
    """Parse ``"24GiB"``, ``"80 GB"``, ``"512MiB"`` or a byte count into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        s = str(text).strip().lower().replace(" ", "").replace("_", "")
        digits = len(s) - len(s.lstrip("0123456789."))
        value_text, unit = s[:digits], s[digits:]
        try:
            value = float(value_text)
        except ValueError:
            raise ValueError(f"cannot parse memory size {text!r} (use e.g. 24GiB, 80GB, 512MiB)") from None
    if unit not in _UNITS:
        raise ValueError(f"unknown memory unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    result = value * _UNITS[unit]
    if not math.isfinite(result) or result <= 0:
        raise ValueError(f"memory size must be > 0, got {text!r}")
    return int(result)


def _groups(config: DistributedConfig) -> int:
    groups = getattr(config, "num_key_value_groups", 1)
    return int(groups) if groups else 1


def default_attn_cache_tokens(config: DistributedConfig) -> int:
    """16384 tokens for grouped/multi-query models (groups > 1), else 4096 (as Petals 2.x)."""
    return 16384 if _groups(config) > 1 else 4096


def default_max_length(config: DistributedConfig) -> int:
    """Default ``max_batch_size`` and ``inference_max_length``: 8192 (groups > 1) or 2048."""
    return 8192 if _groups(config) > 1 else 2048


def autograd_reserve_bytes(config: DistributedConfig, num_devices: int = 1) -> float:
    """Memory kept free for backward passes: 2 GiB x wire width / 14336 per device (the wire width is the
    hidden_size of a model whose layers exchange one stream, `distconf.loader.wire_layout.wire_width_of`)."""
    return 2 * GIB * num_devices * wire_width_of(config) / 14336


def batch_activation_bytes(config: DistributedConfig, rows: int, new_tokens: int, past: int, dtype: Any,
                           kv_bytes_per_token: int) -> int:
    """Peak working memory of one block call on ``rows x new_tokens`` tokens after ``past`` cached ones.

    The attention scores (``rows x heads x new x (past + new)``, float32), the MLP's
    activations (``4 x wire width + 3 x intermediate`` values per token, the widest layer's intermediate size when it
    differs per layer; the hidden states between blocks are
    ``wire_width_of(config)`` wide) and the block's padded
    cache for the call (``rows x (past + new)`` tokens). A server keeps a batch of several
    sessions within the memory the plan reserves (`autograd_reserve_bytes`).
    """
    hidden = int(config.hidden_size)
    wire = wire_width_of(config)
    sizes = getattr(config, "intermediate_size", None) or 4 * hidden
    intermediate = max(int(v) for v in sizes) if isinstance(sizes, (list, tuple)) else int(sizes)  # per layer: widest
    heads = int(getattr(config, "num_attention_heads", 0) or 0)  # 0: a recurrent block computes no scores
    tokens = rows * new_tokens
    scores = rows * heads * new_tokens * (past + new_tokens) * 4
    mlp = tokens * (4 * wire + 3 * intermediate) * dtype_bytes(dtype)
    return scores + mlp + rows * (past + new_tokens) * kv_bytes_per_token


def petals_kv_groups(config: DistributedConfig) -> int:
    """The ``num_key_value_groups`` Petals 2.x uses for this config.

    The family file's ``petals_kv_groups`` when it declares one; otherwise Petals uses
    the same groups as distconf.
    """
    spec = getattr(type(config), "family_spec", None)
    declared = getattr(spec, "petals_kv_groups", None)
    return int(declared) if declared else _groups(config)


@dataclass(frozen=True)
class ServerPlan:
    """A server's capacity plan. All sizes in bytes; "cache" is the attention (KV) cache.

    ``num_blocks`` is 0 when not even one block fits. ``petals_*`` fields are what Petals
    2.x's ``2 * hidden_size / num_key_value_groups`` cache formula gives with the same
    memory, dtype and cache tokens; ``petals_default_*`` the same with Petals' own default
    token count (which follows its own, possibly wrong, groups).
    """

    memory_bytes: int
    dtype: str
    quant: str | None
    num_blocks: int
    max_blocks: int
    block_bytes: int
    attn_cache_tokens: int
    kv_bytes_per_token: int
    cache_bytes_per_block: int
    autograd_reserve_bytes: int
    max_length: int
    petals_kv_groups: int
    petals_kv_bytes_per_token: int
    petals_cache_bytes_per_block: int
    petals_num_blocks: int
    petals_default_attn_cache_tokens: int
    petals_default_cache_bytes_per_block: int
    petals_default_num_blocks: int
    state_bytes_per_sequence: int = 0
    """Bytes of per-sequence state a state-keeping block keeps (0 when no block keeps a state)."""
    state_sequences: int = 0
    """Sequences whose state the cache holds per block: the memory of attn_cache_tokens of K/V, at least 1."""
    kv_blocks: int = 0
    """Blocks of the model that keep K/V (all of them for an attention-only family)."""
    state_blocks: int = 0
    """Blocks of the model that keep a per-sequence state (a hybrid: some; a state-space family: all)."""
    adapter_bytes_per_block: int = 0
    """Bytes of LoRA adapters beside each block, included in ``block_bytes``."""

    @property
    def total_block_bytes(self) -> int:
        """Weights of all planned blocks."""
        return self.block_bytes * self.num_blocks

    @property
    def total_cache_bytes(self) -> int:
        """Attention cache reserved for all planned blocks."""
        return self.cache_bytes_per_block * self.num_blocks

    @property
    def used_bytes(self) -> int:
        """Weights + cache + autograd reserve."""
        return self.total_block_bytes + self.total_cache_bytes + self.autograd_reserve_bytes

    @property
    def cache_tokens(self) -> int:
        """Tokens of attention cache the server holds (for every one of its blocks)."""
        return self.attn_cache_tokens if self.num_blocks else 0

    @property
    def petals_over_reservation(self) -> float:
        """Original cache reservation / correct one (4.0 where groups 4 were taken as 1)."""
        return self.petals_cache_bytes_per_block / self.cache_bytes_per_block if self.cache_bytes_per_block else 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for JSON output), including derived totals."""
        out = asdict(self)
        out.update(total_block_bytes=self.total_block_bytes, total_cache_bytes=self.total_cache_bytes,
                   used_bytes=self.used_bytes, cache_tokens=self.cache_tokens,
                   petals_over_reservation=self.petals_over_reservation)
        return out


def plan_server(
    config: DistributedConfig,
    memory_bytes: int | str,
    dtype: Any = "bfloat16",
    quant: str | None = None,
    attn_cache_tokens: int | None = None,
    *,
    num_devices: int = 1,
    device_type: str = "cpu",
    block_bytes: int | None = None,
    kv_bytes_per_token: int | None = None,
    adapter_bytes_per_block: int = 0,
) -> ServerPlan:
    """How many blocks of ``config``'s model fit in ``memory_bytes``.

    ``blocks = floor((memory - autograd reserve) / (block size + cache per block))``,
    capped at the layer count, where a block's cache = its KV bytes per token (correct
    geometry, in ``dtype``) x ``attn_cache_tokens`` plus, if it keeps a per-sequence state, its
    bytes x ``state_sequences`` (the memory of ``attn_cache_tokens`` of K/V at this hidden size,
    at least one sequence). Blocks differ in a hybrid family (K/V-keeping and state-keeping
    layers) and the span is not known yet, so cache per block is the largest block's cache.

    :param config: a distributed config (needs ``hidden_size``, ``num_hidden_layers``,
        ``num_key_value_groups`` and whatever the block sizing needs).
    :param memory_bytes: memory available to the server, bytes or a string like ``"24GiB"``.
    :param dtype: compute/cache dtype (torch dtype or ``bf16``/``fp16``/``fp32``).
    :param quant: ``None``, ``"int8"`` or ``"nf4"`` (weights only; the cache stays in ``dtype``).
    :param attn_cache_tokens: default 16384 if ``num_key_value_groups > 1`` else 4096.
    :param num_devices: devices sharing the blocks (tensor parallel); scales the reserve.
    :param device_type: where the blocks live (``"cpu"``, ``"cuda"``): nf4's layout differs per device.
    :param block_bytes: bytes of one block; default ``sizing.block_size_bytes(config, dtype, quant)``.
    :param kv_bytes_per_token: KV bytes per token per block; default
        ``sizing.kv_cache_bytes_per_token(config, dtype)``.
    :param adapter_bytes_per_block: bytes of the LoRA adapters served beside each block (``--adapters``,
        `distconf.blocks.lora.lora_bytes_per_block`): counted with the block's weights.
    """
    memory = parse_memory(memory_bytes)
    dtype_name = resolve_dtype(dtype)
    quant = None if quant in (None, "none") else quant
    if quant is not None and quant not in QUANT_BYTES:
        raise ValueError(f"unsupported quant {quant!r}: use none, int8 or nf4")
    if attn_cache_tokens is None:
        attn_cache_tokens = default_attn_cache_tokens(config)
    if isinstance(attn_cache_tokens, bool) or not isinstance(attn_cache_tokens, int) or attn_cache_tokens < 0:
        raise ValueError(f"attn_cache_tokens must be an integer >= 0, got {attn_cache_tokens!r}")
    if block_bytes is None or kv_bytes_per_token is None:
        if block_bytes is None:
            block_bytes = int(sizing.block_size_bytes(config, dtype=_torch_dtype(dtype_name), quant=quant,
                                                          device_type=device_type))
        if kv_bytes_per_token is None:
            kv_bytes_per_token = int(sizing.kv_cache_bytes_per_token(config, _torch_dtype(dtype_name)))
    state_bytes = sizing.state_bytes_per_sequence(config, _torch_dtype(dtype_name))
    # a state is kept per sequence: it gets the memory a K/V cache of attn_cache_tokens would take at this hidden
    # size (counting sequences of the default max length would leave a server room for one or two sessions)
    kv_equivalent = 2 * int(config.hidden_size) * _torch_dtype(dtype_name).itemsize * attn_cache_tokens
    state_sequences = max(1, kv_equivalent // state_bytes) if state_bytes else 0
    layers = config_num_blocks(config)
    kinds = _layer_kinds(config, layers)
    kv_kinds = [kv for kv, _ in kinds]
    state_kinds = [st for _, st in kinds]
    cache_per_block = max(kv_bytes_per_token * attn_cache_tokens * kv + state_bytes * state_sequences * st
                          for kv, st in kinds)
    reserve = autograd_reserve_bytes(config, num_devices)
    block_bytes = int(block_bytes) + int(adapter_bytes_per_block)

    def fit(per_block: int) -> int:
        n = math.floor((memory - reserve) / (block_bytes + per_block))
        return max(0, min(n, layers))

    petals_groups = petals_kv_groups(config)
    petals_values = 2 * config.hidden_size * attn_cache_tokens // petals_groups  # Petals' integer arithmetic
    petals_cache_per_block = petals_values * _DTYPE_BYTES[dtype_name]
    petals_default_tokens = 16384 if petals_groups > 1 else 4096
    petals_default_cache = 2 * config.hidden_size * petals_default_tokens // petals_groups * _DTYPE_BYTES[dtype_name]
    return ServerPlan(
        memory_bytes=memory,
        dtype=dtype_name,
        quant=quant,
        num_blocks=fit(cache_per_block),
        max_blocks=layers,
        block_bytes=int(block_bytes),
        attn_cache_tokens=attn_cache_tokens,
        kv_bytes_per_token=int(kv_bytes_per_token),
        cache_bytes_per_block=int(cache_per_block),
        autograd_reserve_bytes=math.ceil(reserve),
        max_length=default_max_length(config),
        petals_kv_groups=petals_groups,
        petals_kv_bytes_per_token=2 * config.hidden_size // petals_groups * _DTYPE_BYTES[dtype_name],
        petals_cache_bytes_per_block=petals_cache_per_block,
        petals_num_blocks=fit(petals_cache_per_block),
        petals_default_attn_cache_tokens=petals_default_tokens,
        petals_default_cache_bytes_per_block=petals_default_cache,
        petals_default_num_blocks=fit(petals_default_cache),
        state_bytes_per_sequence=state_bytes,
        state_sequences=state_sequences,
        adapter_bytes_per_block=int(adapter_bytes_per_block),
        kv_blocks=sum(kv_kinds),
        state_blocks=sum(state_kinds),
    )


def _layer_kinds(config: DistributedConfig, layers: int) -> list[tuple[bool, bool]]:
    """(keeps K/V, keeps a state) per layer; a config without a family spec (explicit sizes) keeps K/V only."""
    if getattr(type(config), "family_spec", None) is None:
        return [(True, False)] * max(layers, 1)
    model = [model_layer(config, i) for i in range(layers)]  # a looped layer stack's blocks run its layers
    return [(keeps_kv_at(config, m), keeps_state_at(config, m)) for m in model] or [(True, False)]


def choose_blocks(config: DistributedConfig, n: int, swarm_state: Any = None) -> tuple[int, int]:
    """Where a new server of ``n`` blocks should sit: ``(start, end)``, end exclusive.

    Per-block throughput is the sum of the throughputs of the non-offline servers
    covering the block; the chosen window is the one whose sorted throughputs are
    lexicographically smallest (ties: the lowest start), so the server fills the weakest
    part of the chain.

    :param config: the model's config (``num_hidden_layers``).
    :param n: blocks the server will hold (capped at the layer count).
    :param swarm_state: a `distconf.dht.discovery.SwarmState`, a sequence of per-block
        throughputs, or ``None`` for an empty swarm.
    """
    layers = config_num_blocks(config)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a server must take at least one block, got n={n!r}")
    n = min(n, layers)
    if swarm_state is None:
        throughputs: Sequence[float] = [0.0] * layers
    elif hasattr(swarm_state, "throughputs"):
        throughputs = swarm_state.throughputs()
    else:
        throughputs = [float(t) for t in swarm_state]
    if len(throughputs) != layers:
        raise ValueError(f"swarm state has {len(throughputs)} blocks, the model has {layers}")
    best = min((sorted(throughputs[i : i + n]), i) for i in range(layers - n + 1))
    return best[1], best[1] + n
