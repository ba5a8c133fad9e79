"""`open_source`: what a user names (a folder, a ``.gguf`` file, a hub id) -> the right `ModelSource`."""

from __future__ import annotations

import os
from pathlib import Path

from distconf.errors import ModelSourceError
from distconf.sources.base import ModelSource
from distconf.sources.folder import open_folder
from distconf.sources.gguf import open_gguf
from distconf.sources.hub import open_hub
from distconf.sources.hub_fetch import HubOptions

__all__ = ["open_source"]


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf") or name.count("/") > 1 or "\\" in name


def open_source(model: str | os.PathLike[str], *, dht_prefix: str | None = None, revision: str | None = None,
                cache_dir: str | os.PathLike[str] | None = None,
                hub_cache_dir: str | os.PathLike[str] | None = None, hub: HubOptions | None = None) -> ModelSource:
    """Open ``model``: a model folder, a ``.gguf`` file or a folder holding one, or a hub id.

    ``dht_prefix`` overrides the derived prefix; ``cache_dir`` is where GGUF files are
    converted to (see `distconf.sources.gguf_cache.cache_root`); ``revision`` and
    ``hub_cache_dir`` apply to hub ids (``hub``, when given, holds them with the token and disk budget: a hub
    id's files are downloaded as needed, `distconf.sources.hub`). Raises `ModelSourceError` for anything that
    cannot be served.
    """
    name = os.fspath(model)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file() or not any(p.suffix == ".gguf" for p in path.iterdir()):
            return open_folder(path, dht_prefix=dht_prefix, name=name)
        return open_gguf(path, dht_prefix=dht_prefix, cache_dir=cache_dir, name=name)
    if path.is_file():
        return open_gguf(path, dht_prefix=dht_prefix, cache_dir=cache_dir, name=name)
    if os.path.lexists(path) or _looks_like_path(name):
        raise ModelSourceError(name, f"{path} is not a file or a folder")
    return open_hub(name, revision=revision, dht_prefix=dht_prefix, cache_dir=hub_cache_dir,
                    gguf_cache_dir=cache_dir, options=hub)
