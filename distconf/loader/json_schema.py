"""JSON schema of a family file, generated from `FamilySpec`."""

from __future__ import annotations

import json
from typing import Any

from distconf.loader.spec import SCHEMA_ID, FamilySpec

__all__ = ["family_schema", "schema_text"]


def family_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of a family file."""
    schema = FamilySpec.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "distconf model family",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def schema_text() -> str:
    """The schema as the exact text of ``schemas/family.schema.json``."""
    return json.dumps(family_schema(), indent=2, ensure_ascii=False) + "\n"
