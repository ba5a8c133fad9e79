"""A hub id already in the local Hugging Face cache; nothing is ever downloaded."""

from __future__ import annotations

import os
from pathlib import Path

from distconf.errors import ModelSourceError
from distconf.sources.base import ModelSource, open_checkpoint
from distconf.sources.gguf import open_gguf

__all__ = ["open_hub", "hub_snapshot"]


def hub_snapshot(repo_id: str, *, revision: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cached snapshot folder of ``repo_id`` (``local_files_only``: never a network call).

    ``cache_dir`` defaults to ``$HF_HUB_CACHE`` read now (huggingface_hub reads it once, at
    import), else huggingface_hub's default.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except HFValidationError as exc:
        raise ModelSourceError(repo_id, f"not a file, a folder or a valid hub id ({str(exc)[:200]})") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        where = f"revision {revision!r} of it" if revision else "it"
        raise ModelSourceError(repo_id, f"not a local file or folder, and {where} is not in the local Hugging "
                                        "Face cache (distconf never downloads: fetch it first, e.g. "
                                        f"`hf download {repo_id}`)") from None


def open_hub(repo_id: str, *, revision: str | None = None, dht_prefix: str | None = None,
             cache_dir: str | os.PathLike[str] | None = None,
             gguf_cache_dir: str | os.PathLike[str] | None = None) -> ModelSource:
    """Open a cached hub model: a safetensors snapshot as a folder, else a snapshot holding one ``.gguf``.

    The DHT prefix is derived by the family's rule from ``repo_id`` (unless ``dht_prefix``
    is given or the snapshot's ``config.json`` has one).
    """
    snapshot = hub_snapshot(repo_id, revision=revision, cache_dir=cache_dir)
    if (snapshot / "config.json").is_file():
        return open_checkpoint(repo_id, "hub", snapshot, snapshot, dht_prefix=dht_prefix, derive_from=repo_id)
    if any(p.suffix == ".gguf" for p in snapshot.iterdir()):
        return open_gguf(snapshot, dht_prefix=dht_prefix, cache_dir=gguf_cache_dir, name=repo_id)
    raise ModelSourceError(repo_id, f"its cached snapshot {snapshot} holds neither config.json nor a .gguf file")
