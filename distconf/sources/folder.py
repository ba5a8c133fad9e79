"""A Hugging Face model folder as it is: ``config.json`` plus ``*.safetensors`` (sharded or not)."""

from __future__ import annotations

from pathlib import Path

from distconf.errors import ModelSourceError
from distconf.sources.base import ModelSource, open_checkpoint

__all__ = ["open_folder"]


def open_folder(path: str | Path, *, dht_prefix: str | None = None, name: str | None = None) -> ModelSource:
    """Open a model folder; ``dht_prefix`` overrides the one in (or derived for) its ``config.json``.

    Without one in ``config.json``, the prefix is derived by the family's rule from a
    hub-id ``_name_or_path`` there, else from the folder's name.
    """
    folder = Path(path)
    shown = name or str(path)
    if not folder.is_dir():
        raise ModelSourceError(shown, f"{folder} is not a folder")
    return open_checkpoint(shown, "folder", folder, folder, dht_prefix=dht_prefix)
