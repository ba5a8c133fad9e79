"""What the model built on the meta device shows: its layer list, attention, rotary module, layer kinds."""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import DraftingError, crash_line, quiet_transformers

__all__ = ["ModelScan", "find_attention", "meta_model", "scan_model", "layer_signature", "forward_parameters",
           "find_layer_list", "find_layer_modules", "config_reads"]


@dataclass
class ModelScan:
    """The parts of a causal-LM model a family file names."""

    model: Any
    prefix: str  # state-dict path of the layer list
    layers: Any  # the ModuleList
    base_prefix: str | None  # the model class's base_model_prefix, when the layers live under it
    base_model: Any  # the module holding the layer list (it runs them and builds their masks)
    attention_class: type | None
    attention_name: str | None
    rotary_class: type | None
    sublayers: int = 1
    """Attention sublayers per layer module (num_hidden_layers counts them; the list holds the modules)."""

    @property
    def layer_class(self) -> type:
        """Class of the first layer."""
        return type(self.layers[0])

    def config_reads(self) -> frozenset[str]:
        """Config attributes the model's code reads (`config_reads` of its, its layer's and attention's modules)."""
        attention = [self.attention_class] if self.attention_class else []
        return config_reads(type(self.model), self.layer_class, *attention)

    def layer_kinds(self) -> list[tuple[str, ...]]:
        """`layer_signature` of every layer, with its part in the model's tie map: a layer tying tensors to another
        layer's is of another kind than the layer they are tied to (a tiny model keeps both, so the tie holds)."""
        from distconf.blocks.hf_compat import tied_layer_tensors

        roles: dict[int, str] = {}
        for i, tied in tied_layer_tensors(self.model, self.prefix).items():
            for there, _ in tied.values():
                roles[i] = "tied to another layer"
                roles.setdefault(there, "tied to by another layer")
        return [layer_signature(layer) + ((roles[i],) if i in roles else ())
                for i, layer in enumerate(self.layers)]


def meta_model(config_class: type, config: Mapping[str, Any]) -> tuple[Any, Any]:
    """The full config and the causal-LM model built from it on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig

    from distconf.blocks.hf_compat import causal_lm_class, causal_lm_from_config

    try:
        with quiet_transformers():
            full = AutoConfig.for_model(**copy.deepcopy(dict(config)))  # transformers edits nested dicts
            if type(full) is not config_class and issubclass(config_class, type(full)):  # a subclass of the mapped one
                full = config_class(**{k: v for k, v in copy.deepcopy(dict(config)).items() if k != "model_type"})
    except Exception as exc:  # report the transformers message as is
        raise DraftingError(f"{config_class.__name__} rejects this config.json: {exc}") from None
    if causal_lm_class(type(full)) is None:
        raise DraftingError(f"no causal-LM model class for {config_class.__name__} in transformers "
                            "(AutoModelForCausalLM does not map it)")
    try:
        with torch.device("meta"):
            model = causal_lm_from_config(full)
    except Exception as exc:  # transformers' own code fails on these values: say where, in one line
        raise DraftingError(f"transformers cannot build the model of this config.json (its values, or "
                            f"{config_class.__name__}'s defaults for the fields it leaves out, do not fit the "
                            f"modeling code): {crash_line(exc)}") from None
    return full, model


def scan_model(model: Any, num_layers: int | None) -> ModelScan:
    """Inspect ``model`` (built on the meta device) whose config says ``num_layers`` layers."""
    if num_layers is None:
        stacks = ", ".join(f"'{name}' ({len(module)})" for name, module in _layer_stacks(model)[:4])
        raise DraftingError(f"the config of {type(model).__name__} counts no layers at its top level (no "
                            f"num_hidden_layers); its layer stacks ({stacks or 'none found'}) are sized by nested "
                            "sub-configs, and a family serves the one stack of layers num_hidden_layers counts")
    prefix, layers, sublayers = find_layer_modules(model, num_layers)
    base_prefix = getattr(type(model), "base_model_prefix", None)
    base_prefix = base_prefix if base_prefix and prefix.startswith(base_prefix + ".") else None
    attention_class, attention_name = find_attention(layers[0])
    firsts: dict[type, Any] = {}
    for layer in layers:
        firsts.setdefault(type(layer), layer)
    for layer in firsts.values():
        if attention_class is None:  # the first layer has none: the first class of layer with one
            attention_class, attention_name = find_attention(layer)
    rotary_class = _find_rotary(model, prefix)
    owner = prefix.rpartition(".")[0]  # the module running the layers builds their masks
    return ModelScan(model=model, prefix=prefix, layers=layers, base_prefix=base_prefix,
                     base_model=model.get_submodule(owner) if owner else model,
                     attention_class=attention_class, attention_name=attention_name,
                     rotary_class=rotary_class, sublayers=sublayers)


def layer_signature(layer: Any) -> tuple[str, ...]:
    """The modules a layer is built of (path and class of each, list positions left out).

    Layers of one kind have the same signature, whatever the sizes and the number of
    experts: a tiny model's layer and the real one compare equal.
    """
    parts = {".".join("#" if part.isdigit() else part for part in name.split(".")) + ":" + type(module).__name__
             for name, module in layer.named_modules()}
    return tuple(sorted(parts))


def _layer_stacks(model: Any) -> list[tuple[str, Any]]:
    """(path, ModuleList) of every list of layers that hold parameters, outermost first."""
    import torch

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and name
            and all(any(True for _ in child.parameters()) for child in module)]


def find_layer_list(model: Any, num_layers: int | None) -> tuple[str, Any]:
    """The ``ModuleList`` of ``num_layers`` layers holding the most parameters, and its path (or the list of
    layer modules holding sublayers, `find_layer_modules`)."""
    name, module, _ = find_layer_modules(model, num_layers)
    return name, module


def find_layer_modules(model: Any, num_layers: int | None) -> tuple[str, Any, int]:
    """The ``ModuleList`` of ``num_layers`` layers holding the most parameters, its path, and 1; or, when the
    model has none, a list of modules each holding ``s`` attention sublayers (``num_layers / s`` of them), and s."""
    candidates = _layer_lists(_section_module(model), lambda n: num_layers is None or n == num_layers)
    if candidates:
        return (*candidates[0], 1)
    for name, module in _layer_lists(_section_module(model), lambda n: num_layers is not None and n < num_layers
                                     and num_layers % n == 0):
        sublayers = num_layers // len(module)  # type: ignore[operator]
        if all(_attention_count(layer) == sublayers for layer in module):
            return name, module, sublayers
    raise DraftingError(
        f"no ModuleList of {num_layers} layers in {type(model).__name__}; is num_hidden_layers right?")


def layer_section(full: Any, model: Any) -> str | None:
    """The field of ``full`` holding the sub-config of ``model``'s served layer stack, for a config counting no
    layers at its top level: of the sub-configs counting layers, the one whose module's list of that many layers
    holds the most parameters (None when there is none)."""
    found = []
    for field, sub in vars(full).items():
        layers = getattr(sub, "num_hidden_layers", None) if hasattr(sub, "to_dict") else None
        if not isinstance(layers, int) or isinstance(layers, bool):
            continue
        for _, owner in model.named_modules():
            if getattr(owner, "config", None) is sub:
                found += [(params, field) for params, _, _, _ in _sized_lists(owner, lambda n, k=layers: n == k)]
    return max(found)[1] if found else None


def _section_module(model: Any) -> Any:
    """``model``, or where its config names a layer section (`distconf.loader.layer_section`), the module built
    with that sub-config; the layer list is searched there, the paths kept relative to ``model``."""
    from distconf.loader.layer_section import section_of

    sub = section_of(getattr(model, "config", None))
    if sub is None:
        return model
    for name, owner in model.named_modules():
        if name and getattr(owner, "config", None) is sub:
            return _Prefixed(owner, name)
    return model


class _Prefixed:
    """A submodule whose ``named_modules`` paths start at the model holding it."""

    def __init__(self, module: Any, prefix: str) -> None:
        self.module, self.prefix = module, prefix

    def named_modules(self) -> Any:
        return ((f"{self.prefix}.{name}" if name else self.prefix, m) for name, m in self.module.named_modules())


def _layer_lists(model: Any, length_fits: Any) -> list[tuple[str, Any]]:
    """(path, ModuleList) of the lists of layers with parameters whose length fits, most parameters first."""
    return [(name, module) for _, _, name, module in _sized_lists(model, length_fits)]


def _sized_lists(model: Any, length_fits: Any) -> list[tuple[int, int, str, Any]]:
    """(parameters, -depth, path, ModuleList) of the lists of layers with parameters whose length fits, most
    parameters first."""
    import torch

    candidates = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0 or not length_fits(len(module)):
            continue
        if not all(any(True for _ in child.parameters()) for child in module):
            continue
        params = sum(p.numel() for p in module.parameters())
        candidates.append((params, -name.count("."), name, module))
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return candidates


def _attention_count(layer: Any) -> int:
    """Attention modules of ``layer`` that hold no other attention module (its sublayers' attentions)."""
    found = [name for name, module in layer.named_modules() if name and _is_attention(module)]
    return sum(1 for name in found if not any(other.startswith(name + ".") for other in found))


_CACHE_PARAMETERS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_attention(module: Any) -> bool:
    """An attention module: named so, or (latent attention classes are not) one whose forward takes the
    cache and the rotary embeddings."""
    cls_name = type(module).__name__
    if "Attention" in cls_name:
        return "Norm" not in cls_name
    params = forward_parameters(type(module))
    return "position_embeddings" in params and any(name in params for name in _CACHE_PARAMETERS) \
        and not cls_name.endswith("Layer")


def find_attention(layer: Any) -> tuple[type | None, str | None]:
    """The attention module class inside ``layer`` and its name (None, None when there is none)."""
    found = []
    for name, module in layer.named_modules():
        if name and _is_attention(module):
            params = forward_parameters(type(module))
            # at one depth, the module taking the cache (not an attention over other layers' outputs)
            found.append((name.count("."), not any(p in params for p in _CACHE_PARAMETERS), name, type(module)))
    if not found:
        return None, None
    inner = [f for f in found if not f[3].__name__.endswith("Layer")]  # a decoder layer holding the attention
    found = inner or found
    found.sort(key=lambda f: f[:2])
    return found[0][3], found[0][2]


def _find_rotary(model: Any, layers_prefix: str) -> type | None:
    """The first rotary module outside the layers (one inside a layer needs no ``rotary_class``)."""
    for name, module in model.named_modules():
        if "Rotary" in type(module).__name__ and not name.startswith(layers_prefix + "."):
            return type(module)
    return None


def forward_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """Parameters of ``cls.forward`` by name (empty when it has no readable signature)."""
    try:
        return dict(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return {}


_CONFIG_READ = re.compile(r"config\.([A-Za-z_]\w*)|getattr\(\s*[\w.]*config\s*,\s*[\"']([A-Za-z_]\w*)[\"']")


def config_reads(*classes: type) -> frozenset[str]:
    """Names the source of the classes' modules reads from a config (``config.x``, ``getattr(config, "x")``).

    Modeling code also reads attributes a config class does not declare (with a
    default when absent), so a field of a ``config.json`` can matter to the model
    without being a field of its config class.
    """
    names: set[str] = set()
    for module in {inspect.getmodule(cls) for cls in classes} - {None}:
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        names.update(a or b for a, b in _CONFIG_READ.findall(source))
    return frozenset(names)
