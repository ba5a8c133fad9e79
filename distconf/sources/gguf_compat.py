"""One GGUF conversion parses its file once: what distconf changes of the ``gguf`` package while transformers reads.

transformers reads a ``.gguf`` file three times to convert it (the config, the weights, the tokenizer), and each
read builds a new ``gguf.GGUFReader``, whose field parsing (every tokenizer string, through numpy) is most of the
cost; it also builds gguf's tensor name map once per submodule of the model (397 times for SmolLM2). Inside
`shared_gguf_reads`, ``gguf.GGUFReader`` hands out one reader per file and ``gguf.get_tensor_name_map`` one map
per architecture and depth. transformers looks both up on the ``gguf`` module at each call, so nothing of
transformers is touched. A first conversion took 9.4 instead of 16.0 CPU-seconds for SmolLM2's GGUF, 34.6 instead of
49.1 for Gemma 3 270M's (``benchmarks/bench_gguf_convert.py``).

Both are public names of gguf (the readers are only read); the sharing applies to the gguf versions pyproject
declares (`SUPPORTED_GGUF`) and is skipped, with the ordinary slower reads, for any other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from distconf.versions import declared_range, installed_version, version_in_range

__all__ = ["SUPPORTED_GGUF", "shared_gguf_reads"]

logger = logging.getLogger(__name__)

SUPPORTED_GGUF = declared_range("gguf")
_lock = threading.RLock()  # one sharing at a time: the patched names are the whole process's


def _supported() -> bool:
    version = installed_version("gguf")
    return version is not None and version_in_range(version, SUPPORTED_GGUF)


@contextlib.contextmanager
def shared_gguf_reads() -> Iterator[None]:
    """While inside, readers of the same unchanged file and tensor name maps of the same model are built once."""
    if not _supported():
        logger.debug("gguf %s is outside %s: each read parses the file again", installed_version("gguf"),
                     SUPPORTED_GGUF)
        yield
        return
    import gguf

    with _lock:
        plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, int, int], Any] = {}  # by file, size and modification time

        def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
            if mode != "r":
                return plain_reader(path, mode)
            stat = os.stat(path)
            key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
            if key not in readers:
                readers[key] = plain_reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(plain_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = plain_reader, plain_map
            readers.clear()
