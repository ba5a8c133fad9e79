"""What distconf uses of huggingface_hub beyond ``hf_hub_download``: the cache's blob path of a file, and a download
that resumes where a killed one stopped.

huggingface_hub 1.x and 2.x download into a temporary file unique to the process, so a download cut short starts
over. A server fetching gigabytes of shards resumes instead: `download_blob` writes the file's blob itself (``GET``
with ``Range: bytes=N-`` after the ``N`` bytes a previous attempt left in ``<blob>.distconf-partial``), and
``hf_hub_download`` then finds the blob in place and only links it into the snapshot. The cache layout
(``models--ORG--NAME/blobs/<etag>``) is huggingface_hub's documented one; `check_hub_version` guards the rest.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distconf.versions import declared_range, installed_version, version_in_range

__all__ = ["PARTIAL_SUFFIX", "SUPPORTED_HUB", "blob_path", "check_hub_version", "download_blob", "file_metadata"]

logger = logging.getLogger(__name__)

SUPPORTED_HUB = declared_range("huggingface_hub")
PARTIAL_SUFFIX = ".distconf-partial"
_CHUNK = 1 << 20


def check_hub_version() -> str:
    """The installed huggingface_hub's version; a RuntimeError saying what to install when it is outside
    `SUPPORTED_HUB`."""
    version = installed_version("huggingface_hub") or "none"
    if not version_in_range(version, SUPPORTED_HUB):
        raise RuntimeError(f"distconf needs huggingface_hub {SUPPORTED_HUB}; {version} is installed: "
                           f"pip install 'huggingface_hub{SUPPORTED_HUB}'")
    return version


def blob_path(cache_dir: str | None, repo_id: str, etag: str) -> Path:
    """Where the hub cache keeps the content of a file whose etag is ``etag`` (``cache_dir`` None: the default)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    check_hub_version()
    root = Path(cache_dir) if cache_dir else Path(constants.HF_HUB_CACHE)
    return root / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs" / etag


def download_blob(url: str, blob: Path, *, size: int | None, etag: str, token: str | None, name: str,
                  should_stop: Callable[[], bool] | None = None) -> None:
    """Download ``url`` into ``blob``, resuming a partial file left by an earlier attempt; the content's sha256 is
    checked against ``etag`` when it is one (LFS files). Raises OSError (huggingface_hub's HTTP errors) on
    failure, and InterruptedError as soon as ``should_stop()`` (a server asked to stop): the partial file stays
    for the next attempt."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, tqdm

    check_hub_version()
    blob.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
    start = partial.stat().st_size if partial.exists() else 0
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"
    if start:
        headers["Range"] = f"bytes={start}-"
        logger.info("%s: resuming the download at %.1f MiB", name, start / 2**20)
    with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as response:
        if not (start and response.status_code == 416):  # 416: the partial file is whole already
            if start and response.status_code == 200:  # the server ignored the range: start over
                start = 0
            hf_raise_for_status(response)
            with partial.open("r+b" if start else "wb") as f, tqdm(total=size, initial=start, unit="B",
                                                                  unit_scale=True, desc=name, leave=False) as bar:
                f.seek(start)
                f.truncate()
                for chunk in response.iter_bytes(_CHUNK):
                    f.write(chunk)
                    bar.update(len(chunk))
                    if should_stop is not None and should_stop():
                        raise InterruptedError(f"stopped while downloading {name} (resumed next time)")
    got = partial.stat().st_size
    if size is not None and got != size:
        raise OSError(f"{name}: got {got} of {size} bytes")
    if len(etag) == 64 and _sha256(partial) != etag:
        partial.unlink()
        raise OSError(f"{name}: the content does not match its sha256 {etag[:12]}...; downloaded again next time")
    partial.replace(blob)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_metadata(repo_id: str, filename: str, *, revision: str | None, token: str | None,
                  endpoint: str | None) -> Any:
    """huggingface_hub's metadata of a file (``etag``, ``size``, ``location``), from one ``HEAD`` request."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    return get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint), token=token,
                                endpoint=endpoint)
