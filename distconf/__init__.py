"""distconf: declarative model-family configs for peer-to-peer LLM inference.

One YAML file per model family describes what a Petals-style swarm needs beyond the
Hugging Face config; `load_family` turns it into a ``Distributed<Name>Config`` class.
Importing this package does not import torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distconf.errors import ConfigValueError, FamilyNotFoundError, FamilyValidationError
from distconf.loader import get_family_spec, list_families, load_family, validate_paths

__version__ = "0.1.0"

__all__ = [
    "AutoDistributedConfig", "ConfigValueError", "FamilyNotFoundError", "FamilyValidationError",
    "get_family_spec", "list_families", "load_family", "load_preset", "validate_paths", "__version__",
]

if TYPE_CHECKING:
    from distconf.auto import AutoDistributedConfig
    from distconf.presets import load_preset


def __getattr__(name: str) -> Any:
    if name == "AutoDistributedConfig":
        from distconf.auto import AutoDistributedConfig

        return AutoDistributedConfig
    if name == "load_preset":
        from distconf.presets import load_preset

        return load_preset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
