"""LoRA adapters beside the served blocks, in PEFT's format, as Petals serves them (``--adapters``).

An adapter is a folder with ``adapter_config.json`` (``peft_type: LORA``) and ``adapter_model.safetensors``
holding, for each adapted linear module of layer ``i``, ``base_model.model.{block.prefix}.{i}.{path}.lora_A.weight``
``[r, in_features]`` and ``...lora_B.weight`` ``[out_features, r]``. `read_lora` reads only the layers a server
serves and checks everything before use (`AdapterError`, one line naming the adapter and why); `attach` puts it
beside a block without touching the block's weights (their digests do not change): a forward hook on each adapted
linear module adds ``scale * (x @ A.T) @ B.T`` for the rows whose session uses that adapter.

Which rows use which adapter is the context of the call (`adapter_rows`), so one block call serves a batch of
sessions of different adapters: the base is computed once and each row gets its own low-rank delta (vLLM's
multi-LoRA batching, without its kernels). A call outside any `adapter_rows` context runs the base model.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distconf.blocks.weights import layer_prefixes

if TYPE_CHECKING:
    import torch

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterError", "LoraAdapter", "LoraWeights", "adapter_rows",
           "attach", "check_targets", "layer_digest", "lora_bytes_per_block", "read_lora"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_ROWS: contextvars.ContextVar[tuple[tuple[str | None, slice], ...] | None] = contextvars.ContextVar(
    "distconf_adapter_rows", default=None)
_TABLES: weakref.WeakKeyDictionary[Any, dict[str, LoraWeights]] = weakref.WeakKeyDictionary()


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names it and says why."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapted linear module, as the hook uses it: ``down`` ``[in, r]`` (A transposed) and ``up`` ``[r, out]``
    (B transposed, times the scale ``alpha / r``), so a row's output becomes ``addmm(output, x @ down, up)``."""

    down: torch.Tensor
    up: torch.Tensor

    @property
    def sizes(self) -> tuple[int, int]:
        """(in_features, out_features) of the module it adapts."""
        return int(self.down.shape[0]), int(self.up.shape[1])


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights for the layers a server serves (model layer index -> module path -> weights)."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    layers: Mapping[int, Mapping[str, LoraWeights]]
    digests: Mapping[int, str] = field(default_factory=dict)
    """Model layer -> sha256 of the adapter's tensors for it, as stored in the file (`layer_digest`): what a server
    announces (``adapter_sha256``) and a weights manifest lists."""

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter's tensors held for the served layers."""
        return sum(w.down.numel() * w.down.element_size() + w.up.numel() * w.up.element_size()
                   for modules in self.layers.values() for w in modules.values())


def _config(name: str, folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"adapter {name!r}: {folder} has no {ADAPTER_CONFIG} (a PEFT adapter folder has one)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: {path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {path} is not a JSON object")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}; only LoRA adapters are served")
    if config.get("bias", "none") not in ("none", None) or config.get("lora_bias"):
        problems.append("it trains biases (bias/lora_bias); only LoRA without bias is served, as in Petals")
    for flag in ("use_dora", "fan_in_fan_out", "use_qalora"):
        if config.get(flag):
            problems.append(f"{flag} is set; plain LoRA only")
    for key in ("modules_to_save", "trainable_token_indices", "layer_replication"):
        if config.get(key):
            problems.append(f"{key} is set: it changes modules outside the LoRA matrices")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            problems.append(f"{key} is set: one rank and one alpha for every module only")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"r is {rank!r}, not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"lora_alpha is {alpha!r}, not a number")
    if problems:
        raise AdapterError(f"adapter {name!r} cannot be served: {'; '.join(problems)}")
    return config


def _split_key(key: str, prefixes: Mapping[str, int]) -> tuple[int, str, str] | None:
    """``(layer, module path, "A" or "B")`` of a PEFT tensor name, None for a layer not in ``prefixes``."""
    rest = key.removeprefix(_PEFT_PREFIX)
    for prefix, layer in prefixes.items():
        if rest.startswith(prefix):
            path, _, kind = rest[len(prefix):].rpartition(".lora_")
            return layer, path, kind.removesuffix(".weight")
    return None


def read_lora(source: str | Path, name: str, config: Any, layers: Sequence[int], dtype: torch.dtype) -> LoraAdapter:
    """The adapter in folder ``source`` (served as ``name``) for model layers ``layers`` of ``config``, in ``dtype``.

    :raises AdapterError: not a PEFT LoRA folder, no safetensors, tensors for modules outside the blocks, A and B
        that do not pair up.
    """
    from safetensors import safe_open

    folder = Path(source)
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {source} is not a folder")
    settings = _config(name, folder)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        other = "only adapter_model.bin, a pickle: " if (folder / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"adapter {name!r}: {folder} has {other}no {ADAPTER_WEIGHTS} (adapters are read from "
                           "safetensors only)")
    rank, alpha = int(settings["r"]), float(settings["lora_alpha"])
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    all_prefixes = {p: i for i in range(int(config.num_hidden_layers)) for p in layer_prefixes(config, i)}
    wanted = set(layers)
    found: dict[int, dict[str, dict[str, Any]]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                parts = _split_key(key, all_prefixes)
                if parts is None:
                    raise AdapterError(f"adapter {name!r} changes {key.removeprefix(_PEFT_PREFIX)!r}, outside the "
                                       "transformer blocks; a server serves blocks only")
                layer, path, kind = parts
                if kind not in ("A", "B") or not path:
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B matrix")
                if layer in wanted:
                    found.setdefault(layer, {}).setdefault(path, {})[kind] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a broken file
        raise AdapterError(f"adapter {name!r}: {weights} is not a readable safetensors file ({exc})") from None
    modules: dict[int, dict[str, LoraWeights]] = {}
    digests = {layer: layer_digest(found.get(layer, {})) for layer in wanted}
    for layer, paths in found.items():
        for path, pair in paths.items():
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"adapter {name!r}: layer {layer} {path} has lora_{next(iter(pair))} without "
                                   f"lora_{'B' if 'A' in pair else 'A'}")
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
                raise AdapterError(f"adapter {name!r}: layer {layer} {path} has A {list(a.shape)} and B "
                                   f"{list(b.shape)}, not [r, in] and [out, r] with r={rank}")
            modules.setdefault(layer, {})[path] = LoraWeights(a.to(dtype).T.contiguous(),
                                                              (b.to(dtype) * scale).T.contiguous())
    targets = settings.get("target_modules")
    target_modules = tuple(targets) if isinstance(targets, list) else (str(targets),) if targets else ()
    return LoraAdapter(name, rank, alpha, target_modules, modules, digests)


def layer_digest(paths: Mapping[str, Mapping[str, Any]]) -> str:
    """sha256 of one layer's LoRA tensors as stored (``{module path: {"A": tensor, "B": tensor}}``): each tensor's
    path, kind, dtype, shape and bytes, in path order (a layer the adapter leaves alone: the digest of nothing)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for path in sorted(paths):
        for kind in sorted(paths[path]):
            tensor = paths[path][kind].detach().contiguous().cpu()
            header = f"{path}.lora_{kind}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|"
            digest.update(header.encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def lora_bytes_per_block(source: str | Path, config: Any, dtype: torch.dtype) -> int:
    """Bytes the adapter in folder ``source`` holds for its largest layer in ``dtype``, from the safetensors header
    alone (what the planner adds to each block); 0 for a folder without adapter weights."""
    from safetensors import safe_open

    weights = Path(source) / ADAPTER_WEIGHTS
    if not weights.is_file():
        return 0
    prefixes = {p: i for i in range(int(config.num_hidden_layers)) for p in layer_prefixes(config, i)}
    per_layer: dict[int, int] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            parts = _split_key(key, prefixes)
            if parts is not None:
                per_layer[parts[0]] = per_layer.get(parts[0], 0) + math.prod(f.get_slice(key).get_shape())
    return max(per_layer.values(), default=0) * dtype.itemsize


def check_targets(adapter: LoraAdapter, block: Any, layer: int) -> None:
    """Check that every module ``adapter`` adapts in ``layer`` is a linear module of ``block`` of matching size.

    :raises AdapterError: a module that does not exist, is not linear, or has other sizes.
    """
    for path, weights in adapter.layers.get(layer, {}).items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            raise AdapterError(f"adapter {adapter.name!r}: layer {layer} has no module {path!r} (the family's "
                               f"{type(block).__name__} does not)") from None
        size = (getattr(module, "in_features", None), getattr(module, "out_features", None))
        if None in size:
            raise AdapterError(f"adapter {adapter.name!r}: layer {layer} {path} is a {type(module).__name__}, not a "
                               "linear module")
        if weights.sizes != size:
            raise AdapterError(f"adapter {adapter.name!r}: layer {layer} {path} maps {size[0]} to {size[1]} values, "
                               f"the adapter {weights.sizes[0]} to {weights.sizes[1]} (made for another model?)")


def attach(adapter: LoraAdapter, block: Any, layer: int) -> None:
    """Serve ``adapter`` beside ``block`` (model layer ``layer``), after `check_targets`."""
    check_targets(adapter, block, layer)
    for path, weights in adapter.layers.get(layer, {}).items():
        module = block.get_submodule(path)
        table = _TABLES.get(module)
        if table is None:
            table = _TABLES[module] = {}
            module.register_forward_hook(_add_deltas)
        device = _device(module)
        table[adapter.name] = LoraWeights(weights.down.to(device), weights.up.to(device))  # no copy on one device


def _device(module: Any) -> Any:
    weight = next(iter(module.parameters()), None)
    return weight.device if weight is not None else "cpu"


@contextlib.contextmanager
def adapter_rows(rows: Sequence[tuple[str | None, slice]]) -> Iterator[None]:
    """Within this context, block calls give rows ``slice`` the adapter named beside it (None: the base model)."""
    token = _ROWS.set(tuple(rows) if any(name is not None for name, _ in rows) else None)
    try:
        yield
    finally:
        _ROWS.reset(token)


def _add_deltas(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    rows = _ROWS.get()
    table = _TABLES.get(module)
    if rows is None or not table or not args:
        return None
    import torch

    named = [(table[name], span) for name, span in rows if name is not None and name in table]
    if not named:
        return None
    x = args[0].reshape(-1, args[0].shape[-1])
    flat = output.reshape(-1, output.shape[-1])
    if len(named) == len(rows) == 1:
        served = named[0][0]
        return torch.addmm(flat, x.to(served.down.dtype) @ served.down, served.up).view(output.shape)
    total = rows[-1][1].stop
    per_row = x.shape[0] // total if total and x.shape[0] % total == 0 else 0
    if per_row == 0:
        raise RuntimeError(f"a block call of {args[0].shape[0]} rows cannot serve adapters laid out for {total} rows")
    result = flat.clone()  # the base rows as they are; each adapter's rows with their own delta
    for served, span in named:
        part = slice(span.start * per_row, span.stop * per_row)
        result[part] = torch.addmm(flat[part], x[part].to(served.down.dtype) @ served.down, served.up)
    return result.view(output.shape)
