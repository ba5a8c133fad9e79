"""Error types raised by distconf.

`FamilyValidationError` is the one error a bad family file produces: it collects
every problem at once, each located as ``path:line:column: field.path: message``.
Family files are untrusted: a problem never carries more than a short excerpt of
what the file says (`excerpt`), so validating the wrong file (a symlink to a
credentials file, say) does not print its contents.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Problem", "FamilyValidationError", "FamilyNotFoundError", "ConfigValueError", "ModelSourceError",
           "SwarmJoinError", "UnreachableServerError", "excerpt"]

EXCERPT_CHARS = 40
_MAX_FIELD_PART = 60
_MAX_FIELD = 120
_MAX_MESSAGE = 1000

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = EXCERPT_CHARS + 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxlevel = 3


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to at most ``limit`` characters (``...`` marks a cut).

    Use it for every piece of a family file (or of a config) quoted in a message.
    Large values are never fully formatted: strings and containers are cut before
    they are turned into text.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        shown = repr(value[: limit + 1]) if isinstance(value, (str, bytes)) else _REPR.repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        shown = f"<{type(value).__name__}>"
    return _cut(shown, limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 3, 1)] + "..."


def _short_field(field: str) -> str:
    parts = [_cut(part, _MAX_FIELD_PART) for part in field.split(".")] if field else []
    return _cut(".".join(parts), _MAX_FIELD)


@dataclass(frozen=True)
class Problem:
    """One located problem in a family file.

    ``field`` and ``message`` are cut to a bounded length on construction: callers
    quote file content through `excerpt`, this is the backstop.
    """

    path: str
    line: int
    column: int
    field: str
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "field", _short_field(str(self.field)))
        object.__setattr__(self, "message", _cut(str(self.message), _MAX_MESSAGE))

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


_MAX_REASON = 1000


class ModelSourceError(ValueError):
    """A model source (a folder, a GGUF file, a hub id) cannot be served; names the source and why.

    ``source`` is what the user named, ``reason`` one sentence (cut to a bounded length:
    reasons may quote a third-party error about an untrusted file).
    """

    def __init__(self, source: object, reason: str) -> None:
        self.source = str(source)
        reason = str(reason)
        self.reason = reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."
        super().__init__(f"{self.source}: cannot be served: {self.reason}")


class SwarmJoinError(RuntimeError):
    """No initial peer of a swarm could be reached: names each address and why (connection refused, ...).

    Every command that joins a swarm reports it in one line and exits with code 2.
    """

    def __init__(self, peers: object, reason: str) -> None:
        self.peers = [str(p) for p in peers] if isinstance(peers, (list, tuple)) else [str(peers)]
        self.reason = _cut(str(reason), _MAX_REASON)
        super().__init__(f"cannot join the swarm: {self.reason}")


class UnreachableServerError(RuntimeError):
    """Peers cannot reach this server, directly or through a relay: the cause and the fix, in one sentence."""
