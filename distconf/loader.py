"""Find, parse and validate family files; synthesize and cache their config classes.

Search path: the built-in ``families/`` folder, then each folder listed in
``DISTCONF_FAMILIES_PATH`` (``os.pathsep``-separated). A path to a ``.yaml`` file
loads that file directly. Validation needs neither torch nor transformers; only
synthesizing a class imports them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from distconf.data import builtin_families_dir
from distconf.errors import FamilyNotFoundError, FamilyValidationError, Problem
from distconf.spec import FamilySpec
from distconf.yamlsafe import Location, YamlProblem, parse_yaml

__all__ = [
    "FamilySource", "FAMILIES_PATH_ENV", "family_search_path", "read_family_file", "validate_paths",
    "find_family_file", "load_family", "get_family_spec", "list_families", "family_for_model_type",
    "load_family_by_class_name", "field_location", "field_error", "clear_cache",
]

FAMILIES_PATH_ENV = "DISTCONF_FAMILIES_PATH"
FAMILY_SUFFIXES = (".yaml", ".yml")
_MAX_FILE_BYTES = 1 << 20


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
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if isinstance(value, (dict, list)) and kind not in ("dict_type", "list_type"):
        return message
    return f"{message} (got {shown})"


def _problems_from_validation(path: Path, exc: ValidationError,
                              locations: dict[tuple[Any, ...], Location]) -> list[Problem]:
    source = FamilySource(path, None, locations)  # type: ignore[arg-type]
    problems = []
    for err in exc.errors(include_url=False):
        loc = _clean_field(tuple(err["loc"]))
        problems.append(source.problem(loc, _describe(err)))
    return problems


def read_family_file(path: str | Path) -> FamilySource:
    """Parse and validate one family file (no torch/transformers import).

    Raises `FamilyValidationError` listing every problem, each with its line.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise FamilyValidationError.single(path, f"cannot read family file: {exc.strerror or exc}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise FamilyValidationError.single(path, f"family file larger than {_MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FamilyValidationError.single(path, f"family file is not UTF-8 text: {exc.reason}") from None
    try:
        data, locations = parse_yaml(text)
    except YamlProblem as exc:
        raise FamilyValidationError.single(
            path, exc.message, line=exc.line, column=exc.column, field=".".join(map(str, exc.loc))
        ) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise FamilyValidationError.single(path, f"a family file must be a mapping of fields, this one is {kind}")
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
    return FamilySource(path.resolve(), spec, locations)


def _family_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in FAMILY_SUFFIXES and p.is_file())


def validate_paths(paths: Iterable[str | Path]) -> list[FamilySource]:
    """Validate files and folders of family files together.

    Every problem of every file is collected into one `FamilyValidationError`,
    including a family name declared by two files.
    """
    files: list[Path] = []
    problems: list[Problem] = []
    for item in paths:
        item = Path(item)
        if item.is_dir():
            files.extend(_family_files(item))
        elif item.exists():
            files.append(item)
        else:
            problems.append(Problem(str(item), 1, 1, "", "no such file or folder"))
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
    """The one file on the search path that defines family ``name``."""
    hits: list[Path] = []
    for directory in family_search_path():
        for suffix in FAMILY_SUFFIXES:
            candidate = directory / f"{name}{suffix}"
            if candidate.is_file():
                hits.append(candidate.resolve())
    hits = list(dict.fromkeys(hits))
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
    """Names of the families on the search path (file names; not validated)."""
    names: set[str] = set()
    for directory in family_search_path():
        for file in _family_files(directory):
            names.add(file.name.rsplit(".", 1)[0])
    return sorted(names)


# --- class cache -------------------------------------------------------------------

_lock = threading.RLock()
_classes: dict[str, type] = {}  # family name, file path or class name -> class
_sources: dict[str, FamilySource] = {}  # family name -> source
_model_types: dict[str, str] | None = None


def _is_path(name_or_path: str | os.PathLike[str]) -> bool:
    text = os.fspath(name_or_path)
    return isinstance(name_or_path, os.PathLike) or text.endswith(FAMILY_SUFFIXES) or os.sep in text or "/" in text


def _source_for(name_or_path: str | os.PathLike[str]) -> FamilySource:
    if _is_path(name_or_path):
        return read_family_file(name_or_path)
    return read_family_file(find_family_file(os.fspath(name_or_path)))


def get_family_spec(name_or_path: str | os.PathLike[str]) -> FamilySpec:
    """The validated `FamilySpec` of a family (by name or file path)."""
    key = os.fspath(name_or_path)
    cls = _classes.get(key)
    if cls is not None:
        return cls.family_spec  # type: ignore[attr-defined]
    return _source_for(name_or_path).spec


def load_family(name_or_path: str | os.PathLike[str]) -> type:
    """The synthesized ``Distributed<Name>Config`` class of a family.

    ``name_or_path`` is a family name on the search path (such as ``"my_family"``) or the path
    of a family file. The class is synthesized once and cached: every later call
    (from any thread) returns the same object.
    """
    key = os.fspath(name_or_path)
    cls = _classes.get(key)
    if cls is not None:
        return cls
    with _lock:
        cls = _classes.get(key)
        if cls is not None:
            return cls
        source = _source_for(name_or_path)
        family = source.spec.family
        known = _sources.get(family)
        if known is not None and known.path != source.path:
            raise FamilyValidationError([
                source.problem(("family",), f"family {family!r} is already loaded from {known.path}"),
            ])
        cls = _classes.get(family) if known is not None else None
        if cls is None:
            from distconf.synthesis import synthesize_config_class

            cls = synthesize_config_class(source)
            _sources[family] = source
            _classes[family] = cls
            _classes[cls.__name__] = cls
            _classes[str(source.path)] = cls
        _classes[key] = cls
        return cls


def field_location(cls_or_family: type | str, loc: Iterable[Any]) -> tuple[str, int, int]:
    """``(path, line, column)`` where a field of a loaded family is written."""
    family = cls_or_family if isinstance(cls_or_family, str) else cls_or_family.family_spec.family  # type: ignore[attr-defined]
    source = _sources.get(family) or _source_for(family)
    line, column = source.location(loc)
    return str(source.path), line, column


def field_error(config_or_cls: Any, loc: Iterable[Any], message: str) -> FamilyValidationError:
    """A `FamilyValidationError` pointing at field ``loc`` of the family file of a config (or config class)."""
    cls = config_or_cls if isinstance(config_or_cls, type) else type(config_or_cls)
    loc = tuple(loc)
    try:
        path, line, column = field_location(cls, loc)
    except (LookupError, FamilyValidationError, AttributeError):
        path, line, column = str(getattr(cls, "family_source", "<family file>")), 1, 1
    return FamilyValidationError.single(path, message, line=line, column=column, field=".".join(map(str, loc)))


def _scan_valid_sources() -> list[FamilySource]:
    sources = []
    for directory in family_search_path():
        for file in _family_files(directory):
            try:
                sources.append(read_family_file(file))
            except FamilyValidationError:
                continue
    return sources


def family_for_model_type(model_type: str) -> str:
    """The family serving HF ``model_type`` (for `AutoDistributedConfig`)."""
    global _model_types
    with _lock:
        if _model_types is None:
            mapping: dict[str, str] = {}
            for source in _scan_valid_sources():
                mapping.setdefault(source.spec.model_type, source.spec.family)
            _model_types = mapping
        mapping = _model_types
    if model_type not in mapping:
        known = ", ".join(f"{fam} ({mt})" for mt, fam in sorted(mapping.items(), key=lambda kv: kv[1]))
        raise FamilyNotFoundError(
            f"no family serves model_type {model_type!r}; known families: {known}. "
            f"Add a family file (see docs/adding-a-family.md) to a folder in {FAMILIES_PATH_ENV}."
        )
    return mapping[model_type]


def load_family_by_class_name(class_name: str) -> type:
    """Load the family whose synthesized class is named ``class_name`` (used by pickle)."""
    cls = _classes.get(class_name)
    if cls is not None:
        return cls
    for source in _scan_valid_sources():
        if source.spec.class_name == class_name:
            return load_family(source.spec.family)
    raise FamilyNotFoundError(f"no family on the search path synthesizes {class_name}")


def clear_cache() -> None:
    """Forget every synthesized class (for tests and for reloading edited files)."""
    global _model_types
    with _lock:
        _classes.clear()
        _sources.clear()
        _model_types = None
