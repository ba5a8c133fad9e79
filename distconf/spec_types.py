"""Reusable constrained types for family-file fields (class paths, formulas, ...)."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema

from distconf.formula import Formula, FormulaError

__all__ = [
    "StrictModel", "ClassPath", "IntOrFormula", "FormulaText", "Identifier", "ScalarValue",
    "trusted_module_prefixes", "TRUSTED_MODULES_ENV", "FORMULA_MARKER",
]

TRUSTED_MODULES_ENV = "DISTCONF_TRUSTED_MODULES"
_BUILTIN_TRUSTED = ("transformers.", "distconf.")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class StrictModel(BaseModel):
    """Base of every family-file model: unknown keys rejected, frozen, typed strictly."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def trusted_module_prefixes() -> tuple[str, ...]:
    """Module prefixes a class path may start with: built-ins plus ``DISTCONF_TRUSTED_MODULES``."""
    extra = os.environ.get(TRUSTED_MODULES_ENV, "")
    more = tuple(p if p.endswith(".") else p + "." for p in extra.replace(",", os.pathsep).split(os.pathsep) if p)
    return _BUILTIN_TRUSTED + more


def _check_class_path(value: str) -> str:
    if not _DOTTED.match(value):
        raise ValueError(f"{value!r} is not a dotted class path such as transformers.LlamaConfig")
    if any(part.startswith("__") for part in value.split(".")):
        raise ValueError(f"{value!r}: dunder names are not allowed in class paths")
    prefixes = trusted_module_prefixes()
    if not value.startswith(prefixes):
        raise ValueError(
            f"{value!r} is not under a trusted module ({', '.join(p.rstrip('.') for p in prefixes)}); "
            f"add its package to {TRUSTED_MODULES_ENV} to allow it"
        )
    return value


ClassPath = Annotated[
    str,
    AfterValidator(_check_class_path),
    Field(description="Dotted path of a class, imported lazily; must be under a trusted module "
                      "(transformers., distconf., or DISTCONF_TRUSTED_MODULES).",
          pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"),
]


def _check_formula(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a formula string")
    try:
        return Formula(value).source
    except FormulaError as exc:
        raise ValueError(f"unsafe or invalid formula: {exc}") from None


FormulaText = Annotated[
    str,
    PlainValidator(_check_formula),
    WithJsonSchema({
        "type": "string",
        "description": "A safe expression over config fields: names, numbers, + - * // / %, comparisons, "
                       "and/or/not, `x if c else y`, min(), max().",
    }),
]


def _int_or_formula(value: Any) -> int | str:
    if isinstance(value, bool):
        raise ValueError("expected a positive integer or a formula string, got a boolean")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"expected a positive integer, got {value}")
        return value
    if isinstance(value, str):
        return _check_formula(value)
    raise ValueError(f"expected a positive integer or a formula string, got {type(value).__name__}")


IntOrFormula = Annotated[
    int | str,
    PlainValidator(_int_or_formula),
    WithJsonSchema({
        "oneOf": [
            {"type": "integer", "minimum": 1},
            {"type": "string", "description": "A safe formula over config fields (see FormulaText)."},
        ]
    }),
]

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")]

ScalarValue = Annotated[
    int | float | bool | str | None,
    Field(description="A JSON scalar: number, boolean, string or null."),
]


class _FormulaMarker:
    """Annotated metadata tagging a field as a formula (found by `iter_formulas`)."""

    def __repr__(self) -> str:
        return "FORMULA_MARKER"


FORMULA_MARKER = _FormulaMarker()
FormulaText = Annotated[FormulaText, FORMULA_MARKER]
IntOrFormula = Annotated[IntOrFormula, FORMULA_MARKER]
