"""The family search path: which family files exist, and which one defines a family.

Search path: the built-in ``families/`` folder, then each folder listed in
``DISTCONF_FAMILIES_PATH`` (``os.pathsep``-separated). A path to a ``.yaml`` file
names that file directly. A file on the search path that cannot be read (or, when
scanning every family, is invalid) is skipped with a logged warning, so it cannot break
the other families; a file named directly raises its error.

A user file (in a ``DISTCONF_FAMILIES_PATH`` folder) with the name of a built-in family
overrides the built-in one, with a logged line saying so; two user files defining the
same family are an error.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from distconf.errors import FamilyNotFoundError, FamilyValidationError, Problem
from distconf.loader.data import builtin_families_dir
from distconf.loader.files import file_kind, file_problem
from distconf.loader.source import FAMILY_SUFFIXES, MAX_FILE_BYTES, FamilySource, read_family_file

__all__ = [
    "FAMILIES_PATH_ENV", "family_search_path", "validate_paths", "find_family_file", "list_families",
    "scan_valid_sources", "is_family_path",
]

FAMILIES_PATH_ENV = "DISTCONF_FAMILIES_PATH"
_warned: set[tuple[str, str]] = set()
logger = logging.getLogger(__name__)


def family_search_path() -> list[Path]:
    """Folders searched for family files, in order."""
    dirs = [builtin_families_dir()]
    for entry in os.environ.get(FAMILIES_PATH_ENV, "").split(os.pathsep):
        if entry.strip():
            dirs.append(Path(entry.strip()).expanduser())
    return dirs


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
    builtin_hits: list[Path] = []
    unreadable: list[Problem] = []
    builtin_dir = builtin_families_dir()
    for directory in family_search_path():
        for suffix in FAMILY_SUFFIXES:
            candidate = directory / f"{name}{suffix}"
            if not os.path.lexists(candidate):
                continue
            problem = file_problem(candidate, MAX_FILE_BYTES)
            if problem is None:
                (builtin_hits if directory == builtin_dir else hits).append(candidate.resolve())
            else:
                _warn_skip(candidate, problem)
                unreadable.append(Problem(str(candidate), 1, 1, "", problem))
    hits = [h for h in dict.fromkeys(hits) if h not in builtin_hits]
    if hits and builtin_hits:
        _log_override(name, hits[0], builtin_hits[0])
    elif builtin_hits:
        hits = list(dict.fromkeys(builtin_hits))
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


_overrides_logged: set[tuple[str, str]] = set()


def _log_override(name: str, user_file: Path, builtin_file: Path) -> None:
    """Say (once per file) that a user file replaces a built-in family."""
    if (name, str(user_file)) not in _overrides_logged:
        _overrides_logged.add((name, str(user_file)))
        logger.info("family %r: using %s, which overrides the built-in %s", name, user_file, builtin_file)


def list_families() -> list[str]:
    """Names of the families on the search path (file names of regular files; not validated)."""
    names: set[str] = set()
    for directory in family_search_path():
        for file in _family_files(directory):
            names.add(file.name.rsplit(".", 1)[0])
    return sorted(names)


def scan_valid_sources() -> list[FamilySource]:
    """Every valid family file on the search path (invalid ones are skipped with a warning).

    A built-in family that a user file overrides (same family name) is left out.
    """
    sources = []
    for directory in family_search_path():
        for file in _family_files(directory):
            try:
                sources.append(read_family_file(file))
            except FamilyValidationError as exc:
                _warn_skip(file, f"invalid family file ({len(exc.problems)} problem(s); first: "
                                 f"{exc.problems[0].message if exc.problems else '?'})")
    builtin_dir = builtin_families_dir().resolve()
    user = {s.spec.family: s for s in sources if s.path.resolve().parent != builtin_dir}
    kept = []
    for source in sources:
        override = user.get(source.spec.family)
        if override is not None and override is not source and source.path.resolve().parent == builtin_dir:
            _log_override(source.spec.family, override.path, source.path)
            continue
        kept.append(source)
    return kept


def is_family_path(name_or_path: str | os.PathLike[str]) -> bool:
    """True when ``name_or_path`` names a file (a path or a ``.yaml`` name) rather than a family."""
    text = os.fspath(name_or_path)
    return isinstance(name_or_path, os.PathLike) or text.endswith(FAMILY_SUFFIXES) or os.sep in text or "/" in text
