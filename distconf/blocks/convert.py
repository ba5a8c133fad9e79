"""Checkpoint conversions (transformers' rules): per-expert MoE tensors into fused parameters.

A conversion that only stacks the experts (and concatenates the stacks, e.g. gate and
up projections) is streamed: the fused parameter is allocated once, at its checked
shape, and each expert's tensor is copied (and cast) into its place, so memory stays
at the result plus nothing but the memory-mapped sources. Other conversions run
transformers' operations. Every transformers call goes through `hf_compat`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distconf.blocks.checkpoint import BlockWeightsError, release_pages
from distconf.blocks.hf_compat import (
    checkpoint_conversions,
    converter_sources,
    converter_targets,
    rename_checkpoint_key,
    run_conversion,
    stacking_dims,
)

if TYPE_CHECKING:
    import torch

    from distconf.blocks.checkpoint import Checkpoint

__all__ = ["Conversions", "Group", "plan_stream", "stream", "run_ops"]


@dataclass
class Group:
    """The checkpoint tensors that one converter turns into parameter ``local``."""

    converter: Any
    local: str
    by_pattern: dict[str, list[str]] = field(default_factory=dict)

    def sources(self) -> list[list[str]]:
        """The tensor names of each source pattern present, in the converter's order."""
        return [self.by_pattern[p] for p in converter_sources(self.converter) if p in self.by_pattern]

    def locals(self) -> list[str]:
        """The parameters the group converts to: ``local``, and its siblings when the converter splits one
        fused tensor into several (``query_key_value`` into ``q_proj``, ``k_proj``, ``v_proj``)."""
        targets = converter_targets(self.converter)
        if len(targets) > 1 and targets[0] in self.local:
            return [self.local.replace(targets[0], target, 1) for target in targets]
        return [self.local]


@dataclass
class _Shapes:
    """The block's parameter shapes, asked by name as transformers' operations ask a model (``Split``)."""

    prefix: str
    expected: dict[str, tuple[tuple[int, ...], Any]]

    def get_parameter(self, name: str) -> Any:
        import torch

        shape, dtype = self.expected[name.removeprefix(self.prefix)]
        return torch.empty(shape, dtype=dtype, device="meta")


class Conversions:
    """transformers' renamings and converters for a config's model type (none if the family opts out)."""

    def __init__(self, config: Any, names: list[str], wanted: Any) -> None:
        """Rules for ``names``; none are looked up when every name is already one of ``wanted``
        (building transformers' table of rules takes a noticeable part of a second, once per process)."""
        spec = type(config).family_spec
        enabled = spec.block.checkpoint_conversion == "transformers" and not all(n in wanted for n in names)
        self.renamings, self.converters = checkpoint_conversions(spec.model_type) if enabled else ([], [])

    def target(self, name: str) -> tuple[str, Any, str | None]:
        """(parameter name, converter or None, matched source pattern or None) of a checkpoint name."""
        if not (self.renamings or self.converters):
            return name, None, None
        target, pattern = rename_checkpoint_key(name, self.renamings, self.converters)
        if pattern is None:
            return target, None, None
        converter = next(c for c in self.converters if pattern in converter_sources(c))
        return target, converter, pattern


def order_problem(pattern: str, names: list[str]) -> str | None:
    """Sort ``names`` by their ``*`` index in place; a problem unless the indices are exactly 0..n-1."""
    if pattern.count("*") != 1:
        return None
    regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
    found = [regex.search(name) for name in names]
    if not all(found):
        return None
    indices = [int(m.group(1)) for m in found if m]
    names[:] = [name for _, name in sorted(zip(indices, names))]
    if sorted(indices) != list(range(len(names))):
        shown = sorted(indices)[:8]
        return f"indices of {pattern!r} are {shown}{'...' if len(indices) > 8 else ''}, not 0..{len(names) - 1}"
    return None


def plan_stream(group: Group, info: Any) -> tuple[tuple[tuple[int, ...], int, int | None] | None, str | None]:
    """((fused shape, stack dim, concatenate dim) or None, problem or None), from header shapes only.

    ``info(name)`` gives (dtype name, shape). The plan is None when the converter does more
    than stack (and concatenate): then transformers' operations run. A stacking converter
    whose sources do not fit together is a problem (reported, nothing allocated).
    """
    dims = stacking_dims(group.converter)
    groups = group.sources()
    if dims is None or not groups:
        return None, None
    stack_dim, cat_dim = dims
    if (cat_dim is None and len(groups) != 1) or cat_dim == stack_dim or min(stack_dim, cat_dim or 0) < 0:
        return None, None
    shapes = [[info(n)[1] for n in names] for names in groups]
    for names, group_shapes in zip(groups, shapes):
        if len(set(group_shapes)) != 1:
            odd = next(n for n, s in zip(names, group_shapes) if s != group_shapes[0])
            return None, f"{odd} has shape {list(info(odd)[1])}, {names[0]} {list(group_shapes[0])}"
    if len({len(names) for names in groups}) != 1:
        return None, "the sources have different numbers of tensors: " + ", ".join(str(len(n)) for n in groups)
    stacked = [[*s[0][:stack_dim], len(names), *s[0][stack_dim:]] for s, names in zip(shapes, groups)]
    if any(not 0 <= stack_dim < len(s) for s in stacked) or (
            cat_dim is not None and any(not 0 <= cat_dim < len(s) for s in stacked)):
        return None, f"sources of {len(shapes[0][0])} dimensions cannot be stacked as the conversion does"
    if cat_dim is None:
        return (tuple(stacked[0]), stack_dim, None), None
    if len({tuple(d for i, d in enumerate(s) if i != cat_dim) for s in stacked}) != 1:
        return None, "the stacked sources differ outside the concatenated dimension: " + "; ".join(
            str(s) for s in stacked)
    result = list(stacked[0])
    result[cat_dim] = sum(s[cat_dim] for s in stacked)
    return (tuple(result), stack_dim, cat_dim), None


def stream(group: Group, plan: tuple[tuple[int, ...], int, int | None], checkpoint: Checkpoint,
           dtype: torch.dtype) -> torch.Tensor:
    """Fill the fused parameter of a planned group one source tensor at a time (cast as copied)."""
    import torch

    shape, stack_dim, cat_dim = plan
    out = torch.empty(shape, dtype=dtype)
    offset = 0
    for names in group.sources():
        width = 0
        for position, name in enumerate(names):
            source = checkpoint.tensor(name)
            region = out
            if cat_dim is not None:
                width = source.shape[cat_dim - 1 if cat_dim > stack_dim else cat_dim]
                region = region.narrow(cat_dim, offset, width)
            region.select(stack_dim, position).copy_(source)
            release_pages(source)
        offset += width
    return out


def run_ops(group: Group, checkpoint: Checkpoint, dtype: torch.dtype | None, layer_name: str,
            config: Any, expected: dict[str, tuple[tuple[int, ...], Any]] | None = None) -> list[Any]:
    """The tensors transformers' operations make of the group's sources (each source cast first).

    ``expected``: the block's parameter shapes (by name under the layer's prefix), for
    operations that size their outputs by them.
    """
    collected: dict[str, list[Any]] = {}
    for pattern in converter_sources(group.converter):
        if pattern in group.by_pattern:
            tensors = [checkpoint.tensor(n) for n in group.by_pattern[pattern]]
            collected[pattern] = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in tensors]
    try:
        shapes = _Shapes(layer_name[: len(layer_name) - len(group.local)], expected or {})
        return list(run_conversion(group.converter, collected, layer_name, config, shapes).values())
    except Exception as exc:  # transformers' operations on tensors that do not fit together
        raise BlockWeightsError(f"{checkpoint.model_dir}: converting the tensors of {layer_name} failed: "
                                f"{type(exc).__name__}: {str(exc)[:300]}") from None
