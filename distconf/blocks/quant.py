"""Weight quantization of a served block (Petals' ``--quant_type none|int8|nf4``) and its exact size.

Chosen by measurement on CPU (``benchmarks/bench_quant.py``):

- ``int8``: our own weight-only int8, symmetric, one scale per output channel (stored in the
  block's dtype), computed by torch's int8 CPU kernel (``torch._weight_int8pack_mm``) with
  bf16 activations (an fp32 block's activations are rounded to bf16 for it: the kernel is
  3-19x slower with fp32 ones); elsewhere (other devices, in_features not a multiple of 64)
  dequantized then multiplied. Petals 2.x serves int8 with
  bitsandbytes' LLM.int8() (activations quantized too, outliers above 6.0 kept apart); on
  this CPU at 1 token that was 3.3x fp32's time at hidden 576 (ours 1.0x) and 0.43x at 2048
  (ours 0.40x), and less accurate. The record value is the same: quantization is local to a
  server.
- ``nf4``: bitsandbytes' ``Linear4bit`` exactly as Petals 2.x builds it (``quant_type="nf4"``,
  blocksize 64, double-quantized statistics), so the NF4 codebook and blocks are Petals'.
  At 1 token: 1.6x fp32's time at hidden 576, 0.16x at 2048 (torchao's NF4Tensor refuses
  SmolLM2's shapes and is 40x slower; a torch dequantize-then-matmul is 16-30x slower).
  On CPUs with AVX512-BF16, bitsandbytes repacks the weight for its CPU kernel at the first
  call (absmax undone from double quantization and kept in bf16); `quantize_block` makes that
  happen at once, so the bytes a block holds do not change when it serves its first request.

Only ``nn.Linear`` weights are quantized (biases, norms, embeddings and fused expert tensors
keep the block's dtype). An nf4 Linear needs ``in_features % 64 == 0`` and ``out_features %
32 == 0`` (bitsandbytes' CPU layout); one that does not keep its dtype, as the sizing rule says.
`block_bytes` gives the exact bytes of the tensors a quantized block holds, from the block
built on the meta device; `held_bytes` measures them on a real one.

bitsandbytes is imported only when an nf4 block is quantized.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from distconf.blocks.checkpoint import release_pages

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "QUANT_TYPES", "QUANT_BYTES", "normalize_quant", "petals_quant_type", "quant_type_enum_name",
    "quantizable", "quantized_linear_bytes", "block_bytes", "quantize_block", "held_bytes", "int8_linear",
]

log = logging.getLogger(__name__)

QUANT_TYPES = ("none", "int8", "nf4")
"""Values of ``--quant`` (Petals' ``--quant_type`` choices, its ``QuantType`` enum names lower-cased)."""
QUANT_BYTES: dict[str, float] = {"int8": 1.0, "nf4": 4.25 / 8}
"""Bytes per quantized Linear weight value: int8 data; nf4 4-bit data plus a bf16 absmax per 64 values.

Per-Linear tables come on top (`quantized_linear_bytes`): int8's per-row scale, nf4's codebook.
"""
NF4_BLOCKSIZE = 64
_NF4_OUT_MULTIPLE = 32  # bitsandbytes' CPU packing tiles output rows by 32
_NF4_CODE_BYTES = 16 * 4  # the NF4 codebook (16 fp32 values) each Linear keeps
_NF4_NESTED_CODE_BYTES = 256 * 4  # double quantization: 8-bit code of the absmax values
_NF4_NESTED_BLOCKSIZE = 256
_NF4_OFFSET_BYTES = 4  # double quantization's offset (a 0-d fp32 tensor), kept after CPU repacking


def normalize_quant(quant: str | None) -> str | None:
    """``None`` for no quantization (``None``, ``"none"``), else ``"int8"`` or ``"nf4"`` (case-insensitive).

    Raises ValueError naming the value for anything else.
    """
    if quant is None:
        return None
    value = quant.lower() if isinstance(quant, str) else quant
    if value not in QUANT_TYPES:
        raise ValueError(f"quant={quant!r} is not supported; use one of {', '.join(QUANT_TYPES)}")
    return None if value == "none" else value


def petals_quant_type(quant: str | None) -> str:
    """The server record's ``quant_type`` value: ``"none"``, ``"int8"`` or ``"nf4"``.

    Petals 2.x announces ``ServerInfo(quant_type=quant_type.name.lower())`` and reads it back
    with ``QuantType[server_info.quant_type.upper()]``.
    """
    return normalize_quant(quant) or "none"


def quant_type_enum_name(quant: str | None) -> str:
    """Petals' ``QuantType`` member name: ``"NONE"``, ``"INT8"`` or ``"NF4"``."""
    return petals_quant_type(quant).upper()


def quantizable(in_features: int, out_features: int, quant: str | None) -> bool:
    """Whether `quantize_block` quantizes a Linear of this shape (else it keeps the block's dtype)."""
    quant = normalize_quant(quant)
    if quant == "nf4":
        return in_features % NF4_BLOCKSIZE == 0 and out_features % _NF4_OUT_MULTIPLE == 0
    return quant == "int8"


@functools.cache
def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


def nf4_cpu_packed(device_type: str = "cpu") -> bool:
    """Whether nf4 weights on ``device_type`` take bitsandbytes' CPU-kernel layout (AVX512-BF16 CPUs)."""
    return device_type == "cpu" and _cpu_has_avx512_bf16()


def quantized_linear_bytes(out_features: int, in_features: int, quant: str | None, dtype: torch.dtype, *,
                           device_type: str = "cpu") -> int:
    """Exact bytes of a Linear weight (bias excluded) after `quantize_block`, on ``device_type``."""
    import torch

    quant = normalize_quant(quant)
    values = out_features * in_features
    value_bytes = torch.empty((), dtype=dtype, device="meta").element_size()
    if not quantizable(in_features, out_features, quant):
        return values * value_bytes
    if quant == "int8":
        return values + out_features * value_bytes
    blocks = values // NF4_BLOCKSIZE
    if nf4_cpu_packed(device_type):
        return int(values * QUANT_BYTES["nf4"]) + _NF4_CODE_BYTES + _NF4_OFFSET_BYTES
    # bitsandbytes' own layout: uint8 absmax per block, double-quantized (fp32 absmax per 256, an offset)
    nested = -(-blocks // _NF4_NESTED_BLOCKSIZE)
    return values // 2 + blocks + nested * 4 + _NF4_OFFSET_BYTES + _NF4_CODE_BYTES + _NF4_NESTED_CODE_BYTES


def block_bytes(block: nn.Module, dtype: torch.dtype, quant: str | None, *, device_type: str = "cpu") -> int:
    """Exact bytes of the parameters a block holds once quantized, from the block (meta or real).

    Linear weights by `quantized_linear_bytes`; every other parameter in ``dtype``. Buffers
    are not counted (blocks' own buffers are small computed tables, as in the unquantized rule).
    """
    import torch
    from torch import nn

    value_bytes = torch.empty((), dtype=dtype, device="meta").element_size()
    linear_weights = {}
    for module in block.modules():
        if isinstance(module, nn.Linear):
            linear_weights[id(module.weight)] = quantized_linear_bytes(
                module.out_features, module.in_features, quant, dtype, device_type=device_type)
    total = sum(linear_weights.values())
    for p in block.parameters():
        if id(p) not in linear_weights:
            total += p.numel() * value_bytes
    return total


def int8_linear(linear: nn.Linear) -> nn.Module:
    """A weight-only int8 copy of ``linear``: int8 ``weight [out, in]``, ``scale [out]`` in its dtype."""
    return _int8_linear_class()(linear)


@functools.cache
def _int8_linear_class() -> type:
    import torch
    from torch import nn

    from distconf.blocks.torch_compat import weight_int8pack_mm

    class _Int8Linear(nn.Module):
        """Weight-only int8 Linear (see `int8_linear`)."""

        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            w = linear.weight.detach().float()
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
            q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.register_buffer("scale", scale.to(linear.weight.dtype))
            self.bias = linear.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            flat = x.reshape(-1, shape[-1])
            # torch's int8 CPU kernel is fast with bf16/fp16 activations only (fp32 ones: 3-19x slower
            # than nn.Linear), so fp32 activations go through it in bf16. It needs in_features % 16 == 0.
            if flat.is_cpu and self.in_features % 64 == 0:
                compute = flat.dtype if flat.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
                out = weight_int8pack_mm(flat.to(compute).contiguous(), self.weight,
                                         self.scale.to(compute)).to(flat.dtype)
            else:
                out = nn.functional.linear(flat, self.weight.to(flat.dtype)) * self.scale.to(flat.dtype)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.reshape(*shape[:-1], self.out_features)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    _Int8Linear.__name__ = _Int8Linear.__qualname__ = "Int8Linear"
    return _Int8Linear


def _nf4_linear(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb
    import torch

    weight = linear.weight.detach()
    module = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                               compute_dtype=weight.dtype, compress_statistics=True, quant_type="nf4",
                               device="meta")
    module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCKSIZE,
                                      compress_statistics=True)
    module.bias = linear.bias
    module = module.to(weight.device).eval()  # bitsandbytes quantizes when the weight moves to a real device
    packed = nf4_cpu_packed(weight.device.type)
    if getattr(module, "support_avx512bf16_for_cpu", False) and not packed:
        module.support_avx512bf16_for_cpu = False  # keep the layout the sizing rule assumes
    if packed:
        if not getattr(module, "support_avx512bf16_for_cpu", False):
            log.warning("bitsandbytes does not use its AVX512-BF16 CPU kernel on this CPU; "
                        "nf4 blocks hold about 3%% less than the sizing rule says")
        else:
            with torch.no_grad():  # bitsandbytes repacks for its CPU kernel at the first call: now
                module(torch.zeros(1, linear.in_features, dtype=weight.dtype, device=weight.device))
    return module


def quantize_block(block: nn.Module, quant: str | None) -> nn.Module:
    """Replace ``block``'s ``nn.Linear`` modules in place by quantized ones; return ``block``.

    ``quant``: ``"int8"``, ``"nf4"``, or ``None``/``"none"`` (nothing changes). Weights must be
    real (not on meta) and in the dtype the block will compute in: quantize last, after
    loading and casting. Only Linear weights change; the block's class is unchanged.
    """
    import torch
    from torch import nn

    quant = normalize_quant(quant)
    if quant is None:
        return block
    kept = []
    for name, module in list(block.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if child.weight.is_meta:
                raise ValueError(f"cannot quantize {full}: its weight is on the meta device (load the block first)")
            if not quantizable(child.in_features, child.out_features, quant):
                kept.append(full)
                continue
            with torch.no_grad():
                new = int8_linear(child) if quant == "int8" else _nf4_linear(child)
            setattr(module, child_name, new)
            release_pages(child.weight)  # a view of the mapped checkpoint, read for the last time
    if kept:
        log.info("%s: %s kept in %s (shape not quantizable as %s)", type(block).__name__, ", ".join(kept),
                 next(block.parameters()).dtype, quant)
    _own_unquantized_tensors(block)
    block.requires_grad_(False)
    return block


def _own_unquantized_tensors(block: nn.Module) -> None:
    """Copy the tensors quantization left as they were (norms, biases) out of the checkpoint's mapping.

    Loaded tensors are views of the memory-mapped checkpoint file; once the Linear weights are
    replaced, the few small tensors left would keep the whole mapping resident (measured: 203 MiB
    for 15 blocks of a 135M model), so they get storage of their own.
    """
    import torch

    with torch.no_grad():
        for module in block.modules():
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if tensor is not None and not tensor.is_meta and tensor.untyped_storage().nbytes() > tensor.nbytes:
                    source = tensor.data
                    tensor.data = source.clone()
                    release_pages(source)


def held_bytes(module: nn.Module) -> int:
    """Bytes of the tensors ``module`` holds: parameters, buffers and bitsandbytes' quantization state.

    Each tensor counted once by its own bytes (a view of a memory-mapped checkpoint counts as
    its own elements, not as the file).
    """
    import torch

    seen: dict[tuple[int, int], int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:  # tensor bytes, not storage (mmap views)
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()

    def add_state(state: Any) -> None:
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif type(value).__name__ == "QuantState":
                add_state(value)

    for t in [*module.parameters(), *module.buffers()]:
        add(t)
        if getattr(t, "quant_state", None) is not None:
            add_state(t.quant_state)
    return sum(seen.values())
