"""Where the built-in data lives: family files, presets and the JSON schema.

In an installed wheel they are packaged under ``distconf/_data/``; in a source
checkout (or an editable install) they are the repository's root folders.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

__all__ = ["data_dir", "builtin_families_dir", "presets_dir", "schema_path"]

_PACKAGE = Path(__file__).resolve().parent.parent  # the distconf package


@cache
def data_dir(name: str) -> Path:
    """The built-in data folder ``name`` (``families``, ``presets`` or ``schemas``)."""
    packaged = _PACKAGE / "_data" / name
    if packaged.is_dir():
        return packaged
    return _PACKAGE.parent / name


def builtin_families_dir() -> Path:
    """Folder of the built-in family files."""
    return data_dir("families")


def presets_dir() -> Path:
    """Folder of the shipped real-model configs (presets)."""
    return data_dir("presets")


def schema_path() -> Path:
    """Path of the JSON schema of a family file."""
    return data_dir("schemas") / "family.schema.json"
