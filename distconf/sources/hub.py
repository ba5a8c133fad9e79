"""A hub id: the files a server or a client needs, downloaded on demand into the Hugging Face cache.

`open_hub` fetches the config (and the shard index; a checkpoint of one file, that file) and returns a
`distconf.sources.ModelSource` whose ``hub`` fetches the rest when it is known what is needed: a server the shards
of its blocks (`distconf.sources.hub_fetch.HubFetcher.fetch_layers`), a client its tokenizer and the shards of the
tensors outside the blocks (`HubFetcher.fetch_client`). With ``HF_HUB_OFFLINE=1`` only the cache is read. A
repository without ``config.json`` holding one ``.gguf`` file is downloaded whole and converted once, as a local
``.gguf`` file is.
"""

from __future__ import annotations

import os
from pathlib import Path

from distconf.errors import ModelSourceError
from distconf.sources.base import ModelSource, open_checkpoint
from distconf.sources.gguf import open_gguf
from distconf.sources.hub_fetch import SINGLE, HubFetcher, HubOptions, hub_offline

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
                                        "Face cache") from None


def open_hub(repo_id: str, *, revision: str | None = None, dht_prefix: str | None = None,
             cache_dir: str | os.PathLike[str] | None = None,
             gguf_cache_dir: str | os.PathLike[str] | None = None, options: HubOptions | None = None) -> ModelSource:
    """Open a hub model: its config fetched (the rest on demand, see the module), else a cached ``.gguf`` snapshot.

    The DHT prefix is derived by the family's rule from ``repo_id`` (unless ``dht_prefix``
    is given or ``config.json`` has one). ``options`` (revision, token, cache, disk budget) wins over
    ``revision`` and ``cache_dir``.
    """
    from huggingface_hub.errors import HFValidationError

    options = options or HubOptions(revision=revision, cache_dir=os.fspath(cache_dir) if cache_dir else None)
    fetcher = HubFetcher(repo_id, options)
    try:
        config = fetcher.fetch("config.json", required=False)
    except HFValidationError as exc:
        raise ModelSourceError(repo_id, f"not a file, a folder or a valid hub id ({str(exc)[:200]})") from None
    if config is None:  # a repository of one .gguf file: download it (it is converted once, as a local one)
        files = fetcher.list_files()
        ggufs = [f for f in files or () if f.endswith(".gguf")]
        if len(ggufs) == 1:
            gguf = fetcher.fetch(ggufs[0])
            return open_gguf(gguf, dht_prefix=dht_prefix, cache_dir=gguf_cache_dir, name=repo_id)  # type: ignore[arg-type]
        if len(ggufs) > 1:
            raise ModelSourceError(repo_id, f"it holds {len(ggufs)} .gguf files ({', '.join(ggufs[:4])}); download "
                                            "the one to serve and name the file")
        snapshot = _cached_snapshot(repo_id, options)
        if any(p.suffix == ".gguf" for p in snapshot.iterdir()):
            return open_gguf(snapshot, dht_prefix=dht_prefix, cache_dir=gguf_cache_dir, name=repo_id)
        raise ModelSourceError(repo_id, f"its snapshot {snapshot} holds neither config.json nor a .gguf file")
    snapshot = fetcher.fetch_config()
    if not fetcher.has_index:
        fetcher.fetch(SINGLE)  # one file holds the blocks and the rest
    return open_checkpoint(repo_id, "hub", snapshot, snapshot, dht_prefix=dht_prefix, derive_from=repo_id,
                           hub=fetcher)


def _cached_snapshot(repo_id: str, options: HubOptions) -> Path:
    """The cached snapshot of a repository without ``config.json`` (its ``.gguf`` is not downloaded)."""
    try:
        return hub_snapshot(repo_id, revision=options.revision, cache_dir=options.cache)
    except ModelSourceError:
        if hub_offline():
            raise ModelSourceError(repo_id, "offline (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face "
                                            "cache") from None
        raise ModelSourceError(repo_id, "the hub has neither config.json nor one .gguf file for it, and it is not "
                                        "in the local Hugging Face cache") from None
