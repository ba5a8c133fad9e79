"""Synthesis and construction of served blocks: ``Distributed<Name>Block`` classes and instances.

``make_block_class(config_cls)`` builds ``Distributed<Name>Block(BlockAdapter, layer_class)``
once per config class (it is the default ``block.adapter`` of a family file, so
``config_cls.block_class`` resolves to it). ``build_block(config, i)`` instantiates block
``i`` of the family's block class (`block_class_for`: what the family's ``block.adapter``
builds) with the constructor arguments the family file declares, on the meta device by
default (no memory); `distconf.blocks.weights.load_block` fills it from a checkpoint.
Block classes live in this module, so pickle finds them by name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from distconf.blocks.adapter import BlockAdapter
from distconf.blocks.hf_compat import initialize_computed_buffers, non_persistent_buffers
from distconf.blocks.layer_types import layer_type
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import FormulaError
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import config_num_blocks
from distconf.loader.once import OncePerKey
from distconf.loader.per_layer import layer_config
from distconf.loader.registry import load_family_by_class_name
from distconf.loader.synthesis import resolve_object

if TYPE_CHECKING:
    import torch

__all__ = ["make_block_class", "build_block", "block_class_for", "constructor_kwargs", "materialize_buffers"]

_resolve_lock = threading.RLock()
_block_classes: OncePerKey[type, type] = OncePerKey()


def _class_name(config_cls: type) -> str:
    name = config_cls.__name__
    return (name[: -len("Config")] if name.endswith("Config") else name) + "Block"


def make_block_class(config_cls: type, layer_type: str | None = None) -> type:
    """The block class of a distributed config class (synthesized once per config class); with ``layer_type``,
    the block class of that layer type when ``block.layer_classes`` gives it its own decoder-layer class."""
    layer_classes = config_cls.family_spec.block.layer_classes  # type: ignore[attr-defined]
    if layer_type is None or layer_type not in layer_classes:
        return _block_classes.get(config_cls, lambda: _synthesize_block_class(config_cls))
    return _typed_block_classes.get((config_cls, layer_type),
                                    lambda: _synthesize_block_class(config_cls, layer_type))


_typed_block_classes: OncePerKey[tuple[type, str], type] = OncePerKey()


def _synthesize_block_class(config_cls: type, layer_type: str | None = None) -> type:
    spec = config_cls.family_spec  # type: ignore[attr-defined]
    loc: tuple[str, ...] = ("block", "layer_class")
    path = spec.block.layer_class
    if layer_type is not None:
        loc, path = ("block", "layer_classes", layer_type), spec.block.layer_classes[layer_type]
    layer_class = resolve_object(config_cls.family_source, loc, path)
    if not isinstance(layer_class, type):
        raise config_cls.family_source.error(loc, f"{path} is not a class")
    import torch

    if not issubclass(layer_class, torch.nn.Module):
        raise config_cls.family_source.error(loc, f"{path} is not a torch.nn.Module")
    name = _class_name(config_cls)
    if layer_type is not None:
        name = f"{name[:-len('Block')]}_{layer_class.__name__}_Block"
    cls = type(name, (BlockAdapter, layer_class), {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"Block of the {spec.family!r} family: {layer_class.__name__} + the generic adapter.",
        "family_spec": spec,
        "config_class": config_cls,
        "layer_class": layer_class,
    })
    globals()[name] = cls  # latest class of that name, for pickle
    return cls


def __getattr__(name: str) -> type:
    """Resolve ``Distributed<Name>Block`` (and ``Distributed<Name>_<LayerClass>_Block``, a layer type's own
    class) on first use, so pickle finds block classes."""
    if name.startswith("Distributed") and name.endswith("Block"):
        base, _, layer_name = name[: -len("Block")].rstrip("_").partition("_")  # a per-layer-type class
        try:
            config_cls = load_family_by_class_name(base + "Config")
        except LookupError:
            pass
        else:
            for kind, path in config_cls.family_spec.block.layer_classes.items():
                if layer_name and path.rsplit(".", 1)[-1] == layer_name:
                    return make_block_class(config_cls, kind)
            if not layer_name:
                return make_block_class(config_cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def block_class_for(config: DistributedConfig) -> type:
    """The block class for a config instance: its class's ``block_class``.

    That is whatever the family file's ``block.adapter`` factory builds (`make_block_class`
    by default), resolved once per config class (`distconf.loader.synthesis` owns the rule;
    this only makes the first resolution thread-safe and locates its errors).
    """
    config_cls = type(config)
    if not hasattr(config_cls, "family_spec"):
        raise TypeError(f"{config_cls.__name__} is not a distributed config (use distconf.load_family)")
    adapter = config_cls.family_spec.block.adapter
    with _resolve_lock:  # a user factory runs once even when several threads build blocks
        try:
            cls = config_cls.block_class
        except ImportError as exc:
            raise config_cls.family_source.error(("block", "adapter"), str(exc)) from None
    if not isinstance(cls, type):
        raise config_cls.family_source.error(("block", "adapter"), f"{adapter} returned {cls!r}, not a class")
    return cls


def constructor_kwargs(config: DistributedConfig, layer_idx: int) -> dict[str, Any]:
    """Keyword arguments of the family's layer constructor for block ``layer_idx`` (from the family file)."""
    spec = type(config).family_spec.block.constructor
    kwargs: dict[str, Any] = {spec.config_argument: config}
    if spec.layer_idx_argument:
        kwargs[spec.layer_idx_argument] = layer_idx
    if spec.layer_type_argument:
        kwargs[spec.layer_type_argument] = layer_type(config, layer_idx)
    for name, formula in spec.extra.items():
        try:
            kwargs[name] = formula.evaluate_on(layer_config(config, layer_idx))
        except FormulaError as exc:
            raise type(config).family_source.error(("block", "constructor", "extra", name), str(exc)) from None
    return kwargs


def build_block(config: DistributedConfig, layer_idx: int, *, device: Any = "meta", dtype: torch.dtype | None = None,
                buffers_device: Any = "cpu") -> Any:
    """Instantiate block ``layer_idx`` of ``config`` (on ``meta`` no parameter is allocated).

    For a looped layer stack (``block.layer_stack``) ``layer_idx`` counts blocks: the block is the model layer
    it runs (`distconf.loader.layer_stack.model_layer`), with its part in the loop (`block_loop`).

    Constructor arguments come from the family file (``block.constructor``). The block is
    in eval mode. On ``meta``, load weights with `distconf.blocks.weights.load_block`; buffers the
    layer computes itself (non-persistent, never in checkpoints) are materialized on
    ``buffers_device`` right away (`materialize_buffers`); None leaves them on ``meta``.
    """
    import torch

    from distconf.blocks.layer_stack import block_loop

    looped = type(config).family_spec.block.layer_stack is not None
    num_layers = config_num_blocks(config) if looped else getattr(config, "num_hidden_layers", None)
    if not isinstance(layer_idx, int) or layer_idx < 0 or (isinstance(num_layers, int) and layer_idx >= num_layers):
        raise IndexError(f"layer_idx={layer_idx!r} out of range for {num_layers!r} blocks")
    block_idx, layer_idx = layer_idx, (model_layer(config, layer_idx) if looped else layer_idx)
    cls = block_class_for(config)
    if type(config).family_spec.block.layer_classes:
        cls = make_block_class(type(config), layer_type(config, layer_idx))
    kwargs = constructor_kwargs(config, layer_idx)
    try:
        if type(config).family_spec.block.constructor.from_model:
            block = _from_model(cls, config, layer_idx, device)
        else:
            with torch.device(device):
                block = cls(**kwargs)
    except TypeError as exc:
        raise type(config).family_source.error(("block", "constructor"),
                          f"{getattr(cls, 'layer_class', cls).__name__}({', '.join(kwargs)}) failed: {exc}"
                          ) from None
    if str(device) == "meta":
        _parameters_to_meta(block)
    add_model_buffers(block, config, buffers_device if str(device) == "meta" and buffers_device is not None
                      else device)
    if dtype is not None:
        block = block.to(dtype)
    if str(device) == "meta" and buffers_device is not None:
        materialize_buffers(block, config, buffers_device)
    block.eval()
    if looped:
        block._distconf_loop = block_loop(config, block_idx)
    return block


_meta_model_lock = threading.Lock()
_meta_model: list[tuple[Any, Any, dict[int, dict[str, tuple[int, str]]]]] = []  # the last config's, with its ties


def _model_layers(config: DistributedConfig, device: Any) -> tuple[Any, dict[int, dict[str, tuple[int, str]]]]:
    """The layer list of the causal LM of ``config`` built on ``device`` and the tensors it ties between layers.

    On ``meta`` the model of the last config asked for is kept (building a large model takes a while, and a
    server builds every block of its span from one config); its layers are copied, never handed out.
    """
    import torch

    from distconf.blocks.adapter import prepare_config
    from distconf.blocks.hf_compat import causal_lm_from_config, tied_layer_tensors

    meta = str(device) == "meta"
    with _meta_model_lock:
        if meta and _meta_model and _meta_model[0][0] is config:
            return _meta_model[0][1], _meta_model[0][2]
        prepare_config(config)
        source = type(config).family_source
        with torch.device(device):
            try:
                model = causal_lm_from_config(config)
            except (TypeError, ValueError) as exc:
                raise source.error(("block", "constructor", "from_model"),
                                   f"cannot build the model: {type(exc).__name__}: {exc}") from None
        prefix = type(config).family_spec.block.prefix
        try:
            layers = model.get_submodule(prefix)
        except AttributeError:
            raise source.error(("block", "prefix"), f"the model has no module {prefix!r}") from None
        ties = tied_layer_tensors(model, prefix)
        if meta:
            _meta_model[:] = [(config, layers, ties)]
        return layers, ties


def _from_model(cls: type, config: DistributedConfig, layer_idx: int, device: Any) -> Any:
    """Block ``layer_idx`` taken from the causal LM built on ``device`` (``block.constructor.from_model``).

    The layer keeps the modules the model built it from; the names of its tensors the model ties to another
    layer's (its tie map) are kept as ``distconf_tied`` (local name -> (layer, local name there)), which
    `distconf.blocks.weights` reads them from.
    """
    import copy

    layers, ties = _model_layers(config, device)
    layer = copy.deepcopy(layers[layer_idx]) if str(device) == "meta" else layers[layer_idx]
    block = cls.adopt(layer, config, layer_idx)
    block.distconf_tied = ties.get(layer_idx, {})
    return block


def _parameters_to_meta(block: Any) -> None:
    """Move to ``meta`` the parameters a layer drew with a factory the device context misses
    (diffllama's ``torch.normal(mean, std, size=...)``): a meta build then holds no real tensor."""
    import torch

    for module in block.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                setattr(module, name, torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))


def add_model_buffers(block: Any, config: DistributedConfig, device: Any) -> None:
    """Register the buffers the model gives each layer after building it (``block.model_buffers``)."""
    import torch

    source = type(config).family_source
    for path, function_path in type(config).family_spec.block.model_buffers.items():
        loc = ("block", "model_buffers", path)
        function = resolve_object(source, loc, function_path)
        owner_name, _, name = path.rpartition(".")
        try:
            owner = block.get_submodule(owner_name) if owner_name else block
            value = function(config)
        except (AttributeError, TypeError, ValueError) as exc:
            raise source.error(loc, f"{type(exc).__name__}: {exc}") from None
        if not isinstance(value, torch.Tensor):
            raise source.error(loc, f"{function_path} returned {type(value).__name__}, not a tensor")
        owner.register_buffer(name, value.to(device), persistent=False)


def materialize_buffers(block: Any, config: DistributedConfig, device: Any = "cpu") -> list[str]:
    """Give every non-persistent buffer still on the meta device real values on ``device``.

    Such buffers (e.g. a causal-mask buffer a local-attention layer computes in ``__init__``)
    are not in checkpoints, so a block built on the meta device would keep them empty.
    As transformers does after a meta build, each becomes an empty tensor and the model
    class's own ``_init_weights`` fills it. Floating buffers keep their dtype. Returns the
    names materialized; raises `ConfigValueError` naming them when the architecture has
    no model class to initialize them.
    """
    import torch

    from distconf.errors import ConfigValueError

    pending = [(name, tensor) for name, tensor in non_persistent_buffers(block) if tensor.is_meta]
    if not pending:
        return []
    owners = []
    for name, tensor in pending:
        owner_name, _, buffer_name = name.rpartition(".")
        owner = block.get_submodule(owner_name)
        owner._buffers[buffer_name] = torch.empty_like(tensor, device=device)
        if all(owner is not o for o in owners):
            owners.append(owner)
    hf_config_class = type(config).hf_config_class
    if not initialize_computed_buffers(block, owners, hf_config_class, config):
        raise ConfigValueError(f"buffers {', '.join(n for n, _ in pending)} of {type(block).__name__} are computed "
                               f"by the layer, but transformers registers no model class for "
                               f"{hf_config_class.__name__} whose _init_weights could compute them")
    return [name for name, _ in pending]
