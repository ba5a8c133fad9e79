"""Load the weights of one block from a local safetensors checkpoint.

``load_block_weights(model_dir, config, i)`` reads only the tensors of layer ``i``
(names starting with ``{prefix}.{i}.``, with or without the base-model prefix) from a
single ``model.safetensors`` or from the shards listed in
``model.safetensors.index.json``, opening only the shards that hold them. Each tensor
is read with positioned reads straight into its own buffer (converted to ``dtype`` as it
is read; fused MoE parameters are filled expert by expert in place), so peak memory stays
near the size of the block, not of a shard. Names are checked
against the block built on the meta device; every missing, unexpected or mis-shaped
tensor is reported in one `BlockWeightsError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distconf.blocks.build import build_block
from distconf.blocks.hf_compat import checkpoint_conversions, rename_checkpoint_key, stacking_operations

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockWeightsError", "checkpoint_files", "layer_prefixes", "layer_keys", "load_block_weights", "load_block",
    "read_safetensors_header",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 << 20

_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


class BlockWeightsError(ValueError):
    """The checkpoint does not hold exactly the tensors of the block (all problems listed)."""

    def __init__(self, message: str, *, missing: list[str] | None = None, unexpected: list[str] | None = None,
                 mismatched: list[str] | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []
        self.field = field


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where tensor data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise BlockWeightsError(f"{path}: not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise BlockWeightsError(f"{path}: safetensors header of {size} bytes is implausible")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of a local checkpoint to the file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_NAME
    if single.is_file():
        header, _ = read_safetensors_header(single)
        return dict.fromkeys(header, single)
    raise FileNotFoundError(f"{model_dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}")


def layer_prefixes(config: Any, layer_idx: int) -> list[str]:
    """Accepted name prefixes of layer ``layer_idx``: with and without the base-model prefix."""
    block = type(config).family_spec.block
    forms = [block.prefix]
    base = block.base_model_prefix
    if base:
        if block.prefix.startswith(base + "."):
            forms.append(block.prefix[len(base) + 1:])
        else:
            forms.append(f"{base}.{block.prefix}")
    return [f"{form}.{layer_idx}." for form in forms]


def layer_keys(names: list[str] | Any, config: Any, layer_idx: int) -> tuple[str | None, list[str]]:
    """The checkpoint names of layer ``layer_idx`` and the prefix form they use.

    If both forms occur, the family's own ``block.prefix`` wins.
    """
    for prefix in layer_prefixes(config, layer_idx):
        found = [name for name in names if name.startswith(prefix)]
        if found:
            return prefix, found
    return None, []


def _natural(key: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _layer_like_prefixes(names: Any) -> list[str]:
    counts: dict[str, int] = defaultdict(int)
    for name in names:
        match = re.match(r"^(.*?)\.(\d+)\.", name)
        if match:
            counts[match.group(1)] += 1
    return sorted(counts, key=lambda p: -counts[p])[:3]


def _conversions(config: Any) -> tuple[list[Any], list[Any]]:
    spec = type(config).family_spec
    if spec.block.checkpoint_conversion != "transformers":
        return [], []
    return checkpoint_conversions(spec.model_type)


class _Reader:
    """Reads single tensors from safetensors files with positioned reads (no memory map).

    Headers are parsed once per file. Reading straight into the tensor's own buffer (or a
    preallocated destination) keeps peak memory at the block plus at most one tensor:
    pages of a memory-mapped shard would stay resident, and be counted again, for every
    tensor that is converted, cast or copied into a fused parameter.
    """

    def __init__(self) -> None:
        self._headers: dict[Path, tuple[dict[str, Any], int]] = {}
        self._files: dict[Path, int] = {}
        self.files_opened: set[Path] = set()

    def info(self, path: Path, name: str) -> dict[str, Any]:
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
            self.files_opened.add(path)
        header, _ = self._headers[path]
        if name not in header:
            raise BlockWeightsError(f"{path.name} does not hold {name} (the index says it does)")
        return header[name]

    def _read_into(self, path: Path, offset: int, buffer: torch.Tensor) -> None:
        import torch

        fd = self._files.get(path)
        if fd is None:
            fd = self._files[path] = os.open(path, os.O_RDONLY)
        view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise BlockWeightsError(f"{path.name}: unexpected end of file")
            done += got

    def read(self, path: Path, name: str, dtype: torch.dtype | None, out: torch.Tensor | None = None,
             ) -> torch.Tensor:
        """Tensor ``name`` (cast to floating ``dtype``), or copied into ``out`` when given."""
        import torch

        info = self.info(path, name)
        _, data_start = self._headers[path]
        begin, end = info["data_offsets"]
        stored = getattr(torch, _DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if (out is not None and out.dtype == stored and out.is_contiguous() and tuple(out.shape) == shape
                and out.numel() * out.element_size() == end - begin):
            self._read_into(path, data_start + begin, out)
            return out
        tensor = torch.empty(shape, dtype=stored)
        if end > begin:
            self._read_into(path, data_start + begin, tensor)
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if out is not None:
            out.copy_(tensor)
            return out
        return tensor

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


def _expected(config: Any, layer_idx: int, block: Any = None) -> dict[str, tuple[int, ...]]:
    if block is None:
        block = build_block(config, layer_idx, device="meta")
    return {name: tuple(t.shape) for name, t in block.state_dict().items()}


def load_block_weights(model_dir: str | Path, config: Any, layer_idx: int, *,
                       dtype: torch.dtype | None = None, report: dict[str, Any] | None = None,
                       block: Any = None) -> dict[str, torch.Tensor]:
    """The state dict of block ``layer_idx`` (names as in the block), read from ``model_dir``.

    ``dtype`` converts floating-point tensors one at a time as they are read. If
    ``report`` is a dict, it receives ``files`` (the safetensors files opened) and
    ``prefix`` (the name prefix the layer's tensors use in this checkpoint) and
    ``converted`` (each converted parameter: 'streamed' into place or 'ops'). ``block``
    (optional) is the block the names and shapes are checked against; by default one is
    built on the meta device. Raises `BlockWeightsError` listing every missing, unexpected or mis-shaped tensor.
    """
    files = checkpoint_files(model_dir)
    prefix, names = layer_keys(files, config, layer_idx)
    expected = _expected(config, layer_idx, block)
    if prefix is None:
        tried = " or ".join(repr(p) for p in layer_prefixes(config, layer_idx))
        seen = ", ".join(repr(p) for p in _layer_like_prefixes(files)) or "none"
        raise BlockWeightsError(
            f"{model_dir}: no tensor of layer {layer_idx} starts with {tried}; layer-like prefixes in this "
            f"checkpoint: {seen}. Check block.prefix (and block.base_model_prefix) in the family file.",
            missing=sorted(expected), field="block.prefix",
        )
    renamings, converters = _conversions(config)
    rename_source_key = rename_checkpoint_key

    reader = _Reader()
    state: dict[str, torch.Tensor] = {}
    groups: dict[tuple[int, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    unexpected: list[str] = []
    mismatched: list[str] = []
    misshaped: set[str] = set()
    for name in sorted(names, key=_natural):
        target, pattern = rename_source_key(name, renamings, converters) if (renamings or converters) else (name, None)
        if not target.startswith(prefix):
            unexpected.append(name)
            continue
        local = target[len(prefix):]
        if pattern is not None:
            index = next(i for i, c in enumerate(converters) if pattern in c.source_patterns)
            groups[(index, local)][pattern].append(name)
            continue
        if local not in expected:
            unexpected.append(name)
            continue
        shape = tuple(reader.info(files[name], name)["shape"])
        if shape != expected[local]:
            mismatched.append(f"{name}: checkpoint {list(shape)}, block {list(expected[local])}")
            misshaped.add(local)
            continue
        state[local] = None  # type: ignore[assignment]  # placeholder, read below once all checks pass
    converted = {local for _, local in groups}
    missing_now = [k for k in expected if k not in state and k not in converted and k not in misshaped]
    if unexpected or mismatched or missing_now:
        _raise(model_dir, prefix, layer_idx, missing_now, unexpected, mismatched)
    import torch

    converted: dict[str, str] = {}
    with torch.no_grad(), contextlib.closing(reader):
        names_by_local = {}
        for name in names:
            target, pattern = (rename_source_key(name, renamings, converters) if (renamings or converters)
                               else (name, None))
            if pattern is None:
                names_by_local[target[len(prefix):]] = name
        for local in list(state):
            name = names_by_local[local]
            state[local] = reader.read(files[name], name, dtype)
        for (index, local), by_pattern in groups.items():
            converter = converters[index]
            streamed = _plan_stream(converter, by_pattern, reader, files)
            if streamed is not None and local in expected and streamed[0] == expected[local]:
                state[local] = _stream(streamed, reader, files, dtype)
                converted[local] = "streamed"
                continue
            converted[local] = "ops"
            collected: dict[str, Any] = {
                pattern: [reader.read(files[n], n, dtype) for n in by_pattern[pattern]]
                for pattern in converter.source_patterns if pattern in by_pattern
            }
            for op in converter.operations:
                collected = op.convert(collected, source_patterns=converter.source_patterns,
                                       target_patterns=converter.target_patterns, full_layer_name=prefix + local,
                                       model=None, config=config, missing_keys=None)
            if len(collected) != 1:
                raise BlockWeightsError(f"conversion of {local} gave {len(collected)} tensors, expected 1")
            tensor = next(iter(collected.values()))
            if local not in expected:
                unexpected.append(f"{prefix}{local} (converted)")
            elif tuple(tensor.shape) != expected[local]:
                mismatched.append(f"{prefix}{local} (converted): checkpoint {list(tensor.shape)}, "
                                  f"block {list(expected[local])}")
                misshaped.add(local)
            else:
                state[local] = tensor
    missing = [k for k in expected if k not in state and k not in misshaped]
    if unexpected or mismatched or missing:
        _raise(model_dir, prefix, layer_idx, missing, unexpected, mismatched)
    logger.debug("layer %d: %d tensors from %d file(s)", layer_idx, len(state), len(reader.files_opened))
    if report is not None:
        report["files"] = sorted(reader.files_opened)
        report["prefix"] = prefix
        report["converted"] = converted
    return state


def _plan_stream(converter: Any, by_pattern: dict[str, list[str]], reader: _Reader,
                 files: dict[str, Path]) -> tuple[tuple[int, ...], int, int | None, list[list[str]]] | None:
    """Plan a stack(+concatenate) conversion that copies each source into a preallocated result.

    Handles the chains transformers uses for MoE experts (``MergeModulelist`` optionally
    followed by ``Concatenate`` on another dim); returns (result shape, stack dim, concat
    dim, names per source pattern), or None to fall back to running the ops. Streaming
    keeps peak memory at the result plus one source tensor instead of three copies.
    """
    MergeModulelist, Concatenate = stacking_operations()
    ops = converter.operations
    if not ops or type(ops[0]) is not MergeModulelist or len(ops) > 2:
        return None
    if len(ops) == 2 and type(ops[1]) is not Concatenate:
        return None
    stack_dim, cat_dim = ops[0].dim, (ops[1].dim if len(ops) == 2 else None)
    groups = [by_pattern[p] for p in converter.source_patterns if p in by_pattern]
    if not groups or (cat_dim is None and len(groups) != 1) or cat_dim == stack_dim:
        return None
    shapes = [[tuple(reader.info(files[n], n)["shape"]) for n in names] for names in groups]
    if any(len(set(group)) != 1 for group in shapes) or len({len(names) for names in groups}) != 1:
        return None
    stacked = [list(group[0]) for group in shapes]
    for shape, names in zip(stacked, groups):
        shape.insert(stack_dim, len(names))
    if cat_dim is None:
        return tuple(stacked[0]), stack_dim, None, groups
    rest = {tuple(d for i, d in enumerate(shape) if i != cat_dim) for shape in stacked}
    if len(rest) != 1:
        return None
    result = list(stacked[0])
    result[cat_dim] = sum(shape[cat_dim] for shape in stacked)
    return tuple(result), stack_dim, cat_dim, groups


def _stream(plan: tuple[tuple[int, ...], int, int | None, list[list[str]]], reader: _Reader,
            files: dict[str, Path], dtype: torch.dtype | None) -> torch.Tensor:
    """Run a planned stack(+concatenate) conversion one source tensor at a time."""
    import torch

    shape, stack_dim, cat_dim, groups = plan
    out: torch.Tensor | None = None
    offset = 0
    for names in groups:
        width = 0
        for position, name in enumerate(names):
            info = reader.info(files[name], name)
            if out is None:
                stored = getattr(torch, _DTYPES[info["dtype"]])
                floating = torch.empty((), dtype=stored).is_floating_point()
                out = torch.empty(shape, dtype=dtype if (dtype is not None and floating) else stored)
            region = out
            if cat_dim is not None:
                width = info["shape"][cat_dim - 1 if cat_dim > stack_dim else cat_dim]
                region = region.narrow(cat_dim, offset, width)
            reader.read(files[name], name, dtype, out=region.select(stack_dim, position))
        offset += width
    assert out is not None
    return out


def _raise(model_dir: Any, prefix: str, layer_idx: int, missing: list[str], unexpected: list[str],
           mismatched: list[str]) -> None:
    lines = [f"{model_dir}: the tensors under {prefix!r} do not match block {layer_idx}:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(prefix + m for m in sorted(missing)))
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
    if mismatched:
        lines.append(f"  wrong shape ({len(mismatched)}): " + "; ".join(mismatched))
    lines.append("Check block.layer_class, block.prefix and block.checkpoint_conversion in the family file, "
                 "and that the checkpoint belongs to this config.")
    raise BlockWeightsError("\n".join(lines), missing=missing, unexpected=unexpected, mismatched=mismatched,
                            field="block.prefix")


def load_block(model_dir: str | Path, config: Any, layer_idx: int, *, dtype: torch.dtype | None = None,
               device: Any = "cpu") -> Any:
    """Build block ``layer_idx`` on the meta device and fill it with its checkpoint weights."""
    block = build_block(config, layer_idx, device="meta", dtype=dtype)
    state = load_block_weights(model_dir, config, layer_idx, dtype=dtype, block=block)
    if device not in (None, "cpu"):
        state = {k: v.to(device) for k, v in state.items()}
    block.load_state_dict(state, strict=True, assign=True)
    leftovers = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
    if leftovers:
        raise BlockWeightsError(f"block {layer_idx} still has tensors without data: {', '.join(leftovers)}")
    return block
