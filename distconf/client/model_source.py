"""What the client reads a model from: any model source, down to one local folder and a DHT prefix.

The client needs a model's config, its non-block tensors (embeddings, final norm, LM head,
trained prompts) and its tokenizer, never its blocks. `open_client_source` accepts every
source `distconf.sources.open_source` does (a Hugging Face folder as it is, a ``.gguf``
file or a folder holding one, a hub id in the local Hugging Face cache) and returns the
safetensors folder to read (for a GGUF, the converted copy in the cache) with the DHT
prefix to use. A folder with a ``config.json`` is read as it is, without the check that
every block's tensors are there: a folder written by the client's ``save_pretrained``
(trained prompts, no blocks) is a client source too. The prefix follows the sources' one
rule (`distconf.sources.base.resolve_prefix`): the explicit one, else ``config.json``'s,
else derived by the family's rule. Every problem is a `ModelSourceError`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distconf.sources import ModelSource, open_source
from distconf.sources.base import (
    family_class_for,
    has_tokenizer,
    load_tokenizer,
    prefix_name,
    read_config_json,
    resolve_prefix,
)
from distconf.sources.hub_fetch import HubOptions

__all__ = ["ClientSource", "open_client_source"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientSource:
    """A model as the client reads it: ``folder`` (``config.json``, safetensors, maybe a tokenizer).

    ``name`` is what the user named; ``dht_prefix`` the prefix to pass to the config, or
    None when ``config.json``'s own is used.
    """

    name: str
    folder: Path
    dht_prefix: str | None

    @property
    def has_tokenizer(self) -> bool:
        """Whether the folder holds a tokenizer."""
        return has_tokenizer(self.folder)

    def load_tokenizer(self) -> Any | None:
        """The model's tokenizer (``AutoTokenizer``, local files only), or None when the folder has none."""
        return load_tokenizer(self.name, self.folder)

    def config_kwargs(self) -> dict[str, Any]:
        """The config fields this source sets (``dht_prefix`` when it is not ``config.json``'s)."""
        return {} if self.dht_prefix is None else {"dht_prefix": self.dht_prefix}


def _from_folder(name: str, folder: Path, dht_prefix: str | None) -> ClientSource:
    data = read_config_json(name, folder)
    cls = family_class_for(name, data["model_type"])
    return ClientSource(name, folder, resolve_prefix(name, cls, data, dht_prefix, prefix_name(data, folder)))


def open_client_source(model: str | os.PathLike[str] | ModelSource | ClientSource, *,
                       dht_prefix: str | None = None, revision: str | None = None,
                       cache_dir: str | os.PathLike[str] | None = None,
                       hub_cache_dir: str | os.PathLike[str] | None = None,
                       hub: HubOptions | None = None) -> ClientSource:
    """The folder and DHT prefix the client reads ``model`` from.

    :param model: a model folder (``config.json`` and safetensors, ``dht_prefix`` optional;
        or one written by ``save_pretrained``), a ``.gguf`` file or a folder holding one, a
        hub id in the local Hugging Face cache, or an already opened `ModelSource` / `ClientSource`.
    :param dht_prefix: overrides the prefix of ``config.json`` or the derived one.
    :param revision: hub ids only; :param cache_dir: where GGUF files are converted to;
        :param hub_cache_dir: the Hugging Face cache (see `distconf.sources.open_source`); :param hub: a hub id's
        revision, token, cache and disk budget (wins over ``revision`` and ``hub_cache_dir``). A hub id is
        downloaded in the client's part only: config, tokenizer and the shards outside the blocks.
    """
    if isinstance(model, ClientSource):
        return model if dht_prefix is None else ClientSource(model.name, model.folder, dht_prefix)
    if isinstance(model, ModelSource):
        return _client_part(model, dht_prefix)
    name = os.fspath(model)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        source = _from_folder(name, path, dht_prefix)
    else:
        opened = open_source(name, dht_prefix=dht_prefix, revision=revision, cache_dir=cache_dir,
                             hub_cache_dir=hub_cache_dir, hub=hub)
        source = _client_part(opened, None)
    logger.info("client model source %s: %s, dht_prefix %s", name, source.folder,
                source.dht_prefix or "from config.json")
    return source


def _client_part(source: ModelSource, dht_prefix: str | None) -> ClientSource:
    """``source`` as the client reads it; a hub source fetches the client's files first (never its blocks)."""
    if source.hub is not None:
        source.hub.fetch_client(source.config)
    return ClientSource(source.name, source.checkpoint_dir, dht_prefix or source.dht_prefix)
