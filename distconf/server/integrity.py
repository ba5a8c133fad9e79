"""A digest of the weights a server serves, to show that serving never changes them.

Clients may run ``rpc_backward`` (for prompt tuning), but gradients are taken only
w.r.t. inputs and deep prompts: a server's blocks must stay exactly as loaded.
`weights_digest` hashes every parameter and persistent buffer of the served blocks;
``distconf serve --verify-weights`` logs it after loading and again at shutdown.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

__all__ = ["weights_digest"]


def _field(digest: Any, data: bytes | memoryview) -> None:
    """Feed ``data`` length-prefixed, so that consecutive fields cannot run into each other."""
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def _tensor_bytes(name: str, tensor: Any) -> memoryview:
    """The raw bytes of ``tensor`` (a view: only a non-contiguous tensor is copied, alone)."""
    import torch

    if tensor.is_meta:
        raise ValueError(f"tensor {name!r} has no data (it is on the meta device)")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)  # any dtype (bfloat16, float8, bool, ...) as its bytes
    return memoryview(flat.numpy()).cast("B")


def weights_digest(modules: Iterable[Any], *, first_block: int = 0) -> str:
    """The sha256 hex digest of the weights of ``modules`` (served blocks ``first_block``, ``first_block + 1``, ...).

    Covers every parameter and persistent buffer (the module's ``state_dict``), in a
    deterministic order: block by block, then by state-dict name. For each tensor it hashes
    the block index, the name, the dtype, the shape and the raw bytes, so tensors of equal
    bytes but another dtype or shape hash differently, and so does a change of one bit.
    Non-persistent buffers (e.g. rotary tables computed at build time) are left out.

    Tensors are read where they are (memory-mapped views of a safetensors file are hashed
    through the mapping); at most one non-contiguous tensor is copied at a time. Raises
    `ValueError` naming a tensor that has no data (meta device).
    """
    digest = hashlib.sha256()
    for offset, module in enumerate(modules):
        index = first_block + offset
        state = module.state_dict(keep_vars=True)
        _field(digest, f"block {index}".encode())
        for name in sorted(state):
            tensor = state[name]
            _field(digest, name.encode())
            _field(digest, str(tensor.dtype).encode())
            _field(digest, repr(tuple(tensor.shape)).encode())
            _field(digest, _tensor_bytes(f"block {index}: {name}", tensor))
    return digest.hexdigest()
