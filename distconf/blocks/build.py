"""Synthesis and construction of served blocks: ``Distributed<Name>Block`` classes and instances.

``make_block_class(config_cls)`` builds ``Distributed<Name>Block(BlockAdapter, layer_class)``
once per config class (it is the default ``block.adapter`` of a family file, so
``config_cls.block_class`` resolves to it). ``build_block(config, i)`` instantiates block
``i`` with the constructor arguments the family file declares, on the meta device by
default (no memory); `distconf.blocks.weights.load_block` fills it from a checkpoint.
Block classes live in this module, so pickle finds them by name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from distconf.blocks.adapter import BlockAdapter, import_named
from distconf.family.formula import FormulaError
from distconf.family.registry import load_family_by_class_name

if TYPE_CHECKING:
    import torch

__all__ = ["make_block_class", "build_block", "block_class_for", "constructor_kwargs"]

_lock = threading.Lock()
_block_classes: dict[type, type] = {}


def _class_name(config_cls: type) -> str:
    name = config_cls.__name__
    return (name[: -len("Config")] if name.endswith("Config") else name) + "Block"


def make_block_class(config_cls: type) -> type:
    """The block class of a distributed config class (synthesized once per config class)."""
    cls = _block_classes.get(config_cls)
    if cls is not None:
        return cls
    with _lock:
        cls = _block_classes.get(config_cls)
        if cls is not None:
            return cls
        spec = config_cls.family_spec  # type: ignore[attr-defined]
        layer_class = import_named(config_cls, ("block", "layer_class"), spec.block.layer_class)
        if not isinstance(layer_class, type):
            raise config_cls.family_source.error(("block", "layer_class"), f"{spec.block.layer_class} is not a class")
        import torch

        if not issubclass(layer_class, torch.nn.Module):
            raise config_cls.family_source.error(("block", "layer_class"),
                              f"{spec.block.layer_class} is not a torch.nn.Module")
        name = _class_name(config_cls)
        cls = type(name, (BlockAdapter, layer_class), {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"Block of the {spec.family!r} family: {layer_class.__name__} + the generic adapter.",
            "family_spec": spec,
            "config_class": config_cls,
            "layer_class": layer_class,
        })
        _block_classes[config_cls] = cls
        globals()[name] = cls  # latest class of that name, for pickle
        return cls


def __getattr__(name: str) -> type:
    """Resolve ``Distributed<Name>Block`` on first use (so pickle finds block classes)."""
    if name.startswith("Distributed") and name.endswith("Block"):
        try:
            config_cls = load_family_by_class_name(name[: -len("Block")] + "Config")
        except LookupError:
            pass
        else:
            return make_block_class(config_cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def block_class_for(config: Any) -> type:
    """The block class for a config instance (its class's ``block_class``)."""
    config_cls = type(config)
    if not hasattr(config_cls, "family_spec"):
        raise TypeError(f"{config_cls.__name__} is not a distributed config (use distconf.load_family)")
    return make_block_class(config_cls)


def constructor_kwargs(config: Any, layer_idx: int) -> dict[str, Any]:
    """Keyword arguments of the family's layer constructor for block ``layer_idx`` (from the family file)."""
    spec = type(config).family_spec.block.constructor
    kwargs: dict[str, Any] = {spec.config_argument: config}
    if spec.layer_idx_argument:
        kwargs[spec.layer_idx_argument] = layer_idx
    for name, formula in spec.extra.items():
        try:
            kwargs[name] = formula.evaluate_on(config)
        except FormulaError as exc:
            raise type(config).family_source.error(("block", "constructor", "extra", name), str(exc)) from None
    return kwargs


def build_block(config: Any, layer_idx: int, *, device: Any = "meta", dtype: torch.dtype | None = None) -> Any:
    """Instantiate block ``layer_idx`` of ``config`` (on ``meta`` nothing is allocated).

    Constructor arguments come from the family file (``block.constructor``). The block is
    in eval mode. On ``meta``, load weights with `distconf.weights.load_block`.
    """
    import torch

    num_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layer_idx, int) or layer_idx < 0 or (isinstance(num_layers, int) and layer_idx >= num_layers):
        raise IndexError(f"layer_idx={layer_idx!r} out of range for num_hidden_layers={num_layers!r}")
    cls = block_class_for(config)
    kwargs = constructor_kwargs(config, layer_idx)
    try:
        with torch.device(device):
            block = cls(**kwargs)
    except TypeError as exc:
        raise type(config).family_source.error(("block", "constructor"),
                          f"{cls.layer_class.__name__}({', '.join(kwargs)}) failed: {exc}") from None
    if dtype is not None:
        block = block.to(dtype)
    block.eval()
    return block
