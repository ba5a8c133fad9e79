"""Everything device-specific a server does: which device, which dtype and quantization, how much memory is free.

- `resolve_device`: ``--device auto|cpu|cuda|cuda:N`` -> a ``torch.device`` (auto: cuda if
  available, else cpu, as Petals 2.x);
- `resolve_compute_dtype`: ``--dtype auto|float32|bfloat16|float16`` for a device (auto: the
  checkpoint's dtype, with float16 computed in float32 on CPU);
- `default_quant`: ``--quant`` when not given (nf4 on CUDA as Petals 2.x, none elsewhere);
- `available_memory`: the bytes a server may size itself with (RAM minus a margin on CPU,
  free device memory minus a margin on CUDA), and how they were seen;
- `move_block`: a loaded block onto its device.

Only the CPU paths run in CI; the CUDA branches are a few lines each and run only where a GPU
is (``torch.cuda`` calls, never reached on a CPU-only machine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distconf.loader.config_protocol import DistributedConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DEVICE_HELP", "DTYPE_ALIASES", "DTYPE_CHOICES", "DTYPE_HELP", "MemorySeen", "available_memory",
           "block_device", "canonical_dtype", "checkpoint_dtype", "default_quant", "move_block",
           "resolve_compute_dtype", "resolve_device"]

logger = logging.getLogger(__name__)

DEVICE_HELP = "auto (default: cuda if available, else cpu, as Petals), cpu, cuda or cuda:N"
DTYPE_HELP = ("auto (default): the checkpoint's torch_dtype (float32 when it names none), except that a float16 "
              "checkpoint is computed in float32 on CPU; or float32, bfloat16, float16 (fp32, bf16, fp16)")
CPU_MARGIN_FRACTION = 0.10
"""Share of the available RAM a self-sized CPU server leaves to the rest of the machine (at least `MIN_MARGIN`)."""
GPU_MARGIN_FRACTION = 0.05
"""Share of the free device memory a self-sized CUDA server leaves (allocator fragmentation, CUDA context)."""
MIN_MARGIN = 1 << 30

DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32",
}
"""Every dtype spelling accepted -> its canonical torch name (the one home of the rule)."""
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
"""``--dtype`` choices on the command line."""


def canonical_dtype(dtype: Any) -> str:
    """Canonical dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``) of a torch dtype or alias."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16 (fp32, bf16, fp16)")
    return DTYPE_ALIASES[name]


def resolve_device(name: str | None = "auto") -> torch.device:
    """``"auto"``/None -> cuda if available, else cpu; otherwise ``torch.device(name)``, checked to exist.

    Raises ValueError naming the device when it cannot be used (no CUDA, an index past the GPUs).
    """
    import torch

    text = "auto" if name is None else str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {name!r}: use {DEVICE_HELP}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r} is not supported: use {DEVICE_HELP}")
    if not torch.cuda.is_available():  # GPU path below: not run in CPU-only CI
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (torch {torch.__version__})")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def checkpoint_dtype(config: DistributedConfig) -> str:
    """The checkpoint's dtype name from ``config`` (``torch_dtype``/``dtype``), float32 when it names none."""
    for attr in ("dtype", "torch_dtype"):
        value = getattr(config, attr, None)
        if value is not None and not isinstance(value, (int, float)):
            try:
                return canonical_dtype(value)
            except ValueError:
                continue
    return "float32"


def resolve_compute_dtype(requested: str | None, config: DistributedConfig, device: torch.device) -> tuple[str, str]:
    """``(dtype name, why)`` a server computes in on ``device`` for ``--dtype requested``.

    ``auto``/None: the checkpoint's dtype (`checkpoint_dtype`), except float16 on CPU -> float32
    (CPU float16 kernels are slow and partly missing; Petals refuses float16 on CPU). An explicit
    dtype is kept as given.
    """
    if requested is not None and str(requested).lower() != "auto":
        return canonical_dtype(requested), "as given"
    stored = checkpoint_dtype(config)
    if device.type == "cpu" and stored == "float16":
        return "float32", "auto: the checkpoint is float16, computed in float32 on CPU"
    return stored, f"auto: the checkpoint's dtype ({stored})"


def block_device(block: nn.Module) -> torch.device:
    """The device ``block``'s parameters are on (cpu for a block without parameters)."""
    import torch

    return next((p.device for p in block.parameters()), torch.device("cpu"))


def default_quant(device: torch.device) -> str:
    """``--quant`` when not given: ``"nf4"`` on CUDA (Petals 2.x's default), ``"none"`` elsewhere."""
    return "nf4" if device.type == "cuda" else "none"


@dataclass(frozen=True)
class MemorySeen:
    """Memory a self-sized server sees: ``available`` bytes, the ``margin`` left, and where it was read."""

    available: int
    margin: int
    source: str

    @property
    def usable(self) -> int:
        """Bytes the planner sizes the server with (``available - margin``, at least 1)."""
        return max(1, self.available - self.margin)


def _cpu_available_bytes() -> tuple[int, str]:
    try:
        import psutil

        return int(psutil.virtual_memory().available), "psutil available RAM"
    except ImportError:
        pass
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "/proc/meminfo MemAvailable"
    raise OSError("cannot read the available RAM (no psutil, no MemAvailable in /proc/meminfo)")


def available_memory(device: torch.device) -> MemorySeen:
    """What a server with no span or memory option may use on ``device`` (see `MemorySeen`).

    CPU: available RAM minus max(10 %, 1 GiB). CUDA: free device memory
    (``torch.cuda.mem_get_info``) minus 5 % (GPU path: not run in CPU-only CI).
    """
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return MemorySeen(int(free), int(free * GPU_MARGIN_FRACTION), f"free memory of {device}")
    available, source = _cpu_available_bytes()
    return MemorySeen(available, max(MIN_MARGIN, int(available * CPU_MARGIN_FRACTION)), source)


def move_block(block: nn.Module, device: torch.device | str) -> nn.Module:
    """``block`` on ``device`` (a no-op on CPU, where blocks are loaded)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return block
    return block.to(device)  # GPU path: not run in CPU-only CI
