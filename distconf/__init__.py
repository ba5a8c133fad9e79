"""distconf: declarative model-family configs for peer-to-peer LLM inference.

One YAML file per model family describes what a Petals-style swarm needs beyond the
Hugging Face config; `load_family` turns it into a ``Distributed<Name>Config`` class.
Importing this package does not import torch or transformers.

The package is layered, each layer importing only the ones before it; the order is written once, in
docs/design.md (the layering test reads it there).
"""

from __future__ import annotations

from distconf.errors import ConfigValueError, FamilyNotFoundError, FamilyValidationError
from distconf.loader.auto import AutoDistributedConfig, load_preset
from distconf.loader.registry import get_family_spec, load_family
from distconf.loader.search import list_families, validate_paths

__version__ = "0.1.0"

__all__ = [
    "AutoDistributedConfig", "ConfigValueError", "FamilyNotFoundError", "FamilyValidationError",
    "get_family_spec", "list_families", "load_family", "load_preset", "validate_paths", "__version__",
]
