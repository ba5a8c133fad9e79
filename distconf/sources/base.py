"""`ModelSource`: a servable model (config, tokenizer, safetensors folder) and `open_checkpoint`, its checks.

Every kind of source (a folder, a GGUF file, a hub id) ends as a local safetensors folder
that `distconf.blocks.weights` reads by prefix; `open_checkpoint` checks that folder once
(family, weights, every layer's tensors, DHT prefix) and turns each problem into one
`ModelSourceError` naming the source.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distconf.blocks.checkpoint import BlockWeightsError, Checkpoint
from distconf.blocks.weights import layer_keys, load_block_weights
from distconf.errors import ConfigValueError, FamilyNotFoundError, FamilyValidationError, ModelSourceError
from distconf.loader.auto import AutoDistributedConfig
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import check_dht_prefix, config_num_blocks, derive_dht_prefix
from distconf.sources.hub_fetch import HubFetcher

if TYPE_CHECKING:
    import torch

__all__ = ["ModelSource", "TOKENIZER_FILES", "has_tokenizer", "load_tokenizer", "open_checkpoint", "resolve_prefix"]

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a folder means it holds a tokenizer."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class ModelSource:
    """One model ready to serve: its distributed config, its tokenizer, and its safetensors folder.

    ``name`` is what the user named; ``kind`` is ``"folder"``, ``"gguf"`` or ``"hub"``;
    ``origin`` the folder, GGUF file or hub snapshot it came from; ``checkpoint_dir`` the
    folder `distconf.blocks.weights` reads (for a GGUF, the converted copy in the cache).
    ``config`` is the family's distributed config, with ``dht_prefix`` resolved.
    """

    name: str
    kind: str
    origin: Path
    checkpoint_dir: Path
    config: DistributedConfig
    hub: HubFetcher | None = None
    """For a hub id: fetches the files a server's blocks or a client need, on demand (None: all files are here)."""

    @property
    def dht_prefix(self) -> str:
        """Prefix of the model's block uids on the DHT."""
        return str(self.config.dht_prefix)

    @property
    def model_type(self) -> str:
        """The config's ``model_type``."""
        return str(self.config.model_type)

    @property
    def family_class(self) -> type:
        """The family's synthesized distributed config class."""
        return type(self.config)

    def load_config(self, **kwargs: Any) -> Any:
        """A fresh distributed config (same ``dht_prefix``); ``kwargs`` override config fields."""
        kwargs.setdefault("dht_prefix", self.dht_prefix)
        return self.family_class.from_pretrained(str(self.checkpoint_dir), local_files_only=True, **kwargs)

    @property
    def has_tokenizer(self) -> bool:
        """Whether the folder holds a tokenizer."""
        return has_tokenizer(self.checkpoint_dir)

    def load_tokenizer(self) -> Any | None:
        """The model's tokenizer (``AutoTokenizer``, local files only), or None when it has none."""
        return load_tokenizer(self.name, self.checkpoint_dir)

    def load_block_weights(self, layer_idx: int, *, dtype: torch.dtype | None = None,
                           **kwargs: Any) -> dict[str, torch.Tensor]:
        """The state dict of block ``layer_idx`` (see `distconf.blocks.weights.load_block_weights`)."""
        return load_block_weights(self.checkpoint_dir, self.config, layer_idx, dtype=dtype, **kwargs)


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer (any of `TOKENIZER_FILES`)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(name: str, folder: Path) -> Any | None:
    """The tokenizer in ``folder`` (``AutoTokenizer``, local files only), or None when it has none.

    A broken one is a `ModelSourceError` naming the source ``name``.
    """
    if not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise ModelSourceError(name, f"its tokenizer cannot be loaded ({_brief(exc)})") from None

def _brief(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_config_json(name: str, folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict with a ``model_type``, else `ModelSourceError`."""
    file = folder / "config.json"
    if not file.is_file():
        raise ModelSourceError(name, f"{folder} holds no config.json")
    try:
        with file.open("rb") as f:
            data = json.loads(f.read(_MAX_CONFIG_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelSourceError(name, f"{file} is not valid JSON ({_brief(exc)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelSourceError(name, f"{file} has no model_type: the architecture is unknown")
    return data


def family_class_for(name: str, model_type: str) -> type:
    """The synthesized config class of the family serving ``model_type``, else `ModelSourceError`."""
    try:
        return AutoDistributedConfig.family_class(model_type)
    except FamilyNotFoundError:
        raise ModelSourceError(name, f"unsupported architecture: no family file serves model_type "
                                     f"{model_type[:80]!r}") from None
    except FamilyValidationError as exc:
        raise ModelSourceError(name, f"the family file for model_type {model_type!r} is invalid: {exc}") from None


def prefix_name(data: dict[str, Any], folder: Path) -> str:
    """The name the family's DHT-prefix rule derives from: a hub-id ``_name_or_path``, else the folder name."""
    named = data.get("_name_or_path")
    if isinstance(named, str) and _HUB_ID.match(named) and not Path(named).exists():
        return named
    return folder.resolve().name


def resolve_prefix(name: str, cls: type, data: dict[str, Any], explicit: str | None, derive_from: str) -> str | None:
    """``dht_prefix`` to pass: the explicit one, else None (config.json has one), else derived."""
    try:
        if explicit is not None:
            return check_dht_prefix(explicit)
        if data.get("dht_prefix"):
            return None
        return derive_dht_prefix(cls.family_spec.dht_prefix, derive_from)
    except ConfigValueError as exc:
        how = "" if explicit is not None else f" (derived from {derive_from!r})"
        raise ModelSourceError(name, f"no usable DHT prefix{how}: {exc}; pass dht_prefix=...") from None


def _check_weights(name: str, folder: Path, config: DistributedConfig) -> None:
    try:
        with Checkpoint(folder) as checkpoint:
            names = list(checkpoint.names)
    except FileNotFoundError:
        other = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))[:3]
        hint = f" (it has {', '.join(other)}: only safetensors are served)" if other else ""
        raise ModelSourceError(name, f"no weights: {folder} holds neither model.safetensors nor "
                                     f"model.safetensors.index.json{hint}") from None
    except BlockWeightsError as exc:
        raise ModelSourceError(name, f"its weights cannot be read: {exc}") from None
    missing = [i for i in range(config_num_blocks(config))
               if layer_keys(names, config, model_layer(config, i))[0] is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ModelSourceError(name, f"missing tensors: no tensors of block(s) {shown} of "
                                     f"{config_num_blocks(config)} under {type(config).family_spec.block.prefix!r}")


def open_checkpoint(name: str, kind: str, origin: Path, folder: Path, *, dht_prefix: str | None = None,
                    derive_from: str | None = None, hub: HubFetcher | None = None) -> ModelSource:
    """Check a local safetensors folder and return it as a `ModelSource`.

    ``dht_prefix`` overrides any prefix; without it ``config.json``'s ``dht_prefix`` is
    kept, else one is derived by the family's rule from ``derive_from`` (default: a
    hub-id ``_name_or_path`` in ``config.json``, else the folder's name).
    """
    data = read_config_json(name, folder)
    cls = family_class_for(name, data["model_type"])
    prefix = resolve_prefix(name, cls, data, dht_prefix, derive_from or prefix_name(data, folder))
    kwargs = {} if prefix is None else {"dht_prefix": prefix}
    try:
        config = cls.from_pretrained(str(folder), local_files_only=True, **kwargs)
        config_num_blocks(config)
    except (ConfigValueError, ValueError, TypeError, OSError) as exc:
        raise ModelSourceError(name, f"its config.json cannot be used: {_brief(exc)}") from None
    _check_weights(name, folder, config)
    logger.info("model source %s (%s): %s, %d blocks, dht_prefix %s", name, kind, type(config).__name__,
                config_num_blocks(config), config.dht_prefix)
    return ModelSource(name=name, kind=kind, origin=origin, checkpoint_dir=folder, config=config, hub=hub)
