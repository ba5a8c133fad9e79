"""Locating a failed check in the family file: which field to fix, and where it is written."""

from __future__ import annotations

import inspect
from typing import Any

from distconf.errors import FamilyValidationError

__all__ = ["CheckFailure", "located_failure", "validation_failure", "crash_failure"]


class CheckFailure(Exception):
    """A family file does not describe its model correctly; ``field`` names what to fix."""

    def __init__(self, field: str, message: str, location: str | None = None) -> None:
        self.field = field
        self.location = location
        where = f"{location}: " if location else ""
        super().__init__(f"{where}{field}: {message}")


def located_failure(cls: type, loc: tuple[str, ...], message: str) -> CheckFailure:
    """A `CheckFailure` at field ``loc`` of the family file of ``cls`` (path:line:column)."""
    problem = cls.family_source.problem(loc, message)  # type: ignore[attr-defined]
    return CheckFailure(problem.field, message, f"{problem.path}:{problem.line}:{problem.column}")


def validation_failure(exc: FamilyValidationError) -> CheckFailure:
    """A `CheckFailure` for a family file that does not even validate or resolve."""
    first = exc.problems[0] if exc.problems else None
    return CheckFailure(first.field if first and first.field else "<file>", str(exc))


def crash_failure(cls: type, exc: Exception) -> CheckFailure:
    """Name the most likely field when running a block raised an exception."""
    from distconf.family.synthesis import import_object

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
    return located_failure(cls, ("block",), f"{message} (check block.call, block.position and block.mask)")
