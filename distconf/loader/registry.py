"""The registry of synthesized classes: the class cache, and the module they live in.

`load_family` synthesizes a family's ``Distributed<Name>Config`` once and caches it
(thread-safe; later calls cost a dict lookup). Every synthesized class has this module
as its ``__module__``: looking a class up here by name (which is what pickle does)
synthesizes it on demand, so configs unpickle in a fresh process too.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from distconf.errors import FamilyNotFoundError, FamilyValidationError
from distconf.loader.search import (
    FAMILIES_PATH_ENV,
    family_search_path,
    find_family_file,
    is_family_path,
    scan_valid_sources,
)
from distconf.loader.source import FamilySource, read_family_file
from distconf.loader.spec import FamilySpec

__all__ = [
    "load_family", "get_family_spec", "family_for_model_type", "load_family_by_class_name", "clear_cache",
    "restore_config",
]

_lock = threading.RLock()
_classes: dict[str, type] = {}  # family name, file path or class name -> class
_sources: dict[str, FamilySource] = {}  # family name -> source
# model type -> family, scanned from the search path in the key (the path can change at run time)
_model_types: tuple[tuple[str, ...], dict[str, str]] | None = None


def _source_for(name_or_path: str | os.PathLike[str]) -> FamilySource:
    if is_family_path(name_or_path):
        return read_family_file(name_or_path)
    return read_family_file(find_family_file(os.fspath(name_or_path)))


def get_family_spec(name_or_path: str | os.PathLike[str]) -> FamilySpec:
    """The validated `FamilySpec` of a family (by name or file path)."""
    cls = _classes.get(os.fspath(name_or_path))
    if cls is not None:
        return cls.family_spec  # type: ignore[attr-defined]
    return _source_for(name_or_path).spec


def load_family(name_or_path: str | os.PathLike[str]) -> type:
    """The synthesized ``Distributed<Name>Config`` class of a family.

    ``name_or_path`` is a family name on the search path (such as ``"my_family"``) or the path
    of a family file. The class is synthesized once and cached: every later call
    (from any thread) returns the same object.
    """
    key = os.fspath(name_or_path)
    cls = _classes.get(key)
    if cls is not None:
        return cls
    with _lock:
        cls = _classes.get(key)
        if cls is not None:
            return cls
        source = _source_for(name_or_path)
        family = source.spec.family
        known = _sources.get(family)
        if known is not None and known.path != source.path:
            raise FamilyValidationError([
                source.problem(("family",), f"family {family!r} is already loaded from {known.path}"),
            ])
        cls = _classes.get(family) if known is not None else None
        if cls is None:
            from distconf.loader.synthesis import synthesize_config_class

            cls = synthesize_config_class(source, module=__name__)
            _sources[family] = source
            _classes[family] = cls
            _classes[cls.__name__] = cls
            _classes[str(source.path)] = cls
        _classes[key] = cls
        return cls


def family_for_model_type(model_type: str) -> str:
    """The family serving HF ``model_type`` (for `AutoDistributedConfig`)."""
    global _model_types
    search_path = tuple(str(folder) for folder in family_search_path())
    with _lock:
        if _model_types is None or _model_types[0] != search_path:
            mapping: dict[str, str] = {}
            for source in scan_valid_sources():
                mapping.setdefault(source.spec.model_type, source.spec.family)
            _model_types = (search_path, mapping)
        mapping = _model_types[1]
    if model_type not in mapping:
        known = ", ".join(f"{fam} ({mt})" for mt, fam in sorted(mapping.items(), key=lambda kv: kv[1]))
        raise FamilyNotFoundError(
            f"no family serves model_type {model_type!r}; known families: {known}. "
            f"Add a family file (see docs/adding-a-family.md) to a folder in {FAMILIES_PATH_ENV}."
        )
    return mapping[model_type]


def load_family_by_class_name(class_name: str) -> type:
    """Load the family whose synthesized class is named ``class_name`` (used by pickle)."""
    cls = _classes.get(class_name)
    if cls is not None:
        return cls
    for source in scan_valid_sources():
        if source.spec.class_name == class_name:
            return load_family(source.spec.family)
    raise FamilyNotFoundError(f"no family on the search path synthesizes {class_name}")


def clear_cache() -> None:
    """Forget every synthesized class (for tests and for reloading edited files)."""
    global _model_types
    with _lock:
        _classes.clear()
        _sources.clear()
        _model_types = None


def restore_config(class_name: str, source: str | None) -> Any:
    """Unpickling helper: an empty instance of the named class (its state is set after)."""
    try:
        cls = load_family_by_class_name(class_name)
    except LookupError:
        if source is None:
            raise
        cls = load_family(source)
    return cls.__new__(cls)


def __getattr__(name: str) -> Any:
    """Synthesize ``Distributed<Name>Config`` on lookup (so pickle finds the classes)."""
    if name.startswith("Distributed") and name.endswith("Config"):
        return load_family_by_class_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
