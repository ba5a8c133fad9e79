"""Reusable constrained types for family-file fields (class paths, formulas, ...)."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema

from distconf.errors import excerpt
from distconf.loader.formula import Formula, FormulaError

__all__ = [
    "StrictModel", "ClassPath", "IntOrFormula", "FormulaText", "Identifier", "ScalarValue",
    "trusted_module_prefixes", "TRUSTED_MODULES_ENV", "MAX_SPEC_INT",
]

MAX_SPEC_INT = 1 << 20
"""Upper bound of every integer field of a family file (head counts, head sizes, groups)."""

TRUSTED_MODULES_ENV = "DISTCONF_TRUSTED_MODULES"
_BUILTIN_TRUSTED = ("transformers.", "distconf.")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class StrictModel(BaseModel):
    """Base of every family-file model: unknown keys rejected, frozen, typed strictly."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, arbitrary_types_allowed=True)


def trusted_module_prefixes() -> tuple[str, ...]:
    """Module prefixes a class path may start with: built-ins plus ``DISTCONF_TRUSTED_MODULES``."""
    extra = os.environ.get(TRUSTED_MODULES_ENV, "")
    more = tuple(p if p.endswith(".") else p + "." for p in extra.replace(",", os.pathsep).split(os.pathsep) if p)
    return _BUILTIN_TRUSTED + more


def _check_class_path(value: str) -> str:
    if not _DOTTED.match(value):
        raise ValueError(f"{excerpt(value)} is not a dotted class path such as transformers.LlamaConfig")
    if any(part.startswith("__") for part in value.split(".")):
        raise ValueError(f"{excerpt(value)}: dunder names are not allowed in class paths")
    prefixes = trusted_module_prefixes()
    if not value.startswith(prefixes):
        raise ValueError(
            f"{excerpt(value, 80)} is not under a trusted module ({', '.join(p.rstrip('.') for p in prefixes)}); "
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


def _to_formula(value: Any) -> Formula:
    if isinstance(value, Formula):
        return value
    if not isinstance(value, str):
        raise ValueError("expected a formula string")
    try:
        return Formula(value)
    except FormulaError as exc:
        raise ValueError(f"unsafe or invalid formula: {exc}") from None


_FORMULA_DOC = ("A safe expression over config fields: names, numbers, + - * // / %, comparisons, "
                "and/or/not, `x if c else y`, min(), max().")

FormulaText = Annotated[
    Formula,
    PlainValidator(_to_formula),
    PlainSerializer(lambda f: f.source, return_type=str),
    WithJsonSchema({"type": "string", "description": _FORMULA_DOC}),
]
"""A formula field: written as text in the file, held as a compiled `Formula` (parsed once)."""


def _int_or_formula(value: Any) -> int | Formula:
    if isinstance(value, bool):
        raise ValueError("expected a positive integer or a formula string, got a boolean")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"expected a positive integer, got {excerpt(value)}")
        if value > MAX_SPEC_INT:
            raise ValueError(f"expected an integer of at most {MAX_SPEC_INT}, got {excerpt(value)}")
        return value
    if isinstance(value, (str, Formula)):
        return _to_formula(value)
    raise ValueError(f"expected a positive integer or a formula string, got {type(value).__name__}")


IntOrFormula = Annotated[
    int | Formula,
    PlainValidator(_int_or_formula),
    PlainSerializer(lambda v: v if isinstance(v, int) else v.source),
    WithJsonSchema({
        "oneOf": [
            {"type": "integer", "minimum": 1, "maximum": MAX_SPEC_INT},
            {"type": "string", "description": "A safe formula over config fields (see FormulaText)."},
        ]
    }),
]
"""A positive integer (at most `MAX_SPEC_INT`), or a formula over config fields (held compiled)."""

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")]

ScalarValue = Annotated[
    int | float | bool | str | None,
    Field(description="A JSON scalar: number, boolean, string or null."),
]
