"""The committed JSON schema is current and every family file points editors at it."""

from __future__ import annotations

import json
from pathlib import Path

from distconf.loader.json_schema import schema_text

REPO = Path(__file__).resolve().parents[1]


def test_schema_file_is_current() -> None:
    assert (REPO / "schemas" / "family.schema.json").read_text(encoding="utf-8") == schema_text(), \
        "run `distconf schema` and commit schemas/family.schema.json"


def test_schema_is_strict() -> None:
    schema = json.loads(schema_text())
    assert schema["additionalProperties"] is False
    # kv_groups: required unless the family keeps a per-sequence `state` (a model validator, see test_state_blocks)
    assert {"family", "model_type", "config_class", "block", "dht_prefix"} <= set(schema["required"])


def test_family_files_reference_schema() -> None:
    for path in sorted((REPO / "families").glob("*.yaml")):
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert first == "# yaml-language-server: $schema=../schemas/family.schema.json", path
