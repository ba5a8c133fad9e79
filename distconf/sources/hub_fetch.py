"""Downloads from the Hugging Face hub of what is needed and nothing more (Petals' rule).

A server fetches the config and only the checkpoint shards holding its blocks (`HubFetcher.fetch_layers`); a client
fetches the config, the tokenizer and the shards holding the tensors outside the blocks (embeddings, final norm,
LM head: `HubFetcher.fetch_client`). Files go into the Hugging Face cache (``cache_dir``, default huggingface_hub's)
through ``huggingface_hub.hf_hub_download``: a download cut short is resumed from where it stopped, and shows its
progress. With ``max_disk_space`` the cache is kept under that size: before each download, the least recently used
files of other snapshots are deleted, never a file this model uses (Petals' ``--max_disk_space``). With
``HF_HUB_OFFLINE=1`` only the cache is read, and a missing file is named.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distconf.errors import ModelSourceError
from distconf.sources.hub_compat import blob_path, download_blob, file_metadata

__all__ = ["CLIENT_FILES", "INDEX", "SINGLE", "HubFetcher", "HubOptions", "free_disk_space_for", "hub_offline"]

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG_FILES = ("config.json", "generation_config.json")
CLIENT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
"""The tokenizer's files a client fetches when the repository has them."""
_MAX_INDEX_BYTES = 64 << 20


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for the cache only (read now, not at huggingface_hub's import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True)
class HubOptions:
    """Where and what to download: Petals' ``--revision``, ``--token``, ``--cache_dir``, ``--max_disk_space``.

    ``token`` None: ``HF_TOKEN`` or the login huggingface_hub finds; ``cache_dir`` None: ``HF_HUB_CACHE``, else
    huggingface_hub's default; ``max_disk_space`` in bytes (None: no limit).
    """

    revision: str | None = None
    token: str | None = None
    cache_dir: str | None = None
    max_disk_space: int | None = None

    @property
    def cache(self) -> str | None:
        """The cache folder to use (None: huggingface_hub's default)."""
        return self.cache_dir or os.environ.get("HF_HUB_CACHE") or None

    @property
    def endpoint(self) -> str | None:
        """The hub to download from: ``HF_ENDPOINT`` read now (huggingface_hub reads it once, at import)."""
        return os.environ.get("HF_ENDPOINT") or None


class HubFetcher:
    """The files of one hub repository at one revision, fetched on demand into the cache."""

    def __init__(self, repo_id: str, options: HubOptions | None = None) -> None:
        self.repo_id, self.options = repo_id, options or HubOptions()
        self.fetched: dict[str, Path] = {}
        self.should_stop: Any = None
        """A callable saying the caller wants to stop (a server's SIGINT/SIGTERM): a large download then ends with
        InterruptedError, resumable."""
        self._index: dict[str, str] | None = None

    # ------------------------------------------------------------------ one file
    def fetch(self, filename: str, *, required: bool = True) -> Path | None:
        """``filename`` of the repository in the cache (downloaded when missing); None when the repository has no
        such file and it is not ``required``. Raises `ModelSourceError` naming the file and why."""
        if filename in self.fetched:
            return self.fetched[filename]
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        o, offline = self.options, hub_offline()
        try:
            if not offline:
                self._prefetch(filename)
            path = Path(hf_hub_download(self.repo_id, filename, revision=o.revision, token=o.token,
                                        cache_dir=o.cache, local_files_only=offline, endpoint=o.endpoint))
        except InterruptedError:  # asked to stop mid-download (an OSError too): the caller's, not the hub's
            raise
        except LocalEntryNotFoundError:
            if offline and not required:
                return None
            why = ("offline (HF_HUB_OFFLINE=1) and it is not in the cache" if offline
                   else "the hub cannot be reached and it is not in the cache")
            raise ModelSourceError(self.repo_id, f"{filename}: {why}") from None
        except RemoteEntryNotFoundError:
            if required:
                raise ModelSourceError(self.repo_id, f"the repository has no {filename}") from None
            return None
        except (RepositoryNotFoundError, GatedRepoError) as exc:
            raise ModelSourceError(self.repo_id, f"the hub refuses it ({_first_line(exc)}); a private or gated "
                                                 "repository needs --token (or HF_TOKEN)") from None
        except RevisionNotFoundError:
            raise ModelSourceError(self.repo_id, f"the hub has no revision {o.revision!r} of it") from None
        except (HfHubHTTPError, OSError) as exc:
            raise ModelSourceError(self.repo_id, f"{filename} could not be downloaded ({_first_line(exc)})") from None
        self.fetched[filename] = path
        return path

    def list_files(self) -> list[str] | None:
        """The repository's file names at the revision (None: offline, or the hub cannot list them)."""
        if hub_offline():
            return None
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        o = self.options
        try:
            info = HfApi(endpoint=o.endpoint, token=o.token).model_info(self.repo_id, revision=o.revision)
        except (HfHubHTTPError, OSError, ValueError):
            return None
        return sorted(s.rfilename for s in info.siblings or ())

    @property
    def snapshot(self) -> Path:
        """The snapshot folder the fetched files are in (after `fetch_config`)."""
        return self.fetch("config.json").parent  # type: ignore[union-attr]

    # ------------------------------------------------------------------ what a server or a client needs
    def fetch_config(self) -> Path:
        """The config (and the generation config and the shard index, when there are), in the snapshot folder."""
        for name in CONFIG_FILES[1:]:
            self.fetch(name, required=False)
        self.fetch(INDEX, required=False)
        return self.snapshot

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file, from the index (one file when the repository has no index)."""
        if self._index is None:
            index = self.fetch(INDEX, required=False)
            if index is None:
                self._index = {}
            else:
                if index.stat().st_size > _MAX_INDEX_BYTES:
                    raise ModelSourceError(self.repo_id, f"{INDEX} is larger than {_MAX_INDEX_BYTES >> 20} MiB")
                try:
                    data = json.loads(index.read_text(encoding="utf-8"))
                    weight_map = data["weight_map"]
                    if not isinstance(weight_map, dict) or not all(
                            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                        raise ValueError("weight_map is not an object of file names")
                except (ValueError, KeyError, TypeError) as exc:
                    raise ModelSourceError(self.repo_id, f"{INDEX} is not a valid index ({exc})") from None
                self._index = weight_map
        return self._index

    @property
    def has_index(self) -> bool:
        """Whether the checkpoint is sharded (``model.safetensors.index.json``)."""
        return bool(self._weight_map())

    def shards_for(self, wanted: Any) -> list[str]:
        """The shard files holding the tensors for which ``wanted(name)`` is true, in the index's order."""
        weight_map = self._weight_map()
        if not weight_map:
            return [SINGLE]
        return sorted({shard for name, shard in weight_map.items() if wanted(name)})

    def fetch_layers(self, config: Any, layers: Iterable[int]) -> list[str]:
        """Download the shards holding layers ``layers`` of ``config`` (a server's blocks); returns their names."""
        from distconf.blocks.weights import layer_prefixes

        prefixes = tuple(p for i in layers for p in layer_prefixes(config, i))
        shards = self.shards_for(lambda name: name.startswith(prefixes))
        self._fetch_all(shards)
        return shards

    def fetch_client(self, config: Any) -> list[str]:
        """Download the tokenizer and the shards holding tensors outside the blocks (a client's part)."""
        from distconf.blocks.weights import layer_prefixes

        for name in CLIENT_FILES:
            self.fetch(name, required=False)
        blocks = tuple(p for i in range(int(config.num_hidden_layers)) for p in layer_prefixes(config, i))
        shards = self.shards_for(lambda name: not name.startswith(blocks))
        self._fetch_all(shards)
        return shards

    def _fetch_all(self, names: Sequence[str]) -> None:
        for name in names:
            self.fetch(name)

    # ------------------------------------------------------------------ the disk budget, resumed downloads
    def _prefetch(self, filename: str) -> None:
        """Before ``hf_hub_download``: room for the file within ``max_disk_space``, and a large file's blob
        downloaded by `distconf.sources.hub_compat.download_blob` (resumed after an earlier attempt was cut)."""
        from huggingface_hub.errors import HfHubHTTPError

        o = self.options
        large = filename.endswith((".safetensors", ".gguf"))
        if o.max_disk_space is None and not large:
            return
        try:
            meta = file_metadata(self.repo_id, filename, revision=o.revision, token=o.token, endpoint=o.endpoint)
        except (HfHubHTTPError, OSError):  # hf_hub_download says what is wrong
            return
        blob = blob_path(o.cache, self.repo_id, meta.etag) if meta.etag else None
        if blob is not None and blob.exists():
            return
        if o.max_disk_space is not None:
            free_disk_space_for(int(meta.size or 0), o.max_disk_space, o.cache,
                                keep={p.resolve() for p in self.fetched.values()}, name=f"{self.repo_id}/{filename}")
        if blob is not None and large and meta.location:
            download_blob(meta.location, blob, size=meta.size, etag=meta.etag, token=o.token,
                          name=f"{self.repo_id}/{filename}", should_stop=self.should_stop)


def free_disk_space_for(size: int, max_disk_space: int, cache_dir: str | None, *, keep: set[Path],
                        name: str) -> list[Path]:
    """Delete least recently used files of the Hugging Face cache until ``size`` more bytes fit in
    ``max_disk_space``; never a file in ``keep`` (resolved blob paths) or one being downloaded. Returns what was
    deleted. Raises `ModelSourceError` when the files that may go are not enough."""
    from huggingface_hub import scan_cache_dir

    root = Path(cache_dir) if cache_dir else None
    if root is not None and not root.exists():
        return []
    info = scan_cache_dir(root)
    files = [f for repo in info.repos for revision in repo.revisions for f in revision.files]
    blobs: dict[Path, Any] = {}
    for f in files:
        blobs.setdefault(Path(f.blob_path).resolve(), f)
    used = sum(f.size_on_disk for f in blobs.values())
    over = used + size - max_disk_space
    deleted: list[Path] = []
    if over <= 0:
        return deleted
    for blob, f in sorted(blobs.items(), key=lambda item: item[1].blob_last_accessed):
        if over <= 0:
            break
        if blob in keep:
            continue
        for link in (f2.file_path for f2 in files if Path(f2.blob_path).resolve() == blob):
            Path(link).unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        deleted.append(blob)
        over -= f.size_on_disk
        logger.info("max_disk_space: deleted %s (%.1f MiB, least recently used)", f.file_name,
                    f.size_on_disk / 2**20)
    if over > 0:
        raise ModelSourceError(name, f"does not fit in --max-disk-space {max_disk_space} bytes: the cache holds "
                                     f"{used} bytes and {over} more would have to go, all of them in use")
    return deleted


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
