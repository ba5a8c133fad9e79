"""Errors, names and small helpers shared by the drafting modules."""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DraftingError", "FAMILY_NAME_PATTERN", "check_family_name", "read_config_json", "class_path",
           "module_path", "is_int", "quiet_transformers", "field_value", "MISSING", "one_line", "crash_line",
           "try_config"]

MISSING = object()

FAMILY_NAME_PATTERN = r"^[a-z][a-z0-9_]*$"


class DraftingError(ValueError):
    """The config cannot be drafted into a family file (the message says why)."""


def check_family_name(family: str) -> None:
    """Raise `DraftingError` unless ``family`` is a valid family name."""
    if not re.match(FAMILY_NAME_PATTERN, family) or len(family) > 64:
        raise DraftingError(f"family name {family!r} must be lower case letters, digits and '_', "
                            "starting with a letter")


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def field_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.<name>``, or ``default`` when reading it fails in any way.

    Some configs refuse per-layer attributes with exception types of their own.
    """
    try:
        return getattr(config, name)
    except Exception:
        return default


def try_config(config_class: type, values: Mapping[str, Any] | None = None) -> Any:
    """``config_class(**values)`` built quietly from a deep copy (classes edit nested dicts in place); `MISSING`
    when the class refuses the values (config classes validate with exception types of their own)."""
    try:
        with quiet_transformers():
            return config_class(**copy.deepcopy(dict(values or {})))
    except Exception:  # any type: the run of the tiny config reports a refusal that matters
        return MISSING


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Read a model's ``config.json`` (a file, or a folder holding one), as transformers reads it.

    transformers writes the floats JSON cannot hold (infinities, NaN) as ``{"__float__": "Infinity"}``
    objects and decodes them when it reads a config; so does this.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftingError(f"{path}: no such file (give a config.json or a folder holding one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DraftingError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise DraftingError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise DraftingError(f"{path}: a config.json must be a JSON object")
    return _decode_special_floats(data)


_TAGGED_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _decode_special_floats(obj: Any) -> Any:
    """``obj`` with transformers' tagged floats (``{"__float__": "Infinity"}``) decoded, at any depth."""
    if isinstance(obj, dict):
        tag = obj.get("__float__")
        if len(obj) == 1 and isinstance(tag, str) and tag in _TAGGED_FLOATS:
            return _TAGGED_FLOATS[tag]
        return {k: _decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_special_floats(v) for v in obj]
    return obj


def one_line(text: str) -> str:
    """``text`` on one line (its lines joined by "; ", blanks dropped)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def crash_line(exc: BaseException) -> str:
    """One line for an unexpected exception: its type, message, and where it was raised (file:line, function)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {one_line(str(exc)) or 'no message'}{where}"


def class_path(cls: type) -> str:
    """Dotted path of a class; the short ``transformers.Name`` when transformers exports it."""
    import transformers

    name = cls.__name__
    if getattr(transformers, name, None) is cls:
        return f"transformers.{name}"
    return module_path(cls)


def module_path(cls: type) -> str:
    """Full dotted path ``module.QualName`` of a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings while the drafter tries configs out (they are not the user's).

    Inside a quiet block (or when transformers is already that quiet) it changes nothing: setting a level clears
    every logger's cache, and transformers has a logger per module (the drafter's probes nest thousands of these
    blocks; the level changes took seconds of a sweep)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if level >= hf_logging.ERROR:
        yield
        return
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
