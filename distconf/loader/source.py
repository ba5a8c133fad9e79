"""One family file: read it safely, validate it, and keep where every field is written.

Family files are untrusted. A file is checked with ``stat`` before it is opened: only
a regular file of at most 1 MiB is read (never a FIFO or device, which could block or
never end), and never more than that many bytes (`distconf.loader.files`). Finding
files on the search path is `distconf.loader.search`. Nothing here imports torch or
transformers.

A `FamilySource` is the validated file: its `FamilySpec` plus the line and column of
every field, so any later layer (synthesis, blocks, the checker) can report a problem
at its place in the file with ``source.error(loc, message)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from distconf.errors import FamilyValidationError, Problem, excerpt
from distconf.loader.files import UnreadableFile, read_capped
from distconf.loader.spec import FamilySpec
from distconf.loader.yamlsafe import Location, YamlProblem, parse_yaml

__all__ = ["FamilySource", "FAMILY_SUFFIXES", "read_family_file", "MAX_FILE_BYTES"]

FAMILY_SUFFIXES = (".yaml", ".yml")
MAX_FILE_BYTES = 1 << 20
"""Largest family file read (1 MiB); checked with ``stat`` before reading, and while reading."""
_MAX_PROBLEMS = 20  # per file; the rest are counted, not listed


@dataclass(frozen=True)
class FamilySource:
    """A validated family file: its spec, where it came from, and where each field is written."""

    path: Path
    spec: FamilySpec
    locations: dict[tuple[Any, ...], Location]

    def location(self, loc: Iterable[Any]) -> Location:
        """(line, column) of the field at ``loc``, or of its closest written parent."""
        key = tuple(loc)
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key[:-1]
        return self.locations.get((), (1, 1))

    def problem(self, loc: Iterable[Any], message: str) -> Problem:
        """A `Problem` located at field ``loc`` of this file."""
        loc = tuple(loc)
        line, column = self.location(loc)
        return Problem(str(self.path), line, column, ".".join(map(str, loc)), message)

    def error(self, loc: Iterable[Any], message: str) -> FamilyValidationError:
        """A `FamilyValidationError` with one problem at field ``loc``."""
        return FamilyValidationError([self.problem(loc, message)])

    def __str__(self) -> str:
        return str(self.path)


def _clean_field(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop pydantic's validator tags (e.g. 'function-after[...]', '[key]') from an error loc."""
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))


def _describe(err: dict[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field (not in the family schema)"
    if kind == "missing":
        return "required field is missing"
    message = err.get("msg", "invalid value")
    message = message.removeprefix("Value error, ")
    value = err.get("input")
    if isinstance(value, (dict, list)) and kind not in ("dict_type", "list_type"):
        return message
    return f"{message} (got {excerpt(value)})"


def _problems_from_validation(path: Path, exc: ValidationError,
                              locations: dict[tuple[Any, ...], Location]) -> list[Problem]:
    source = FamilySource(path, None, locations)  # type: ignore[arg-type]
    problems = []
    for err in exc.errors(include_url=False):
        loc = _clean_field(tuple(err["loc"]))
        problems.append(source.problem(loc, _describe(err)))
    problems.sort(key=lambda p: (p.line, p.column))
    if len(problems) > _MAX_PROBLEMS:
        rest = problems[_MAX_PROBLEMS]
        count = len(problems) - _MAX_PROBLEMS
        more = Problem(rest.path, rest.line, rest.column, "", f"... and {count} more problem(s) in this file")
        problems = [*problems[:_MAX_PROBLEMS], more]
    return problems


def _check_is_family(path: Path, keys: Iterable[Any]) -> None:
    """Refuse a mapping that has no family field at all (the wrong file), without quoting any of it."""
    keys = list(keys)
    if set(FamilySpec.model_fields).intersection(keys):
        return
    required = [name for name, field in FamilySpec.model_fields.items() if field.is_required()]
    raise FamilyValidationError.single(
        path, f"not a family file: none of its {len(keys)} top-level key(s) is a family field "
              f"(a family file has {', '.join(required)})")


def read_family_file(path: str | Path) -> FamilySource:
    """Parse and validate one family file (no torch/transformers import).

    Raises `FamilyValidationError` listing every problem, each with its line.
    """
    path = Path(path)
    try:
        raw = read_capped(path, MAX_FILE_BYTES)
    except UnreadableFile as exc:
        raise FamilyValidationError.single(path, str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FamilyValidationError.single(path, f"family file is not UTF-8 text: {exc.reason}") from None
    try:
        data, locations = parse_yaml(text)
    except YamlProblem as exc:
        if exc.top_keys is not None:  # the wrong file is named as such before any of its values is quoted
            _check_is_family(path, exc.top_keys)
        raise FamilyValidationError.single(
            path, exc.message, line=exc.line, column=exc.column, field=".".join(map(str, exc.loc))
        ) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise FamilyValidationError.single(path, f"a family file must be a mapping of fields, this one is {kind}")
    _check_is_family(path, data)
    try:
        spec = FamilySpec.model_validate(data)
    except ValidationError as exc:
        raise FamilyValidationError(_problems_from_validation(path, exc, locations)) from None
    stem = path.name
    for suffix in FAMILY_SUFFIXES:
        stem = stem.removesuffix(suffix)
    if stem != spec.family:
        source = FamilySource(path, spec, locations)
        raise source.error(
            ("family",),
            f"family {spec.family!r} is declared in a file named {path.name!r}; "
            f"rename the file to {spec.family}.yaml or change this field",
        )
    source = FamilySource(path.resolve(), spec, locations)
    problems = source.spec.tiny_kv_groups_problems()
    if problems:
        raise FamilyValidationError([source.problem(("kv_groups",), message) for message in problems])
    return source
