"""The folder GGUF files are converted into, once: where it is, the key of an entry, atomic publication.

An entry is ``<cache>/<stem>-<key>/``: ``key`` hashes the GGUF file's size, mtime and
header bytes (plus the converter's format version and the transformers minor version, whose
dequantization it reflects). An entry is written into a temporary folder next to it and
renamed into place only after every file (the `MANIFEST` last) is on disk, so a half-written
entry is never used; a lock file keeps two processes from converting the same file at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["CACHE_ENV", "MANIFEST", "FORMAT_VERSION", "cache_root", "cache_key", "entry_name", "publish_once"]

logger = logging.getLogger(__name__)

CACHE_ENV = "DISTCONF_CACHE"
"""distconf's cache folder (converted GGUF files go to its ``gguf/``); default ``$XDG_CACHE_HOME/distconf``."""
MANIFEST = "distconf-source.json"
"""Written last into an entry: what it was converted from. An entry without it is not complete."""
FORMAT_VERSION = 1
"""Bump when the converted folder's layout changes: old entries are then converted again."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of converted GGUF copies: ``cache_dir``, else ``$DISTCONF_CACHE/gguf``, else the XDG cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser() / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "distconf" / "gguf"


SAMPLES = 64
"""Chunks of tensor data read into a key, spread evenly over the file (with the header, its size and the versions)."""
SAMPLE_BYTES = 64 * 1024


def cache_key(path: Path, header_bytes: int) -> str:
    """Hex key of the GGUF file at ``path``: what it holds, not when it was written.

    The key covers the file's size, its header (every tensor's name, type, shape and offset, and the metadata),
    `SAMPLES` chunks of its tensor data spread over the file (a re-export with other weights differs there), and
    the format and transformers versions. Reinstalling or copying the file (a new mtime) keeps its key, so a
    converted copy survives a fresh virtualenv; reading the key costs ``header + 4 MiB``, not the whole file.
    """
    import transformers

    size = path.stat().st_size
    minor = ".".join(transformers.__version__.split(".")[:2])
    digest = hashlib.sha256(f"{FORMAT_VERSION}|{minor}|{size}|".encode())
    with path.open("rb") as f:
        remaining = header_bytes
        while remaining > 0:
            chunk = f.read(min(remaining, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
        data = max(0, size - header_bytes)
        for i in range(SAMPLES):
            f.seek(header_bytes + data * i // SAMPLES)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:24]


def entry_name(path: Path, key: str) -> str:
    """``<stem>-<key>``, the stem cut to safe characters."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", path.stem).strip("-")[:80] or "model"
    return f"{stem}-{key}"


def _complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent converters only waste work, the rename keeps it safe
        yield
        return
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into %s", lock_path.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def publish_once(root: Path, name: str, write: Callable[[Path], None], manifest: dict[str, Any]) -> tuple[Path, bool]:
    """The complete entry ``root/name``, written by ``write(tmp_folder)`` first if missing; (path, converted)."""
    final = root / name
    if _complete(final):
        return final, False
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):
        if _complete(final):  # another process finished it while this one waited
            return final, False
        for stale in root.glob(f".tmp-{name}-*"):  # left by a killed conversion (the lock is ours)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            write(tmp)
            _sync_tree(tmp)
            with (tmp / MANIFEST).open("w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():  # an incomplete folder of that name (no manifest): never used, replaced
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, True
