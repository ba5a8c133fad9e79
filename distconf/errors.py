"""Error types raised by distconf.

`FamilyValidationError` is the one error a bad family file produces: it collects
every problem at once, each located as ``path:line:column: field.path: message``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Problem", "FamilyValidationError", "FamilyNotFoundError", "ConfigValueError"]


@dataclass(frozen=True)
class Problem:
    """One located problem in a family file."""

    path: str
    line: int
    column: int
    field: str
    message: str

    def __str__(self) -> str:
        field = self.field or "<file>"
        return f"{self.path}:{self.line}:{self.column}: {field}: {self.message}"


class FamilyValidationError(ValueError):
    """A family file (or a set of them) is invalid; lists every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems: list[Problem] = sorted(problems, key=lambda p: (p.path, p.line, p.column))
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def single(cls, path: str | Path, message: str, *, line: int = 1, column: int = 1,
               field: str = "") -> FamilyValidationError:
        """Build an error holding one problem."""
        return cls([Problem(str(path), line, column, field, message)])


class FamilyNotFoundError(LookupError):
    """No family file of that name is on the search path."""


class ConfigValueError(ValueError):
    """A distributed-config field holds a value outside its allowed range."""
