"""Synthesis of a ``Distributed<Name>Config`` class from a validated family file.

The class is built with ``type(...)`` with exactly the bases of a hand-written Petals
config: the family's Hugging Face config class, then `ClientConfig`, `PTuneConfig` and
`LMHeadConfig` (with `PinnedRevisionMixin` first when the family pins revisions). It is
a real subclass of the HF class with the same ``model_type``, loads and saves like it,
and pickles by module and name (`distconf.loader.registry` is its home).

The class carries its own validated `FamilySource` (``cls.family_source``), so any
layer can report a problem at its line in the family file with
``cls.family_source.error(loc, message)``, without going back to the loader.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from distconf.errors import ConfigValueError, FamilyValidationError
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import Formula
from distconf.loader.layer_section import section_namespace, sectioned_config_class
from distconf.loader.mixins import (
    ClientConfig,
    LMHeadConfig,
    PinnedRevisionMixin,
    PTuneConfig,
    check_cross_fields,
    check_field,
)
from distconf.loader.naming import derive_dht_prefix
from distconf.loader.per_layer import per_layer_attributes
from distconf.loader.presets import preset_path
from distconf.loader.source import FamilySource
from distconf.loader.spec import FamilySpec
from distconf.loader.wire_layout import wire_width_of

__all__ = [
    "synthesize_config_class", "resolve_source", "import_object", "import_class", "resolve_object", "iter_formulas",
    "LazyClassAttribute", "SynthesizedConfigMethods",
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


def resolve_object(source: FamilySource, loc: tuple[str, ...], path: str, *, want_class: bool = False) -> Any:
    """Import what the family file names at field ``loc`` (a class if ``want_class``); errors point at that field.

    The one way every layer resolves a family file's (trusted) dotted path: a failure is
    raised as ``source.error(loc, ...)``, located at the field's line.
    """
    try:
        return import_class(path) if want_class else import_object(path)
    except ImportError as exc:
        raise source.error(loc, str(exc)) from None


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


def iter_formulas(model: BaseModel, loc: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Formula]]:
    """Every formula of a spec, with its field path (formula fields hold compiled `Formula` objects)."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        here = (*loc, name)
        items: Any = ()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        for key, item in [(None, value), *items]:
            where = here if key is None else (*here, key)
            if isinstance(item, Formula):
                yield where, item
            elif isinstance(item, BaseModel):
                yield from iter_formulas(item, where)


def _check_names(source: FamilySource, config_class: type) -> None:
    """Check formula names and fix-up fields against a default instance of the base config."""
    # Some HF defaults are inconsistent (token ids outside the default vocabulary) and
    # transformers warns about them; this probe instance is never used for anything else.
    from transformers import PreTrainedConfig

    hf_logger = logging.getLogger("transformers")
    previous = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    stack = source.spec.block.config_section
    try:
        default = (sectioned_config_class(config_class, stack) if stack else config_class)()
    except Exception as exc:
        raise source.error(("config_class",), f"{config_class.__name__}() cannot be built: {exc}") from None
    finally:
        hf_logger.setLevel(previous)
    problems = []
    per_layer = per_layer_attributes(default)  # held per layer by a heterogeneous config: fields all the same
    for loc, formula in iter_formulas(source.spec):
        for name in sorted(formula.names):
            if name not in per_layer and not hasattr(default, name):
                problems.append(source.problem(
                    loc, f"formula {formula.source!r} uses {name!r}, which is not a field of {config_class.__name__}"))
    for section in ("defaults", "set"):
        for name in getattr(source.spec.after_load, section):
            if not hasattr(default, name):
                problems.append(source.problem(
                    ("after_load", section, name), f"{name!r} is not a field of {config_class.__name__}"))
    if stack is not None and not isinstance(default.__dict__.get(stack), PreTrainedConfig):
        raise source.error(("block", "config_section"), f"{stack!r} is not a sub-config field of "
                           f"{config_class.__name__} (a nested config whose layers the family serves)")
    modules = source.spec.block.modules_field
    if modules is not None and not isinstance(getattr(default, modules, None), int):
        problems.append(source.problem(("block", "modules_field"),
                                       f"{modules!r} is not an integer field of {config_class.__name__}"))
    if problems:
        raise FamilyValidationError(problems)


def kv_groups_of(config: DistributedConfig) -> int:
    """Query heads per KV head of ``config``, from its family's ``kv_groups`` (checked to divide the heads)."""
    return type(config).family_spec.kv_groups_for(config)


class SynthesizedConfigMethods:
    """The methods every synthesized config class defines itself.

    They are installed into each class's own namespace rather than inherited, because a
    synthesized class keeps exactly the bases of a hand-written Petals config.
    ``synthesized_class`` (set on each class) is the class they belong to, for ``super()``.
    """

    synthesized_class: type
    family_spec: FamilySpec

    def __setattr__(self, name: str, value: Any) -> None:
        check_field(name, value)
        super(self.synthesized_class, self).__setattr__(name, value)

    def __post_init__(self, **kwargs: Any) -> None:
        super(self.synthesized_class, self).__post_init__(**kwargs)  # type: ignore[misc]
        check_cross_fields(self)

    def __reduce__(self) -> tuple[Any, ...]:
        cls = type(self)
        restore = sys.modules[cls.__module__].restore_config  # the registry, the class's home
        return restore, (cls.__name__, str(cls.family_source)), self.__dict__.copy()

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per KV head, from the family's ``kv_groups``."""
        return kv_groups_of(self)

    @property
    def wire_width(self) -> int:
        """Values per token of the hidden state between blocks (`distconf.loader.wire_layout.wire_width_of`)."""
        return wire_width_of(self)

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike[str], *args: Any,
                        dht_prefix: str | None = None, preset: bool = False, **kwargs: Any) -> Any:
        """Load like the HF config, then apply the family's DHT prefix rule and fix-ups.

        ``dht_prefix`` defaults to one derived from the hub id (a local directory keeps
        the prefix its ``config.json`` holds). With ``preset=True`` the config values
        come from the copy shipped with distconf instead of the hub (offline).
        """
        spec = cls.family_spec
        name = os.fspath(model_name_or_path)
        is_local = os.path.isdir(name) or os.path.isfile(name)
        load_from: Any = model_name_or_path
        if preset:
            if is_local:
                raise ValueError(f"preset=True needs a hub id, not the local path {name!r}")
            load_from = str(preset_path(name))
            kwargs.pop("revision", None)
        if dht_prefix is None and not is_local:
            dht_prefix = derive_dht_prefix(spec.dht_prefix, name)
        if dht_prefix is not None:
            kwargs["dht_prefix"] = dht_prefix
        for notice in spec.notices:
            if notice.when_name_contains is None or notice.when_name_contains.lower() in name.lower():
                logger.log(logging.WARNING if notice.level == "warning" else logging.INFO, notice.message)
        result = super(cls.synthesized_class, cls).from_pretrained(load_from, *args, **kwargs)  # type: ignore[misc]
        config = result[0] if isinstance(result, tuple) else result
        for field_name, value in spec.after_load.defaults.items():
            if getattr(config, field_name, None) is None:
                setattr(config, field_name, value)
        for field_name, value in spec.after_load.set.items():
            setattr(config, field_name, value)
        if preset:
            config.name_or_path = name
        check_cross_fields(config)
        return result


_METHODS = ("__setattr__", "__post_init__", "__reduce__", "num_key_value_groups", "wire_width", "from_pretrained")


def _blocks_counted_by(config_class: type, field: str) -> property:
    """``num_hidden_layers`` read from ``field`` (``block.modules_field``: one block per layer module); setting
    it keeps the config class's own meaning (the sublayers it counts)."""
    inherited = inspect.getattr_static(config_class, "num_hidden_layers", None)

    def get(self: Any) -> int:
        return getattr(self, field)

    def put(self: Any, value: int) -> None:
        if isinstance(inherited, property) and inherited.fset is not None:
            inherited.fset(self, value)
        else:
            self.__dict__["_hf_num_hidden_layers"] = value

    return property(get, put, doc=f"Blocks of the model: its layer modules, counted by {field!r}.")


def _block_class(cls: type) -> type:
    factory = import_object(cls.family_spec.block.adapter)  # type: ignore[attr-defined]
    return factory(cls)


def synthesize_config_class(source: FamilySource, *, module: str) -> type:
    """Build the distributed config class described by ``source``, as a member of ``module``."""
    spec = source.spec
    config_class = resolve_object(source, ("config_class",), spec.config_class, want_class=True)
    from transformers import PreTrainedConfig

    if not issubclass(config_class, PreTrainedConfig):
        raise source.error(("config_class",), f"{spec.config_class} is not a transformers config class")
    if getattr(config_class, "model_type", None) != spec.model_type:
        raise source.error(
            ("model_type",),
            f"{spec.config_class} has model_type {config_class.model_type!r}, not {spec.model_type!r}",
        )
    if dataclasses.is_dataclass(config_class) and "num_key_value_groups" in {
            f.name for f in dataclasses.fields(config_class)}:
        raise source.error(("kv_groups",), f"{spec.config_class} already has a num_key_value_groups field")
    _check_names(source, config_class)

    bases: tuple[type, ...] = (config_class, ClientConfig, PTuneConfig, LMHeadConfig)
    if spec.revisions:
        bases = (PinnedRevisionMixin, *bases)
    namespace: dict[str, Any] = {name: SynthesizedConfigMethods.__dict__[name] for name in _METHODS}
    namespace.update({
        "__module__": module,
        "__qualname__": spec.class_name,
        "__doc__": f"Distributed config of the {spec.family!r} family ({source.path.name}), "
                   f"synthesized from {spec.config_class}.",
        "family_spec": spec,
        "family_source": source,
        "hf_config_class": config_class,
        "block_prefix": spec.block.prefix,
        "attn_class": LazyClassAttribute(
            "attn_class", lambda owner: resolve_object(source, ("block", "attention_class"),
                                                       spec.block.attention_class, want_class=True)),
        "block_class": LazyClassAttribute("block_class", _block_class),
    })
    if spec.revisions:
        namespace["pinned_revisions"] = dict(spec.revisions)
    if spec.block.modules_field:
        namespace["num_hidden_layers"] = _blocks_counted_by(config_class, spec.block.modules_field)
    if spec.block.config_section:
        namespace.update(section_namespace(spec.block.config_section))
    cls = type(spec.class_name, bases, namespace)
    cls.synthesized_class = cls
    return cls


def resolve_source(source: FamilySource) -> type:
    """Synthesize (uncached) and import every class a family names; for ``validate --resolve``.

    Raises `FamilyValidationError` naming the field whose class or formula is wrong.
    """
    cls = synthesize_config_class(source, module=__name__)
    problems = []
    try:
        cls().num_key_value_groups  # noqa: B018 (evaluated for its check)
    except ConfigValueError as exc:
        problems.append(source.problem(("kv_groups",), str(exc)))
    block = source.spec.block
    for loc, path in ((("block", "layer_class"), block.layer_class),
                      (("block", "attention_class"), block.attention_class),
                      (("block", "adapter"), block.adapter)):
        try:
            import_object(path)
        except ImportError as exc:
            problems.append(source.problem(loc, str(exc)))
    if problems:
        raise FamilyValidationError(problems)
    return cls
