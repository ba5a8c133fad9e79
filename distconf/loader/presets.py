"""Presets: real models' ``config.json`` files shipped with distconf, for offline use.

A preset is named by its hub id (``org/name``) and stored as
``presets/<org>--<name>.json``. Loading one (`distconf.load_preset`) goes through the
family class's ``from_pretrained`` with ``preset=True``, so the hub-id DHT-prefix rules,
fix-ups and notices apply exactly as for a download.
"""

from __future__ import annotations

import json
from pathlib import Path

from distconf.errors import FamilyNotFoundError
from distconf.loader.data import presets_dir

__all__ = ["list_presets", "preset_path", "preset_model_type"]


def _file_name(hub_id: str) -> str:
    return hub_id.replace("/", "--") + ".json"


def list_presets() -> list[str]:
    """Hub ids of all shipped presets, sorted."""
    return sorted(p.name[: -len(".json")].replace("--", "/", 1) for p in presets_dir().glob("*.json"))


def preset_path(hub_id: str) -> Path:
    """Path of the shipped ``config.json`` of ``hub_id``."""
    path = presets_dir() / _file_name(hub_id)
    if not path.is_file():
        raise FamilyNotFoundError(f"no preset named {hub_id!r}; presets: {', '.join(list_presets())}")
    return path


def preset_model_type(hub_id: str) -> str:
    """The ``model_type`` written in a preset."""
    with preset_path(hub_id).open(encoding="utf-8") as f:
        return str(json.load(f)["model_type"])
