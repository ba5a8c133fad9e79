"""Read a GGUF file's header (metadata and tensor table) without reading any tensor, fast and bounded.

gguf's own ``GGUFReader`` decodes every metadata array (a 49k-token vocabulary takes
seconds); a source only needs the architecture, the names, each tensor's type and where
the header ends (its bytes key the conversion cache). A GGUF file is untrusted: every
count and length is checked against the file size before it is used, and every problem
is a `GGUFHeaderError`.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GGUFHeader", "GGUFHeaderError", "read_gguf_header", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"
_MAX_ENTRIES = 1 << 20
_MAX_DIMS = 8
_MAX_DEPTH = 4
_MAX_KEPT_STRING = 1024
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, version, or a corrupt header)."""


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header says: version, scalar/short-string metadata, tensor types, header length."""

    version: int
    metadata: dict[str, Any]
    tensor_types: Counter[int] = field(default_factory=Counter)
    tensor_count: int = 0
    header_bytes: int = 0

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (the GGUF's model architecture name), if present."""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None


class _Cursor:
    def __init__(self, data: Any) -> None:
        self.data, self.pos = data, 0

    def take(self, size: int) -> int:
        if size < 0 or self.pos + size > len(self.data):
            raise GGUFHeaderError(f"header is truncated or corrupt at byte {self.pos}")
        start, self.pos = self.pos, self.pos + size
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str, limit: int | None = None) -> int:
        value = self.scalar("<Q")
        if value > (len(self.data) - self.pos if limit is None else limit):
            raise GGUFHeaderError(f"{what} {value} is impossible at byte {self.pos - 8}")
        return value

    def string(self, keep: bool = True) -> str | None:
        length = self.count("string length")
        start = self.take(length)
        if not keep or length > _MAX_KEPT_STRING:
            return None
        return bytes(self.data[start:start + length]).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY or depth >= _MAX_DEPTH:
            raise GGUFHeaderError(f"unknown metadata value type {kind} at byte {self.pos - 4}")
        item, n = self.scalar("<I"), self.count("array length")
        if item in _SCALARS:
            self.take(n * struct.calcsize(_SCALARS[item]))
        else:
            for _ in range(n):
                self.string(keep=False) if item == _STRING else self.value(item, depth + 1)
        return None  # arrays are skipped: nothing a source needs is an array


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path`` (little-endian, version 2 or 3)."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFHeaderError("not a GGUF file (the first bytes are not 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Cursor(memoryview(data)))


def _parse(cur: _Cursor) -> GGUFHeader:
    try:
        cur.take(4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        tensors, entries = cur.count("tensor count", _MAX_ENTRIES), cur.count("metadata count", _MAX_ENTRIES)
        metadata: dict[str, Any] = {}
        for _ in range(entries):
            key = cur.string() or ""
            value = cur.value(cur.scalar("<I"))
            if value is not None:
                metadata[key] = value
        types: Counter[int] = Counter()
        for _ in range(tensors):
            cur.string(keep=False)
            dims = cur.scalar("<I")
            if dims > _MAX_DIMS:
                raise GGUFHeaderError(f"a tensor has {dims} dimensions at byte {cur.pos - 4}")
            cur.take(8 * dims)
            types[cur.scalar("<I")] += 1
            cur.take(8)
        return GGUFHeader(version, metadata, types, tensors, cur.pos)
    finally:
        cur.data.release()
