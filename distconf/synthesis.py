"""Synthesis of a ``Distributed<Name>Config`` class from a validated family file.

The class is built with ``type(...)`` from the family's Hugging Face config class and
the three mixins (revision pinning first when the family pins revisions). It is
indistinguishable from a hand-written one: real subclass of the HF class, same
``model_type``, HF ``from_pretrained``/``save_pretrained``, pickling by module and
name through `distconf.classes`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import typing
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from distconf.dhtprefix import derive_dht_prefix
from distconf.errors import ConfigValueError, FamilyValidationError
from distconf.formula import Formula, FormulaError
from distconf.loader import FamilySource
from distconf.mixins import (
    FIELD_CHECKS,
    ClientConfig,
    LMHeadConfig,
    PinnedRevisionMixin,
    PTuneConfig,
    check_cross_fields,
)
from distconf.spec import FamilySpec
from distconf.spec_types import FORMULA_MARKER

__all__ = [
    "synthesize_config_class", "resolve_source", "import_object", "import_class", "iter_formulas",
    "LazyClassAttribute",
]

logger = logging.getLogger("distconf.notices")


def import_object(path: str) -> Any:
    """Import ``package.module.name`` (a class or function; the path was checked against trusted prefixes)."""
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"cannot import {path}: {exc}") from None


def import_class(path: str) -> type:
    """Import a class by dotted path; `ImportError` if it is missing or not a class."""
    obj = import_object(path)
    if not isinstance(obj, type):
        raise ImportError(f"{path} is not a class")
    return obj


class LazyClassAttribute:
    """Class attribute computed on first access (e.g. an imported class), then cached."""

    def __init__(self, name: str, resolve: Callable[[type], Any]) -> None:
        self.name = name
        self.resolve = resolve

    def __get__(self, instance: Any, owner: type) -> Any:
        value = self.resolve(owner)
        # Replace the descriptor on the class that declared it: later reads are plain lookups.
        for klass in owner.__mro__:
            if klass.__dict__.get(self.name) is self:
                setattr(klass, self.name, value)
                break
        return value


def _has_formula_marker(annotation: Any) -> bool:
    if typing.get_origin(annotation) is typing.Annotated:
        if any(m is FORMULA_MARKER for m in annotation.__metadata__):
            return True
        return _has_formula_marker(typing.get_args(annotation)[0])
    return any(_has_formula_marker(arg) for arg in typing.get_args(annotation))


def iter_formulas(model: BaseModel, loc: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Every formula written in a spec, with its field path."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        here = (*loc, name)
        annotated = any(m is FORMULA_MARKER for m in info.metadata) or _has_formula_marker(info.annotation)
        if annotated and isinstance(value, str):
            yield here, value
        elif isinstance(value, BaseModel):
            yield from iter_formulas(value, here)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from iter_formulas(item, (*here, i))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, BaseModel):
                    yield from iter_formulas(item, (*here, key))
                elif annotated and isinstance(item, str):
                    yield (*here, key), item


def _resolve(source: FamilySource, loc: tuple[str, ...], path: str) -> type:
    try:
        return import_class(path)
    except ImportError as exc:
        raise source.error(loc, str(exc)) from None


def _check_names(source: FamilySource, config_class: type) -> Any:
    """Check formula names and fix-up fields against a default instance of the base config."""
    # Some HF defaults are inconsistent (token ids outside the default vocabulary) and
    # transformers warns about them; this probe instance is never used for anything else.
    hf_logger = logging.getLogger("transformers")
    previous = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        default = config_class()
    except Exception as exc:
        raise source.error(("config_class",), f"{config_class.__name__}() cannot be built: {exc}") from None
    finally:
        hf_logger.setLevel(previous)
    problems = []
    for loc, text in iter_formulas(source.spec):
        for name in sorted(Formula(text).names):
            if not hasattr(default, name):
                problems.append(source.problem(
                    loc, f"formula {text!r} uses {name!r}, which is not a field of {config_class.__name__}"))
    for section in ("defaults", "set"):
        for name in getattr(source.spec.after_load, section):
            if not hasattr(default, name):
                problems.append(source.problem(
                    ("after_load", section, name), f"{name!r} is not a field of {config_class.__name__}"))
    if problems:
        raise FamilyValidationError(problems)
    return default


def _kv_groups_attribute(spec: FamilySpec) -> Any:
    if isinstance(spec.kv_groups, int):
        return spec.kv_groups
    formula = Formula(spec.kv_groups)
    family = spec.family

    def num_key_value_groups(self: Any) -> int:
        """Query heads per KV head, from the family's ``kv_groups`` formula."""
        try:
            value = formula.evaluate_on(self)
        except FormulaError as exc:
            raise ConfigValueError(f"family {family!r}: kv_groups: {exc}") from None
        heads = getattr(self, "num_attention_heads", None)
        if (isinstance(value, bool) or not isinstance(value, int) or value < 1
                or not isinstance(heads, int) or heads % value):
            shown = ", ".join(f"{k}={v!r}" for k, v in formula.values_on(self).items())
            raise ConfigValueError(
                f"family {family!r}: kv_groups formula {formula.source!r} gave {value!r} with {shown}; "
                f"expected a positive integer dividing num_attention_heads={heads!r}"
            )
        return value

    return property(num_key_value_groups)


def _notice_applies(notice: Any, name: str) -> bool:
    return notice.when_name_contains is None or notice.when_name_contains.lower() in name.lower()


def _block_class(cls: type) -> type:
    try:
        blocks = importlib.import_module("distconf.blocks")
    except ImportError:
        blocks = None
    if blocks is not None and hasattr(blocks, "make_block_class"):
        return blocks.make_block_class(cls)
    return import_class(cls.family_spec.block.layer_class)  # type: ignore[attr-defined]


def synthesize_config_class(source: FamilySource) -> type:
    """Build the distributed config class described by ``source``."""
    spec = source.spec
    config_class = _resolve(source, ("config_class",), spec.config_class)
    from transformers import PreTrainedConfig

    if not issubclass(config_class, PreTrainedConfig):
        raise source.error(("config_class",), f"{spec.config_class} is not a transformers config class")
    if getattr(config_class, "model_type", None) != spec.model_type:
        raise source.error(
            ("model_type",),
            f"{spec.config_class} has model_type {config_class.model_type!r}, not {spec.model_type!r}",
        )
    is_dc = dataclasses.is_dataclass(config_class)
    base_fields = {f.name for f in dataclasses.fields(config_class)} if is_dc else set()
    if "num_key_value_groups" in base_fields:
        raise source.error(("kv_groups",), f"{spec.config_class} already has a num_key_value_groups field")
    _check_names(source, config_class)

    bases: tuple[type, ...] = (config_class, ClientConfig, PTuneConfig, LMHeadConfig)
    if spec.revisions:
        bases = (PinnedRevisionMixin, *bases)

    holder: dict[str, type] = {}

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if name in FIELD_CHECKS:
            FIELD_CHECKS[name](name, value)
        super(holder["cls"], self).__setattr__(name, value)

    def __post_init__(self: Any, **kwargs: Any) -> None:
        super(holder["cls"], self).__post_init__(**kwargs)
        check_cross_fields(self)

    def __reduce__(self: Any) -> tuple[Any, ...]:
        from distconf.classes import _restore_config

        return _restore_config, (type(self).__name__, str(type(self).family_source)), self.__dict__.copy()

    def from_pretrained(cls: type, model_name_or_path: str | os.PathLike[str], *args: Any,
                        dht_prefix: str | None = None, preset: bool = False, **kwargs: Any) -> Any:
        """Load like the HF config, then apply the family's DHT prefix rule and fix-ups.

        ``dht_prefix`` defaults to one derived from the hub id (a local directory keeps
        the prefix its ``config.json`` holds). With ``preset=True`` the config values
        come from the copy shipped with distconf instead of the hub (offline).
        """
        name = os.fspath(model_name_or_path)
        is_local = os.path.isdir(name) or os.path.isfile(name)
        load_from: Any = model_name_or_path
        if preset:
            from distconf.presets import preset_path

            if is_local:
                raise ValueError(f"preset=True needs a hub id, not the local path {name!r}")
            load_from = str(preset_path(name))
            kwargs.pop("revision", None)
        if dht_prefix is None and not is_local:
            dht_prefix = derive_dht_prefix(spec.dht_prefix, name)
        if dht_prefix is not None:
            kwargs["dht_prefix"] = dht_prefix
        for notice in spec.notices:
            if _notice_applies(notice, name):
                logger.log(logging.WARNING if notice.level == "warning" else logging.INFO, notice.message)
        result = super(holder["cls"], cls).from_pretrained(load_from, *args, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        for field_name, value in spec.after_load.defaults.items():
            if getattr(config, field_name, None) is None:
                setattr(config, field_name, value)
        for field_name, value in spec.after_load.set.items():
            setattr(config, field_name, value)
        if preset:
            config._name_or_path = name
        check_cross_fields(config)
        return result

    namespace: dict[str, Any] = {
        "__module__": "distconf.classes",
        "__qualname__": spec.class_name,
        "__doc__": f"Distributed config of the {spec.family!r} family ({source.path.name}), "
                   f"synthesized from {spec.config_class}.",
        "family_spec": spec,
        "family_source": source.path,
        "block_prefix": spec.block.prefix,
        "attn_class": LazyClassAttribute(
            "attn_class", lambda owner: _resolve(source, ("block", "attention_class"), spec.block.attention_class)),
        "block_class": LazyClassAttribute("block_class", _block_class),
        "num_key_value_groups": _kv_groups_attribute(spec),
        "__setattr__": __setattr__,
        "__post_init__": __post_init__,
        "__reduce__": __reduce__,
        "from_pretrained": classmethod(from_pretrained),
    }
    if spec.revisions:
        namespace["pinned_revisions"] = dict(spec.revisions)
    cls = type(spec.class_name, bases, namespace)
    holder["cls"] = cls
    return cls


def resolve_source(source: FamilySource) -> type:
    """Synthesize (uncached) and import every class a family names; for ``validate --resolve``.

    Raises `FamilyValidationError` naming the field whose class or formula is wrong.
    """
    cls = synthesize_config_class(source)
    problems = []
    for loc, path in ((("block", "layer_class"), source.spec.block.layer_class),
                      (("block", "attention_class"), source.spec.block.attention_class)):
        try:
            import_class(path)
        except ImportError as exc:
            problems.append(source.problem(loc, str(exc)))
    if problems:
        raise FamilyValidationError(problems)
    return cls
