"""Access to a local safetensors checkpoint that may come from anywhere.

`Checkpoint` maps tensor names to files (a single ``model.safetensors`` or the shards
listed in ``model.safetensors.index.json``) and opens each file once, lazily, with
``safetensors.safe_open`` (memory-mapped; the library validates the header: offsets
in order, contiguous, inside the file, sizes matching shape and dtype). A checkpoint
is untrusted: the index is size-capped and checked entry by entry, shard paths must be
regular files inside the model folder (symlinks are resolved; FIFOs and devices are
never opened), and every problem is a `BlockWeightsError` naming the file (and the
tensor, when one is at fault).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import stat
import sys
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from distconf.blocks.safetensors_header import BlockWeightsError, read_safetensors_header, tensor_label

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockWeightsError", "Checkpoint", "checkpoint_files", "release_pages", "torch_dtype", "INDEX_NAME",
    "SINGLE_NAME", "MAX_INDEX_BYTES",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
_PARSE_ERRORS = (ValueError, RecursionError, TypeError, OverflowError, MemoryError)
_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
    "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64",
}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name (None if torch has none)."""
    import torch

    return getattr(torch, _TORCH_DTYPES.get(name, ""), None)


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


def release_pages(tensor: torch.Tensor) -> None:
    """Stop holding the memory pages that lie wholly inside ``tensor``'s bytes (Linux; else a no-op).

    For a source tensor already copied or cast elsewhere and never read again: pages of a
    memory-mapped checkpoint then leave this process's RSS (they stay in the page cache)
    instead of adding up until the file is closed. Tensors of a validated safetensors file
    never overlap, and pages shared with neighbouring bytes are kept, so no other tensor's
    data is touched.
    """
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    page = os.sysconf("SC_PAGE_SIZE")
    begin, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    start, end = -(-begin // page) * page, (begin + size) // page * page
    if end > start:
        madvise(start, end - start, 4)  # MADV_DONTNEED; a failure only leaves the pages mapped


def _roots(model_dir: Path) -> list[Path]:
    """Folders a checkpoint file may resolve into: the model folder, plus the blob store of a
    Hugging Face cache snapshot (``models--*/snapshots/<rev>/*`` are symlinks to ``../../blobs/*``)."""
    real = model_dir.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def _regular_file(path: Path, roots: list[Path], what: str) -> Path:
    """``path`` resolved; it must be a regular file inside one of ``roots`` (checked before any open)."""
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise BlockWeightsError(f"{path}: {what} does not exist") from None
    except (OSError, RuntimeError) as exc:  # symlink loops, permissions
        raise BlockWeightsError(f"{path}: {what} cannot be resolved: {exc}") from None
    if not any(real == root or real.is_relative_to(root) for root in roots):
        raise BlockWeightsError(f"{path}: {what} resolves to {real}, outside the model folder {roots[0]}")
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise BlockWeightsError(f"{path}: {what} cannot be read: {exc}") from None
    if not stat.S_ISREG(mode):
        raise BlockWeightsError(f"{path}: {what} is not a regular file (a FIFO, device or folder is never opened)")
    return real


def _shard_name(index: Path, entry: Any, tensor: Any) -> str:
    """A weight-map entry: a relative file name that stays inside the model folder."""
    if not isinstance(tensor, str) or not isinstance(entry, str):
        raise BlockWeightsError(f"{index}: weight_map entries must map tensor names to file names (strings)")
    parts = PurePosixPath(entry).parts
    if not entry or "\0" in entry or "\\" in entry or os.path.isabs(entry) or ".." in parts:
        raise BlockWeightsError(f"{index}: tensor {tensor_label(tensor)} is mapped to {tensor_label(entry)}, "
                                "which is not a file name inside the model folder")
    return entry


def _read_index(index: Path, roots: list[Path]) -> dict[str, Path]:
    real = _regular_file(index, roots, "the index")
    if os.stat(real).st_size > MAX_INDEX_BYTES:
        raise BlockWeightsError(f"{index}: index larger than {MAX_INDEX_BYTES >> 20} MiB; not read")
    try:
        with open(real, "rb") as f:
            data = json.loads(f.read(MAX_INDEX_BYTES + 1).decode("utf-8"))
    except _PARSE_ERRORS as exc:
        raise BlockWeightsError(f"{index}: not a valid index ({type(exc).__name__}: {str(exc)[:200]})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise BlockWeightsError(f"{index}: not a valid index (no 'weight_map' object)")
    return {name: index.parent / _shard_name(index, entry, name) for name, entry in weight_map.items()}


class Checkpoint:
    """The tensors of a local safetensors checkpoint; files opened (and headers parsed) once, on first use.

    ``names`` maps every tensor name to the file holding it. Use as a context manager or
    call `close`; tensors already returned stay valid after closing.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._roots = _roots(self.model_dir)
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        self.files_opened: list[Path] = []
        index, single = self.model_dir / INDEX_NAME, self.model_dir / SINGLE_NAME
        if os.path.lexists(index):
            self.names = _read_index(index, self._roots)
        elif os.path.lexists(single):
            self.names = dict.fromkeys(self._handle(single).keys(), single)
        else:
            raise FileNotFoundError(f"{self.model_dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}")

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release every open file (memory maps stay alive while tensors use them)."""
        self._handles.clear()
        self._stack.close()

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import SafetensorError, safe_open

            real = _regular_file(path, self._roots, "checkpoint file")
            try:
                handle = self._stack.enter_context(safe_open(str(real), framework="pt"))
            except SafetensorError as exc:
                raise _invalid(path, real, exc) from None
            except OSError as exc:
                raise BlockWeightsError(f"{path}: cannot open: {exc}") from None
            self._handles[path] = handle
            self.files_opened.append(path)
        return handle

    def _slice(self, name: str) -> Any:
        from safetensors import SafetensorError

        path = self.names[name]
        handle = self._handle(path)
        try:
            return handle.get_slice(name)
        except SafetensorError:  # the library's error for a name the file does not hold
            raise BlockWeightsError(
                f"{path}: does not hold tensor {tensor_label(name)} (the index says it does)") from None

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of tensor ``name``, read from its file's header."""
        piece = self._slice(name)
        return piece.get_dtype(), tuple(piece.get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored: a view of the memory-mapped file (no copy)."""
        from safetensors import SafetensorError

        self._slice(name)
        try:
            return self._handles[self.names[name]].get_tensor(name)
        except (SafetensorError, RuntimeError, TypeError, ValueError) as exc:  # e.g. a dtype torch lacks
            raise BlockWeightsError(f"{self.names[name]}: cannot read tensor {tensor_label(name)}: {exc}") from None


def _invalid(path: Path, real: Path, exc: Exception) -> BlockWeightsError:
    """The library rejected ``path``: name the tensor at fault when the header shows it."""
    try:
        read_safetensors_header(real)
    except BlockWeightsError as found:
        detail = str(found).removeprefix(f"{real}: ")
        return BlockWeightsError(f"{path}: {detail} (safetensors: {str(exc)[:300]})")
    return BlockWeightsError(f"{path}: not a valid safetensors file: {str(exc)[:300]}")


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of a local checkpoint to the file holding it (index or single file)."""
    with Checkpoint(model_dir) as checkpoint:
        return dict(checkpoint.names)
