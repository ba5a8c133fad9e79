"""``block.layer_stack.loop``: a range of layers the tiny model runs several times in one forward pass.

The tiny model's layers are counted as it runs: one contiguous range ``[start, end)`` run ``count`` times (every
other layer once) is a looped stack. Each of start, end - start and count is written as the integer config field
whose increment (with one more layer, when the config must add up its layers) moves it by one, confirmed by
running that config. The entry module is the weightless module of the causal LM for which every pass's input is
``module(hidden) + module(input)`` (``entry: module_sum``). A string field the config types as a choice of
values, for which another choice makes the model's own cached decoding differ from its full forward pass, is
pinned (``requires``): the blocks are exact only for the value that reproduces it.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_layer_stack", "layer_calls"]

_TOKENS = 6
_TOLERANCE = 1e-5


@dataclass(frozen=True)
class _Run:
    """The tiny config, its model, the path of its layer list and each layer's calls ``(input, output)``."""

    config: Any
    model: Any
    layer_list: str
    calls: list[list[tuple[Any, Any]]]


@dataclass(frozen=True)
class _Observed:
    """The looped range the tiny model ran, and every layer's calls ``(input, output)`` in order."""

    start: int
    end: int
    count: int
    calls: list[list[tuple[Any, Any]]]


def layer_calls(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> _Run | None:
    """The tiny config, its model and each of its layers' calls ``(hidden input, hidden output)`` in one forward pass on
    ``_TOKENS`` ids without a cache (None when it does not build or run)."""
    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation, Forward(use_cache=False, tokens=_TOKENS, seed=0))
    if record.error is not None:
        return None
    calls: list[list[tuple[Any, Any]]] = [[] for _ in range(record.layer_count)]
    for call in record.calls:
        if call.io is not None:
            calls[call.index].append(call.io)
    return _Run(record.config, record.model, record.layer_list, calls)


def _observe(calls: list[list[tuple[Any, Any]]]) -> _Observed | str | None:
    """The one looped range of ``calls`` (None: every layer ran once or never; the reason when it is not one
    contiguous range run a number of times)."""
    counts = [len(c) for c in calls]
    looped = [i for i, n in enumerate(counts) if n > 1]
    if not looped:
        return None
    start, end = looped[0], looped[-1] + 1
    count = counts[start]
    if any(counts[i] != count for i in range(start, end)) or any(n > 1 for n in counts[:start] + counts[end:]):
        return f"the model runs its layers {counts} times each: not one contiguous range looped"
    return _Observed(start, end, count, calls)


def _quantities(observed: _Observed) -> tuple[int, int, int]:
    return observed.start, observed.end - observed.start, observed.count


def _with_one_more(tiny: Mapping[str, Any], name: str, layers: int) -> list[dict[str, Any]]:
    """``tiny`` with field ``name`` one larger; and also with one more layer (per-layer lists lengthened by
    their last entry), for a config whose layer counts must add up."""
    plain = {**tiny, name: tiny[name] + 1}
    longer = {**plain, "num_hidden_layers": layers + 1}
    for key, value in tiny.items():
        if isinstance(value, list) and len(value) == layers and value:
            longer[key] = [*value, value[-1]]
    return [plain, longer]


def _fields(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
            observed: _Observed) -> tuple[list[int | str], list[str]]:
    """start, width and count each as the field moving it by one (the number itself when none does), and the
    review notes for those written as numbers."""
    base = _quantities(observed)
    layers = tiny.get("num_hidden_layers")
    found: list[str | None] = [None, None, None]
    for name, value in tiny.items():
        if name == "num_hidden_layers" or not is_int(value) or value not in base or not is_int(layers):
            continue
        for values in _with_one_more(tiny, name, layers):
            run = layer_calls(config_class, values, attn_implementation)
            seen = _observe(run.calls) if run is not None else None
            if not isinstance(seen, _Observed):
                continue
            moved = [b - a for a, b in zip(base, _quantities(seen), strict=True)]
            if sorted(moved) == [0, 0, 1]:
                index = moved.index(1)
                if found[index] is None and base[index] == value:
                    found[index] = name
            break
    names = ("start", "end - start", "count")
    review = [f"block.layer_stack.loop: no config field gives the loop's {names[i]} ({base[i]}); written as a "
              "number" for i in range(3) if found[i] is None]
    return [f if f is not None else b for f, b in zip(found, base, strict=True)], review


def _entry_module(model: Any, layer_list: str, observed: _Observed) -> str | None:
    """The weightless module of ``model`` with every pass's input ``module(previous) + module(input)``."""
    import torch

    start, end = observed.start, observed.end
    stack_input = observed.calls[start - 1][0][1]
    passes = [(observed.calls[start][k][0], stack_input if k == 0 else observed.calls[end - 1][k - 1][1])
              for k in range(observed.count)]
    inside = layer_list + "."
    for name, module in model.named_modules():
        if not name or name.startswith(inside) or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            continue
        try:
            with torch.no_grad():
                if all(torch.allclose(module(previous) + module(stack_input), entered, atol=_TOLERANCE,
                                      rtol=_TOLERANCE) for entered, previous in passes):
                    return name
        except Exception:  # a module that takes no hidden state is no entry module
            continue
    return None


def _choices(config_class: type) -> dict[str, tuple[str, ...]]:
    """Config fields typed as a choice of strings (``Literal["a", "b"]``, not postponed) and their choices."""
    import inspect

    found: dict[str, tuple[str, ...]] = {}
    for klass in reversed(config_class.__mro__):  # each class alone: a name one cannot resolve spoils no other
        for name, hint in inspect.get_annotations(klass).items():
            if typing.get_origin(hint) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(hint)):
                found[name] = typing.get_args(hint)
    return found


def _cache_exact(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> bool | None:
    """Whether the tiny model's decoding with its own cache gives its full forward pass's logits (None when it
    does not run)."""
    from distconf.tools.drafting.probe_runs import decodes_as_forward

    return decodes_as_forward(config_class, tiny, attn_implementation, _TOKENS, _TOLERANCE)


def _requires(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
              config: Any) -> dict[str, str]:
    """``{field: value}`` for each choice field whose other choices make the model's cache inexact."""
    pinned = {}
    for name, choices in _choices(config_class).items():
        value = field_value(config, name)
        if value not in choices or len(choices) < 2:
            continue
        if not _cache_exact(config_class, {**tiny, name: value}, attn_implementation):
            continue
        if any(_cache_exact(config_class, {**tiny, name: other}, attn_implementation) is False
               for other in choices if other != value):
            pinned[name] = value
    return pinned


def draft_layer_stack(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``block.layer_stack.loop`` when the tiny model loops a range of its layers (a review note when it
    loops them otherwise or no entry module explains a pass's input)."""
    config_class, tiny = facts.config_class, facts.tiny
    run = layer_calls(config_class, tiny, draft.attn_implementation)
    if run is None:
        return
    observed = _observe(run.calls)
    if observed is None:
        return
    if isinstance(observed, str):
        draft.review.append(f"{observed}; a chain of blocks cannot run it")
        return
    if observed.start == 0:
        draft.review.append("the model loops its layers from the first one on: block.layer_stack.loop needs a "
                            "layer before the loop")
        return
    entry = _entry_module(run.model, run.layer_list, observed)
    if entry is None:
        draft.review.append(f"the model runs layers {observed.start}..{observed.end - 1} {observed.count} times, "
                            "but no weightless module m gives each pass's input as m(hidden) + m(input): "
                            "block.layer_stack.loop not drafted")
        return
    (start, width, count), review = _fields(config_class, tiny, draft.attn_implementation, observed)
    loop: dict[str, Any] = {"start": start, "end": _end(start, width), "count": count, "entry": "module_sum",
                            "entry_module": entry}
    requires = _requires(config_class, tiny, draft.attn_implementation, run.config)
    if requires:
        loop["requires"] = requires
    draft.layer_stack = {"loop": loop}
    draft.review.extend(review)
    draft.facts.append(f"the model runs layers {observed.start}..{observed.end - 1} {observed.count} times in one "
                       f"forward pass, each pass entered as {entry}(hidden) + {entry}(input): blocks are the "
                       "unrolled layers (block.layer_stack.loop)"
                       + (f"; exact only for {', '.join(f'{k}={v}' for k, v in requires.items())} (another "
                          "value makes the model's own cache differ from its full forward pass)" if requires else ""))


def _end(start: int | str, width: int | str) -> int | str:
    if isinstance(start, int) and isinstance(width, int):
        return start + width
    return f"{start} + {width}"

