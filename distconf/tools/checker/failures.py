"""Locating a failed check in the family file: which field to fix, and where it is written."""

from __future__ import annotations

import inspect
import re
from typing import Any

from distconf.errors import FamilyValidationError

__all__ = ["CheckFailure", "located_failure", "validation_failure", "crash_failure"]


class CheckFailure(Exception):
    """A family file does not describe its model correctly; ``field`` names what to fix."""

    def __init__(self, field: str, message: str, location: str | None = None) -> None:
        self.field = field
        self.location = location
        self.message = message
        where = f"{location}: " if location else ""
        super().__init__(f"{where}{field}: {message}")


def located_failure(cls: type, loc: tuple[str, ...], message: str) -> CheckFailure:
    """A `CheckFailure` at field ``loc`` of the family file of ``cls`` (path:line:column)."""
    problem = cls.family_source.problem(loc, message)  # type: ignore[attr-defined]
    return CheckFailure(problem.field, message, f"{problem.path}:{problem.line}:{problem.column}")


def validation_failure(exc: FamilyValidationError) -> CheckFailure:
    """A `CheckFailure` for a family file that does not even validate or resolve (each location printed once)."""
    if not exc.problems:
        return CheckFailure("<file>", str(exc))
    first = exc.problems[0]
    message = first.message
    if len(exc.problems) > 1:  # the others keep their own locations, on lines of their own
        message += "".join(f"\n  {p}" for p in exc.problems[1:])
    return CheckFailure(first.field or "<file>", message, f"{first.path}:{first.line}:{first.column}")


def crash_failure(cls: type, exc: Exception) -> CheckFailure:
    """Name the most likely field when running a block raised an exception."""
    from distconf.loader.synthesis import import_object

    spec = cls.family_spec  # type: ignore[attr-defined]
    message = f"{type(exc).__name__}: {exc}"
    call, position = spec.block.call, spec.block.position
    try:
        parameters: Any = inspect.signature(import_object(spec.block.layer_class).forward).parameters
    except (ImportError, TypeError, ValueError):
        parameters = {}
    wants_rotary = call.position_embeddings_argument in parameters
    if isinstance(exc, TypeError) and wants_rotary and position.rotary_class is None and not position.alibi_function:
        return located_failure(
            cls, ("block", "position", "rotary_class"),
            f"{message} (the layer takes {call.position_embeddings_argument!r} but the family declares "
            "no block.position.rotary_class, so it got None)")
    missing = re.search(r"missing \d+ required positional argument: '(\w+)'", str(exc))
    if isinstance(exc, TypeError) and missing and missing.group(1) in parameters:
        return located_failure(
            cls, ("block",),
            f"{message} (the layer's forward needs {missing.group(1)!r} and the family passes nothing under that "
            "name: map it with a block.call.*_argument; a position bias the model builds with its own function "
            "is block.call.alibi_argument with block.position.alibi_function and alibi_arguments)")
    if call.fresh_arguments and isinstance(exc, KeyError):  # a layer looked up what another layer stored
        names = ", ".join(call.fresh_arguments)
        return located_failure(cls, ("block", "call", "fresh_arguments"),
                               f"{message} (a layer reads what another layer stored in {names}: each block's layer "
                               "gets an empty one, so layers sharing K/V across layers cannot be served apart)")
    computed = _computed_buffers(cls)
    if computed and isinstance(exc, (RuntimeError, IndexError)):
        return located_failure(cls, ("block",), f"{message} (the layer computes buffers of its own: "
                               f"{', '.join(computed)}; check that the model class's _init_weights fills them, "
                               "and block.call, block.position and block.mask)")
    size_error = isinstance(exc, (RuntimeError, ValueError, IndexError)) and any(
        word in str(exc) for word in ("size", "shape", "dimension", "out of range", "out of bounds"))
    if size_error and spec.tiny_config:
        return located_failure(cls, ("tiny_config",), f"{message} (a tensor of a size the tiny config does not "
                               "make consistent: shrink every size, head count, window and per-layer list of "
                               "tiny_config together; else check block.call, block.position and block.mask)")
    return located_failure(cls, ("block",), f"{message} (check block.call, block.position and block.mask)")


def _computed_buffers(cls: type) -> list[str]:
    """Names of the non-persistent buffers a block of ``cls``'s tiny config computes itself."""
    import torch

    from distconf.blocks.build import block_class_for, constructor_kwargs
    from distconf.blocks.hf_compat import non_persistent_buffers

    tiny = cls.family_spec.tiny_config or {}  # type: ignore[attr-defined]
    try:
        config = cls(**{k: v for k, v in tiny.items() if k != "variants"})
        with torch.device("meta"):
            block = block_class_for(config)(**constructor_kwargs(config, 0))
        return [name for name, _ in non_persistent_buffers(block)]
    except Exception:  # only a hint: never hide the real failure
        return []
