"""The loader's error type and a strict, self-contained check of a safetensors header.

Loading goes through the ``safetensors`` library, which validates a file when it opens
it; `read_safetensors_header` repeats that check in Python (every entry: known dtype,
shape of non-negative integers, ``data_offsets`` of two non-negative integers in order,
size matching shape and dtype, tensors contiguous and covering the data exactly) so an
error can name the tensor at fault. It is used when the library rejects a file, and by
tools that want a header without reading any tensor.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

from distconf.errors import excerpt

__all__ = ["BlockWeightsError", "DTYPE_BITS", "MAX_HEADER_BYTES", "read_safetensors_header", "tensor_label",
    "validate_header",]

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_DIMS = 64
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
}
_PARSE_ERRORS = (ValueError, RecursionError, TypeError, OverflowError, MemoryError)


class BlockWeightsError(ValueError):
    """The checkpoint does not hold exactly the tensors of the block, or a file of it is invalid.

    Lists every problem found at once; ``missing``, ``unexpected``, ``mismatched`` (wrong
    shape) and ``wrong_dtype`` hold them by kind, ``field`` names the family-file field
    to check (None when the checkpoint itself is at fault).
    """

    def __init__(self, message: str, *, missing: list[str] | None = None, unexpected: list[str] | None = None,
                 mismatched: list[str] | None = None, field: str | None = None,
                 wrong_dtype: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []
        self.wrong_dtype = wrong_dtype or []
        self.field = field


def tensor_label(name: Any) -> str:
    """A tensor name from an untrusted file, quoted and cut to a bounded length."""
    if not isinstance(name, str):
        return excerpt(name)
    return repr(name[:200]) + ("..." if len(name) > 200 else "")


def _uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: Any, data_len: int) -> tuple[str | None, int, int]:
    """(problem or None, begin, end) of one tensor entry."""
    if not isinstance(entry, dict):
        return "entry is not an object", 0, 0
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    bits = DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        return f"unknown dtype {excerpt(dtype)}", 0, 0
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_uint(d) for d in shape):
        return f"shape {excerpt(shape)} is not a list of at most {MAX_DIMS} non-negative integers", 0, 0
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_uint(o) for o in offsets):
        return f"data_offsets {excerpt(offsets)} are not two non-negative integers [begin, end]", 0, 0
    begin, end = offsets
    if begin > end:
        return f"data_offsets [{begin}, {end}] are reversed", 0, 0
    if end > data_len:
        return f"data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes)", 0, 0
    needed = math.prod(shape) * bits
    if needed != (end - begin) * 8:
        return (f"shape {excerpt(shape)} of {dtype} needs {needed / 8:.0f} bytes but data_offsets "
                f"[{begin}, {end}] hold {end - begin}"), 0, 0
    return None, begin, end


def validate_header(path: str | Path, header: Any, data_len: int) -> None:
    """Raise `BlockWeightsError` naming ``path`` and the tensor unless ``header`` is a valid safetensors header
    for ``data_len`` bytes of tensor data."""
    if not isinstance(header, dict):
        raise BlockWeightsError(f"{path}: safetensors header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BlockWeightsError(f"{path}: safetensors __metadata__ must map strings to strings")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem, begin, end = _entry_problem(entry, data_len)
        if problem:
            raise BlockWeightsError(f"{path}: tensor {tensor_label(name)}: {problem}")
        spans.append((begin, end, name))
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != position:
            how = (f"overlap those of tensor {tensor_label(previous)}" if begin < position
                   else f"leave {begin - position} unused bytes before it")
            raise BlockWeightsError(f"{path}: tensor {tensor_label(name)}: data_offsets [{begin}, {end}] {how}")
        position, previous = end, name
    if position != data_len:
        raise BlockWeightsError(f"{path}: the tensors cover {position} of the file's {data_len} data bytes")


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """The validated JSON header of a safetensors file (without ``__metadata__``) and where tensor data starts.

    Only regular files are opened; every problem is a `BlockWeightsError` naming the file.
    """
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise BlockWeightsError(f"{path}: not a regular file")
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise BlockWeightsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES or 8 + size > info.st_size:
                raise BlockWeightsError(f"{path}: safetensors header of {size} bytes does not fit the file")
            text = f.read(size)
    except OSError as exc:
        raise BlockWeightsError(f"{path}: cannot read: {exc}") from None
    try:
        header = json.loads(text.decode("utf-8"))
    except _PARSE_ERRORS as exc:
        raise BlockWeightsError(f"{path}: safetensors header is not valid JSON ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None
    validate_header(path, header, info.st_size - 8 - size)
    header.pop("__metadata__", None)
    return header, 8 + size
