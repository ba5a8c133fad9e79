"""Family files on disk: find, parse and validate them, keeping where every field is written.

Search path: the built-in ``families/`` folder, then each folder listed in
``DISTCONF_FAMILIES_PATH`` (``os.pathsep``-separated). A path to a ``.yaml`` file
names that file directly. Nothing here imports torch or transformers.

Family files are untrusted. A file is checked with ``stat`` before it is opened: only
a regular file of at most 1 MiB is read (never a FIFO or device, which could block or
never end), and never more than that many bytes. A file on the search path that cannot
be read (or, when scanning every family, is invalid) is skipped with a logged warning,
so it cannot break the other families; a file named directly raises its error.

A `FamilySource` is the validated file: its `FamilySpec` plus the line and column of
every field, so any later layer (synthesis, blocks, the checker) can report a problem
at its place in the file with ``source.error(loc, message)``.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from distconf.errors import FamilyNotFoundError, FamilyValidationError, Problem, excerpt
from distconf.family.data import builtin_families_dir
from distconf.family.spec import FamilySpec
from distconf.family.yamlsafe import Location, YamlProblem, file_kind, file_problem, parse_yaml, read_capped

__all__ = [
    "FamilySource", "FAMILIES_PATH_ENV", "FAMILY_SUFFIXES", "family_search_path", "read_family_file",
    "validate_paths", "find_family_file", "list_families", "scan_valid_sources", "is_family_path", "MAX_FILE_BYTES",
]

FAMILIES_PATH_ENV = "DISTCONF_FAMILIES_PATH"
FAMILY_SUFFIXES = (".yaml", ".yml")
MAX_FILE_BYTES = 1 << 20
"""Largest family file read (1 MiB); checked with ``stat`` before reading, and while reading."""
_MAX_PROBLEMS = 20  # per file; the rest are counted, not listed
_warned: set[tuple[str, str]] = set()
logger = logging.getLogger(__name__)


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


def family_search_path() -> list[Path]:
    """Folders searched for family files, in order."""
    dirs = [builtin_families_dir()]
    for entry in os.environ.get(FAMILIES_PATH_ENV, "").split(os.pathsep):
        if entry.strip():
            dirs.append(Path(entry.strip()).expanduser())
    return dirs


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
    except YamlProblem as exc:
        raise FamilyValidationError.single(path, exc.message) from None
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


def _warn_skip(path: Path, reason: str) -> None:
    """Log (once per file and reason) that a file on the search path is skipped."""
    if (str(path), reason) not in _warned:
        _warned.add((str(path), reason))
        logger.warning("skipping %s: %s", path, reason)


def _family_files(directory: Path) -> list[Path]:
    """The regular ``.yaml``/``.yml`` files of a folder (anything else is skipped with a warning)."""
    try:
        if not directory.is_dir():
            return []
        entries = sorted(p for p in directory.iterdir() if p.suffix in FAMILY_SUFFIXES)
    except OSError as exc:
        _warn_skip(directory, f"cannot list folder: {exc.strerror or exc}")
        return []
    files = []
    for entry in entries:
        try:
            mode = entry.stat().st_mode
        except OSError as exc:
            _warn_skip(entry, f"cannot read family file: {exc.strerror or exc}")
            continue
        if stat.S_ISREG(mode):
            files.append(entry)
        else:
            _warn_skip(entry, f"not a regular file ({file_kind(mode)})")
    return files


def validate_paths(paths: Iterable[str | Path]) -> list[FamilySource]:
    """Validate files and folders of family files together.

    Every problem of every file is collected into one `FamilyValidationError`,
    including a family name declared by two files. In a folder, entries that are not
    regular files are skipped with a warning; a path given directly is always checked.
    """
    files: list[Path] = []
    problems: list[Problem] = []
    for item in paths:
        item = Path(item)
        try:
            is_dir = stat.S_ISDIR(os.stat(item).st_mode)
        except FileNotFoundError:
            problems.append(Problem(str(item), 1, 1, "", "no such file or folder"))
            continue
        except (OSError, ValueError) as exc:
            problems.append(Problem(str(item), 1, 1, "", f"cannot read: {getattr(exc, 'strerror', None) or exc}"))
            continue
        if is_dir:
            files.extend(_family_files(item))
        else:
            files.append(item)
    sources: list[FamilySource] = []
    seen: dict[str, FamilySource] = {}
    for file in files:
        try:
            source = read_family_file(file)
        except FamilyValidationError as exc:
            problems.extend(exc.problems)
            continue
        first = seen.get(source.spec.family)
        if first is not None and first.path != source.path:
            line, _ = first.location(("family",))
            problems.append(source.problem(
                ("family",), f"family {source.spec.family!r} is also declared in {first.path}:{line}"))
            continue
        seen[source.spec.family] = source
        sources.append(source)
    if problems:
        raise FamilyValidationError(problems)
    return sources


def find_family_file(name: str) -> Path:
    """The one file on the search path that defines family ``name``.

    A candidate that cannot be read (not a regular file, larger than 1 MiB, no
    permission) is skipped with a warning; when it is the only candidate, its problem
    is raised as a `FamilyValidationError`.
    """
    hits: list[Path] = []
    unreadable: list[Problem] = []
    for directory in family_search_path():
        for suffix in FAMILY_SUFFIXES:
            candidate = directory / f"{name}{suffix}"
            if not os.path.lexists(candidate):
                continue
            problem = file_problem(candidate, MAX_FILE_BYTES)
            if problem is None:
                hits.append(candidate.resolve())
            else:
                _warn_skip(candidate, problem)
                unreadable.append(Problem(str(candidate), 1, 1, "", problem))
    hits = list(dict.fromkeys(hits))
    if not hits and unreadable:
        raise FamilyValidationError(unreadable)
    if not hits:
        known = ", ".join(list_families()) or "none"
        raise FamilyNotFoundError(
            f"no family file {name}.yaml on the search path ({', '.join(map(str, family_search_path()))}); "
            f"known families: {known}"
        )
    if len(hits) > 1:
        raise FamilyValidationError(
            [Problem(str(p), 1, 1, "family", f"family {name!r} is defined by more than one file: "
                     + " and ".join(map(str, hits))) for p in hits]
        )
    return hits[0]


def list_families() -> list[str]:
    """Names of the families on the search path (file names of regular files; not validated)."""
    names: set[str] = set()
    for directory in family_search_path():
        for file in _family_files(directory):
            names.add(file.name.rsplit(".", 1)[0])
    return sorted(names)


def scan_valid_sources() -> list[FamilySource]:
    """Every valid family file on the search path (invalid ones are skipped with a warning)."""
    sources = []
    for directory in family_search_path():
        for file in _family_files(directory):
            try:
                sources.append(read_family_file(file))
            except FamilyValidationError as exc:
                _warn_skip(file, f"invalid family file ({len(exc.problems)} problem(s); first: "
                                 f"{exc.problems[0].message if exc.problems else '?'})")
    return sources


def is_family_path(name_or_path: str | os.PathLike[str]) -> bool:
    """True when ``name_or_path`` names a file (a path or a ``.yaml`` name) rather than a family."""
    text = os.fspath(name_or_path)
    return isinstance(name_or_path, os.PathLike) or text.endswith(FAMILY_SUFFIXES) or os.sep in text or "/" in text
