"""`HandlerSettings`: the limits and identity a server's handler and its sessions work with."""

from __future__ import annotations

import torch

__all__ = ["MIN_FORWARD_TOKENS", "HandlerSettings", "default_forward_tokens"]

MIN_FORWARD_TOKENS = 128
"""The smallest default cap on a forward/backward request: the size of the forward a server measures at start."""


def default_forward_tokens(petals_max: int, forward_rps: float, request_timeout: float, num_blocks: int) -> int:
    """Tokens (batch x length) one forward/backward may carry by default: Petals' ``max_batch_size``
    (``petals_max``), or fewer if the server, at its measured ``forward_rps`` (tokens/s per block), would
    need more than half of ``request_timeout`` to compute them through its ``num_blocks`` blocks."""
    if forward_rps <= 0:
        return petals_max
    fits = int(forward_rps * request_timeout / (2 * max(1, num_blocks)))
    return max(MIN_FORWARD_TOKENS, min(petals_max, fits))


class HandlerSettings:
    """Limits and identity of a server's handler (timeouts in seconds)."""

    def __init__(self, *, dht_prefix: str, hidden_size: int, dtype: torch.dtype, inference_max_length: int,
                 request_timeout: float = 180.0, session_timeout: float = 1800.0, step_timeout: float = 300.0,
                 max_request_bytes: int = 2**30, version: str = "distconf", dht_client_mode: bool = False,
                 weights_sha256: str | None = None, block_sha256: list[str] | None = None,
                 weights_form: str | None = None, max_forward_tokens: int | None = None,
                 max_peer_cache_share: float = 1.0, compression: int = 0, adapters: tuple[str, ...] = (),
                 adapter_sha256: dict[str, list[str]] | None = None) -> None:
        """``hidden_size``: values per token of the hidden states between blocks (``config.wire_width``, the
        model's hidden size unless its layers hand each other several streams); ``max_forward_tokens``: batch x
        length of one forward/backward request (None: ``inference_max_length``, as Petals' ``max_batch_size``);
        ``max_peer_cache_share``: the fraction of the cache budget the sessions of one peer may hold together (1: no
        limit); ``compression``: the hivemind compression of the hidden states this server sends and announces for
        what it receives (Petals' ``--compression``; 0 is NONE); ``adapters``: the names of the LoRA adapters served
        beside the blocks (`distconf.blocks.lora`), which requests may ask for, and ``adapter_sha256`` their digests
        per served block (announced in ``rpc_info``)."""
        if not 0 < max_peer_cache_share <= 1:
            raise ValueError(f"max_peer_cache_share must be in (0, 1], got {max_peer_cache_share}")
        self.dht_prefix, self.hidden_size, self.dtype = dht_prefix, hidden_size, dtype
        self.inference_max_length = inference_max_length
        self.request_timeout, self.session_timeout, self.step_timeout = request_timeout, session_timeout, step_timeout
        self.max_request_bytes = max_request_bytes
        self.version, self.dht_client_mode = version, dht_client_mode
        self.weights_sha256 = weights_sha256  # the served weights' digest at load (``--verify-weights``)
        self.block_sha256 = block_sha256  # per served block, first block first (``integrity.block_digests``)
        self.weights_form = weights_form  # dtype (+ quantization) the digests are for (``integrity.weights_form``)
        self.max_forward_tokens = max_forward_tokens or inference_max_length
        self.max_peer_cache_share = float(max_peer_cache_share)
        self.compression = int(compression)
        self.adapters = tuple(adapters)
        self.adapter_sha256 = adapter_sha256 or {}
