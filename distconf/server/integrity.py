"""A digest of the weights a server serves, to show that serving never changes them.

Clients may run ``rpc_backward`` (for prompt tuning), but gradients are taken only
w.r.t. inputs and deep prompts: a server's blocks must stay exactly as loaded.
`weights_digest` hashes every parameter and persistent buffer of the served blocks;
``distconf serve --verify-weights`` logs it after loading and again at shutdown.

`block_digests` is the same digest taken block by block: servers announce it in ``rpc_info``
(``block_sha256``, on by default) and ``distconf manifest`` writes it for a model's real weights,
per `weights_form` (the dtype the blocks are held in, plus their quantization), so a client
given the manifest can refuse servers that announce other weights (`distconf.client.commitments`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

__all__ = ["block_digests", "weights_digest", "weights_form"]


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


def block_digests(modules: Iterable[Any], *, first_block: int = 0) -> list[str]:
    """One `weights_digest` per block: ``weights_digest([module_i], first_block=first_block + i)``, in order."""
    return [weights_digest([module], first_block=first_block + i) for i, module in enumerate(modules)]


def weights_form(dtype: Any, quant: str | None, device_type: str = "cpu") -> str:
    """The key of the form blocks are held in, which their digests depend on.

    The canonical dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``), then ``+int8`` or
    ``+nf4`` when quantized (`distconf.blocks.quant`). nf4 weights repacked for bitsandbytes'
    CPU kernel (`distconf.blocks.quant.nf4_cpu_packed`) hold other bytes: ``+nf4-cpu-packed``.
    """
    from distconf.blocks.device import canonical_dtype
    from distconf.blocks.quant import nf4_cpu_packed, normalize_quant

    form = canonical_dtype(dtype)
    quant = normalize_quant(quant)
    if quant == "nf4" and nf4_cpu_packed(device_type):
        return f"{form}+nf4-cpu-packed"
    return f"{form}+{quant}" if quant else form
