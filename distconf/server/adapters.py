"""The LoRA adapters a server serves beside its blocks (``distconf serve --adapters``, Petals' flag).

Each argument is a PEFT adapter folder, a hub id (only the adapter's two files are fetched, into the Hugging Face
cache) or ``NAME=SOURCE`` to announce it under a name of your choosing. The name a client asks for with
``active_adapter`` is the argument itself (Petals' rule: the hub id), or ``NAME``. Every adapter is read and checked
before any block is loaded (`distconf.blocks.lora.read_lora`), and attached to each block as it is loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distconf.blocks.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    LoraAdapter,
    attach,
    lora_bytes_per_block,
    read_lora,
)
from distconf.loader.layer_stack import model_layer
from distconf.sources.hub_fetch import hub_offline

__all__ = ["AdapterSource", "ServedAdapters", "parse_adapters"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSource:
    """One ``--adapters`` argument: the name it is served under and where it comes from."""

    name: str
    source: str

    def folder(self, *, revision: str | None = None, token: str | None = None, cache_dir: str | None = None) -> Path:
        """The adapter's folder: as given, or its two files fetched from the hub (the cache when offline)."""
        path = Path(self.source).expanduser()
        if path.is_dir():
            return path
        if path.exists() or self.source.count("/") != 1 or self.source.startswith((".", "/", "~")):
            raise AdapterError(f"adapter {self.name!r}: {self.source} is not an adapter folder or a hub id")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return Path(snapshot_download(self.source, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS],
                                          revision=revision, token=token, cache_dir=cache_dir,
                                          endpoint=os.environ.get("HF_ENDPOINT") or None,
                                          local_files_only=hub_offline()))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
            raise AdapterError(f"adapter {self.name!r}: {self.source} could not be fetched from the hub "
                               f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def parse_adapters(arguments: Sequence[str]) -> list[AdapterSource]:
    """``--adapters`` arguments as sources (``NAME=SOURCE`` or ``SOURCE``, served as given); a name given twice
    is an `AdapterError`."""
    sources = []
    for argument in arguments:
        name, sep, source = argument.partition("=")
        sources.append(AdapterSource(name, source) if sep and name and source else AdapterSource(argument, argument))
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise AdapterError(f"adapter name {twice[0]!r} is given twice in --adapters")
    return sources


class ServedAdapters:
    """The adapters of one server: read for its span before loading, attached to each block once loaded."""

    def __init__(self, sources: Sequence[AdapterSource], config: Any, dtype: Any, **hub: Any) -> None:
        self.sources, self.config, self.dtype, self.hub = list(sources), config, dtype, hub
        self.adapters: list[LoraAdapter] = []
        self._read_for: tuple[int, int] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The names requests may ask for (``active_adapter``), as announced in the server's record."""
        return tuple(s.name for s in self.sources)

    def bytes_per_block(self) -> int:
        """Bytes every adapter together holds for one block (its largest layer), for the planner."""
        return sum(lora_bytes_per_block(s.folder(**self.hub), self.config, self.dtype) for s in self.sources)

    def read(self, start: int, end: int) -> int:
        """Read and check every adapter for blocks ``start..end-1``; returns the bytes they hold.

        :raises AdapterError: the first adapter that cannot be served, and why.
        """
        layers = [model_layer(self.config, i) for i in range(start, end)]
        self.adapters = [read_lora(s.folder(**self.hub), s.name, self.config, layers, self.dtype) for s in self.sources]
        self._read_for = (start, end)
        nbytes = sum(a.nbytes for a in self.adapters)
        for adapter in self.adapters:
            logger.info("adapter %s: LoRA r=%d on %s, %.2f MiB for blocks %d..%d", adapter.name, adapter.rank,
                        ", ".join(adapter.target_modules) or "?", adapter.nbytes / 2**20, start, end - 1)
        return nbytes

    def digests(self, start: int, end: int) -> dict[str, list[str]]:
        """``{adapter name: [sha256 of its tensors for each block start..end-1]}`` (announced as
        ``adapter_sha256``; `distconf manifest --adapters` lists the same)."""
        if not self.sources:
            return {}
        if self._read_for is None or not self._read_for[0] <= start <= end <= self._read_for[1]:
            self.read(start, end)
        return {a.name: [a.digests[model_layer(self.config, i)] for i in range(start, end)] for a in self.adapters}

    def attach(self, modules: Sequence[Any], start: int) -> None:
        """Attach every adapter to ``modules`` (blocks ``start..``): `AdapterError` when one does not fit."""
        if not self.sources:
            return
        if self._read_for is None or not self._read_for[0] <= start <= start + len(modules) <= self._read_for[1]:
            self.read(start, start + len(modules))
        for adapter in self.adapters:
            for i, module in enumerate(modules):
                attach(adapter, module, model_layer(self.config, start + i))
