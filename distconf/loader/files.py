"""Reading untrusted files without trusting them.

A path from a user, a search path or a model folder may name a FIFO that blocks forever,
``/dev/zero`` that never ends, or a sparse file of gigabytes. `read_capped` checks with
``stat`` first (a regular file within the size limit), opens non-blocking, checks the
open file again, and never reads more than the limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnreadableFile", "file_kind", "file_problem", "read_capped"]


class UnreadableFile(Exception):
    """A file cannot be read safely; the message says why (no path: callers add it)."""


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes, for messages ("a FIFO (named pipe)", ...)."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def file_problem(path: Path, limit: int) -> str | None:
    """Why ``path`` cannot be read as a YAML file of at most ``limit`` bytes, by ``stat`` alone (None: it can)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError) as exc:
        return f"cannot read file: {getattr(exc, 'strerror', None) or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"not a regular file: this is {file_kind(info.st_mode)}"
    if info.st_size > limit:
        return f"file is {info.st_size} bytes, more than the limit of {limit}"
    return None


def read_capped(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` if it has at most ``limit``; raises `UnreadableFile` otherwise.

    Checked with ``stat`` before opening, opened with ``O_NONBLOCK`` (and checked again
    on the open file), and at most ``limit + 1`` bytes are ever read.
    """
    problem = file_problem(path, limit)
    if problem:
        raise UnreadableFile(problem)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    chunks: list[bytes] = []
    size = 0
    try:
        fd = os.open(path, flags)
        try:
            mode = os.fstat(fd).st_mode  # the path may have been swapped since the stat above
            if not stat.S_ISREG(mode):
                raise UnreadableFile(f"not a regular file: this is {file_kind(mode)}")
            while size <= limit:
                chunk = os.read(fd, limit + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise UnreadableFile(f"cannot read file: {exc.strerror or exc}") from None
    if size > limit:
        raise UnreadableFile(f"file is larger than the limit of {limit} bytes")
    return b"".join(chunks)
