"""`AutoDistributedConfig` and `load_preset`: pick the family from a config's ``model_type``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distconf.loader.presets import preset_model_type
from distconf.loader.registry import family_for_model_type, load_family

__all__ = ["AutoDistributedConfig", "load_preset", "read_model_type"]


def read_model_type(name: str, preset: bool = False, kwargs: dict[str, Any] | None = None) -> str:
    """The ``model_type`` of a preset, a local model folder or ``config.json``, or a hub id."""
    if preset:
        return preset_model_type(name)
    kwargs = kwargs or {}
    path = Path(name)
    file = path / "config.json" if path.is_dir() else path
    if file.is_file():
        with file.open(encoding="utf-8") as f:
            data = json.load(f)
    else:
        from transformers import PreTrainedConfig

        hub_kwargs = {k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token") if k in kwargs}
        data, _ = PreTrainedConfig.get_config_dict(name, **hub_kwargs)
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{name}: config has no model_type, cannot choose a family")
    return str(data["model_type"])


class AutoDistributedConfig:
    """Loads the right ``Distributed*Config`` for any supported model."""

    def __init__(self) -> None:
        raise TypeError("use AutoDistributedConfig.from_pretrained(...)")

    @classmethod
    def family_class(cls, model_type: str) -> type:
        """The distributed config class serving ``model_type``."""
        return load_family(family_for_model_type(model_type))

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        """Read ``model_type`` from the config and delegate to that family's ``from_pretrained``."""
        name = os.fspath(model_name_or_path)
        model_type = read_model_type(name, bool(kwargs.get("preset")), kwargs)
        return cls.family_class(model_type).from_pretrained(model_name_or_path, *args, **kwargs)


def load_preset(hub_id: str, **kwargs: Any) -> Any:
    """Load a shipped preset (a real model's ``config.json``) as its family's distributed config."""
    return AutoDistributedConfig.from_pretrained(hub_id, preset=True, **kwargs)
