"""Load the weights of one block from a local safetensors checkpoint.

``load_block_weights(model_dir, config, i)`` reads only the tensors of layer ``i``
(names starting with ``{prefix}.{i}.``, with or without the base-model prefix) from a
single ``model.safetensors`` or from the shards listed in ``model.safetensors.index.json``,
opening only the shards that hold them, each once (`distconf.blocks.checkpoint`). Tensors
are memory-mapped views of the files; a cast to ``dtype`` happens tensor by tensor, and
fused MoE parameters are filled expert by expert in place (`distconf.blocks.convert`).
Every name, shape and dtype is checked against the block built on the meta device, from
the file headers alone, before any tensor is read or allocated (only the result of a
conversion other than stacking experts is checked after it ran); all problems are
reported in one `BlockWeightsError`, and nothing partly loaded is ever returned.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distconf.blocks.build import build_block
from distconf.blocks.checkpoint import BlockWeightsError, Checkpoint, checkpoint_files, release_pages, torch_dtype
from distconf.blocks.convert import Conversions, Group, order_problem, plan_stream, run_ops, stream
from distconf.blocks.hf_compat import checkpoint_conversions, rename_checkpoint_key
from distconf.blocks.safetensors_header import read_safetensors_header, tensor_label
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_stack import model_layer

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockWeightsError", "checkpoint_files", "layer_prefixes", "layer_keys", "load_block_weights", "load_block",
    "read_safetensors_header",
]

logger = logging.getLogger(__name__)


def layer_prefixes(config: DistributedConfig, layer_idx: int) -> list[str]:
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


def layer_keys(names: list[str] | Any, config: DistributedConfig, layer_idx: int) -> tuple[str | None, list[str]]:
    """The checkpoint names of layer ``layer_idx`` and the prefix form they use.

    If both forms occur, the family's own ``block.prefix`` wins. A checkpoint stored under
    another layout (e.g. exaone's ``transformer.h``) matches after transformers' renaming rules
    for the model type, unless the family opts out (``block.checkpoint_conversion: none``);
    the names returned are then the stored ones, renamed again as they are read.
    """
    for prefix in layer_prefixes(config, layer_idx):
        found = [name for name in names if name.startswith(prefix)]
        if found:
            return prefix, found
    spec = type(config).family_spec
    if spec.block.checkpoint_conversion != "transformers":
        return None, []
    renamings = checkpoint_conversions(spec.model_type)[0]
    if not renamings:
        return None, []
    renamed = {name: rename_checkpoint_key(name, renamings, [])[0] for name in names}
    for prefix in layer_prefixes(config, layer_idx):
        found = [name for name, target in renamed.items() if target.startswith(prefix)]
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


def _expected(config: DistributedConfig, layer_idx: int, block: Any = None) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Name -> (shape, dtype) of every tensor of the block (built on the meta device unless given)."""
    if block is None:
        block = build_block(config, layer_idx, device="meta", buffers_device=None)
    return {name: (tuple(t.shape), t.dtype) for name, t in block.state_dict().items()}


def _dtype_problem(stored: str, wanted: torch.dtype) -> str | None:
    """Floating checkpoints cast into floating parameters; anything else must match exactly."""
    have = torch_dtype(stored)
    if have is not None and (have == wanted or (have.is_floating_point and wanted.is_floating_point)):
        return None
    return f"checkpoint {stored}, block {str(wanted).removeprefix('torch.')}"


@dataclass
class _Match:
    """The layer's checkpoint tensors sorted to the block's parameters, and every problem found."""

    prefix: str
    expected: dict[str, tuple[tuple[int, ...], Any]]
    direct: dict[str, str] = field(default_factory=dict)
    groups: dict[tuple[int, str], Group] = field(default_factory=dict)
    plans: dict[str, Any] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    wrong_dtype: list[str] = field(default_factory=list)
    faulty: set[str] = field(default_factory=set)

    def sort(self, names: list[str], conversions: Conversions) -> None:
        """Sort each name to a parameter (directly or through a converter) or to unexpected."""
        for name in sorted(names, key=_natural):
            target, converter, pattern = conversions.target(name)
            local = target[len(self.prefix):]
            if not target.startswith(self.prefix):
                self.unexpected.append(name)
            elif converter is not None:
                group = self.groups.setdefault((id(converter), local), Group(converter, local))
                group.by_pattern.setdefault(pattern, []).append(name)
            elif local not in self.expected:
                self.unexpected.append(name)
            elif local in self.direct:
                self.unexpected.append(f"{name} (same parameter as {self.direct[local]})")
            else:
                self.direct[local] = name

    def check(self, checkpoint: Checkpoint) -> None:
        """Shapes and dtypes from the headers, against the block; fused shapes planned, nothing read."""
        for local, name in self.direct.items():
            self._compare(local, name, *checkpoint.info(name))
        for group in self.groups.values():
            names = [n for names in group.by_pattern.values() for n in names]
            if group.local not in self.expected or group.local in self.direct:
                also = f", also stored as {self.direct[group.local]}" if group.local in self.direct else ""
                self.unexpected += [f"{n} (converts to {self.prefix}{group.local}{also})" for n in names]
                continue
            for pattern, members in group.by_pattern.items():
                problem = order_problem(pattern, members)
                if problem:
                    self.add_mismatch(group.local, f"{self.prefix}{group.local} (converted): {problem}")
            for name in names:
                self._compare(group.local, name, checkpoint.info(name)[0], None)
            plan, problem = plan_stream(group, checkpoint.info)
            if problem:
                self.add_mismatch(group.local, f"{self.prefix}{group.local} (converted): {problem}")
            elif plan is not None and plan[0] != self.expected[group.local][0]:
                self.add_mismatch(group.local, f"{self.prefix}{group.local} (converted): checkpoint "
                                            f"{list(plan[0])}, block {list(self.expected[group.local][0])}")
            elif plan is not None:
                self.plans[group.local] = plan

    def _compare(self, local: str, name: str, stored: str, shape: tuple[int, ...] | None) -> None:
        want_shape, want_dtype = self.expected[local]
        if shape is not None and shape != want_shape:
            self.add_mismatch(local, f"{name}: checkpoint {list(shape)}, block {list(want_shape)}")
        problem = _dtype_problem(stored, want_dtype)
        if problem:
            self.wrong_dtype.append(f"{name}: {problem}")
            self.faulty.add(local)

    def add_mismatch(self, local: str, text: str) -> None:
        """Record a shape problem of parameter ``local``."""
        self.mismatched.append(text)
        self.faulty.add(local)

    def raise_problems(self, model_dir: Any, layer_idx: int, have: Any = ()) -> None:
        """Raise one `BlockWeightsError` with every problem, if there is any."""
        covered = {*self.direct, *(t for g in self.groups.values() for t in g.locals()), *have}
        missing = [k for k in self.expected if k not in covered and k not in self.faulty]
        if self.unexpected or self.mismatched or self.wrong_dtype or missing:
            _raise(model_dir, self.prefix, layer_idx, missing, self)


def _read(match: _Match, checkpoint: Checkpoint, dtype: torch.dtype | None,
          config: DistributedConfig) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read every checked tensor (cast one by one) and run the conversions."""
    state: dict[str, torch.Tensor] = {}
    for local, name in match.direct.items():
        tensor = checkpoint.tensor(name)
        state[local] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        if state[local].data_ptr() != tensor.data_ptr():
            release_pages(tensor)  # cast: the mapped source is not needed any more
    converted: dict[str, str] = {}
    for group in match.groups.values():
        local = group.local
        if local in match.plans:
            stored = torch_dtype(checkpoint.info(group.sources()[0][0])[0])
            out_dtype = dtype if dtype is not None and stored.is_floating_point else stored
            state[local], converted[local] = stream(group, match.plans[local], checkpoint, out_dtype), "streamed"
            continue
        converted[local] = "ops"
        results = run_ops(group, checkpoint, dtype, match.prefix + local, config, match.expected)
        shapes = [list(t.shape) for t in results]
        targets = group.locals()
        wanted = [list(match.expected[t][0]) if t in match.expected else None for t in targets]
        if shapes != wanted:
            match.add_mismatch(local, f"{match.prefix}{local} (converted): checkpoint {', '.join(map(str, shapes))}, "
                                   f"block {', '.join(map(str, wanted))}")
        else:
            state.update(zip(targets, results))
    return state, converted


def load_block_weights(model_dir: str | Path, config: DistributedConfig, layer_idx: int, *,
                       dtype: torch.dtype | None = None, report: dict[str, Any] | None = None,
                       block: Any = None) -> dict[str, torch.Tensor]:
    """The state dict of block ``layer_idx`` (names as in the block), read from ``model_dir``.

    ``dtype`` converts floating-point tensors one at a time as they are read (a floating
    checkpoint casts into a floating parameter; integer or bool data never does). If
    ``report`` is a dict, it receives ``files`` (the safetensors files opened),
    ``prefix`` (the name prefix the layer's tensors use in this checkpoint) and
    ``converted`` (each converted parameter: 'streamed' into place or 'ops'). ``block``
    (optional) is the block the names, shapes and dtypes are checked against; by default
    one is built on the meta device. Raises `BlockWeightsError` listing every missing,
    unexpected, mis-shaped or wrongly typed tensor, or naming the invalid file.
    """
    import torch

    expected = _expected(config, layer_idx, block)
    layer = model_layer(config, layer_idx)  # a looped layer stack's blocks share their layer's tensors
    with Checkpoint(model_dir) as checkpoint, torch.no_grad():
        prefix, names = layer_keys(checkpoint.names, config, layer)
        if prefix is None:
            _raise_no_layer(model_dir, config, layer, checkpoint.names, expected)
        match = _Match(prefix, expected)
        match.sort(names, Conversions(config, names, {prefix + local for local in expected}))
        _add_tied(match, getattr(block, "distconf_tied", None) or {}, checkpoint.names, config, layer_idx)
        match.check(checkpoint)
        match.raise_problems(model_dir, layer_idx)
        state, converted = _read(match, checkpoint, dtype, config)
        match.raise_problems(model_dir, layer_idx, state)
        files = sorted(checkpoint.files_opened)
    logger.debug("layer %d: %d tensors from %d file(s)", layer_idx, len(state), len(files))
    if report is not None:
        report.update(files=files, prefix=prefix, converted=converted)
    return state


def _add_tied(match: _Match, tied: dict[str, tuple[int, str]], names: Any, config: DistributedConfig,
              layer_idx: int) -> None:
    """Read the block's tensors the model ties to another layer's (saved only there) from that layer's names."""
    forms = layer_prefixes(config, layer_idx)
    if not tied or match.prefix not in forms:
        return
    form = forms.index(match.prefix)
    stored = set(names)
    for local, (index, there) in tied.items():
        name = layer_prefixes(config, index)[form] + there
        if local in match.expected and local not in match.direct and name in stored:
            match.direct[local] = name


def _raise_no_layer(model_dir: Any, config: DistributedConfig, layer_idx: int, names: Any, expected: Any) -> None:
    tried = " or ".join(repr(p) for p in layer_prefixes(config, layer_idx))
    seen = ", ".join(tensor_label(p) for p in _layer_like_prefixes(names)) or "none"
    raise BlockWeightsError(
        f"{model_dir}: no tensor of layer {layer_idx} starts with {tried}; layer-like prefixes in this "
        f"checkpoint: {seen}. Check block.prefix (and block.base_model_prefix) in the family file.",
        missing=sorted(expected), field="block.prefix",
    )


def _listed(items: list[str], sep: str, most: int = 40) -> str:
    """Items of an untrusted checkpoint for a message: each and their number bounded."""
    shown = [item if len(item) <= 300 else item[:297] + "..." for item in items[:most]]
    return sep.join(shown) + (f"{sep}... and {len(items) - most} more" if len(items) > most else "")


def _raise(model_dir: Any, prefix: str, layer_idx: int, missing: list[str], match: _Match) -> None:
    lines = [f"{model_dir}: the tensors under {prefix!r} do not match block {layer_idx}:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + _listed([prefix + m for m in sorted(missing)], ", "))
    if match.unexpected:
        lines.append(f"  unexpected ({len(match.unexpected)}): " + _listed(sorted(match.unexpected), ", "))
    if match.mismatched:
        lines.append(f"  wrong shape ({len(match.mismatched)}): " + _listed(match.mismatched, "; "))
    if match.wrong_dtype:
        lines.append(f"  wrong dtype ({len(match.wrong_dtype)}): " + _listed(match.wrong_dtype, "; "))
    names_wrong = bool(missing or match.unexpected or match.mismatched)
    if names_wrong:
        lines.append("Check block.layer_class, block.prefix and block.checkpoint_conversion in the family file, "
                     "and that the checkpoint belongs to this config.")
    raise BlockWeightsError("\n".join(lines), missing=missing, unexpected=match.unexpected,
                            mismatched=match.mismatched, wrong_dtype=match.wrong_dtype,
                            field="block.prefix" if names_wrong else None)


def load_block(model_dir: str | Path, config: DistributedConfig, layer_idx: int, *, dtype: torch.dtype | None = None,
               device: Any = "cpu") -> Any:
    """Build block ``layer_idx`` on the meta device and fill it with its checkpoint weights.

    The block is returned only when every tensor loaded; on any error none is. On the CPU,
    parameters stored in the wanted dtype are views of the memory-mapped checkpoint (their
    pages are file-backed: shared with the page cache, reclaimable and read again on use).
    """
    block = build_block(config, layer_idx, device="meta", dtype=dtype, buffers_device=device)
    state = load_block_weights(model_dir, config, layer_idx, dtype=dtype, block=block)
    if device not in (None, "cpu"):
        state = {k: v.to(device) for k, v in state.items()}
    block.load_state_dict(state, strict=True, assign=True)
    leftovers = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
    if leftovers:
        raise BlockWeightsError(f"block {layer_idx} still has tensors without data: {', '.join(leftovers)}")
    return block
