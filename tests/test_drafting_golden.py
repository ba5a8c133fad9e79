"""Golden drafts: ``distconf new`` on every shipped preset writes exactly the stored draft.

The drafter reads transformers' classes and source with heuristics; a change to a
heuristic (or to transformers) that changes any draft shows up here as a unified diff
of the YAML, comments (findings, TODOs) included. ``tests/golden/drafts/<preset>.yaml``
holds the draft of ``presets/<preset>.json``.

To refresh the goldens on purpose (after checking that the diff is an improvement):

    DISTCONF_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_drafting_golden.py

then review ``git diff tests/golden/`` and commit it with the change that caused it.
Drafts follow transformers' code, so they are compared on the version the goldens were
written with (``transformers_version.txt``); on another, a draft that differs is skipped,
both versions named.
The built-in families (``families/*.yaml``) are the reference of a good draft: the
structure each golden draft finds must agree with the family of its model_type, up to
the differences listed in ``KNOWN_DIFFERENCES``.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_drafting_presets import NOT_DRAFTED_YET

from distconf.loader.spec import SCHEMA_ID
from distconf.tools.drafting import draft_family, read_config_json

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "presets"
GOLDEN = REPO / "tests" / "golden" / "drafts"
VERSION_FILE = GOLDEN / "transformers_version.txt"
UPDATE = os.environ.get("DISTCONF_UPDATE_GOLDEN") == "1"
PRESET_NAMES = sorted(p.stem for p in PRESETS.glob("*.json") if p.stem.replace("--", "/", 1) not in NOT_DRAFTED_YET)

# (preset, key) -> why the draft may differ from the built-in family there
KNOWN_DIFFERENCES = {
    ("EleutherAI--gpt-neo-1.3B", "block.attention_class"):
        "the family names the inner GPTNeoSelfAttention; the draft the GPTNeoAttention wrapper (both check)",
    ("EleutherAI--gpt-neo-1.3B", "block.prefix"): "the family writes the prefix under the base model ('h')",
    ("bigscience--bloom", "block.prefix"): "the family writes the prefix under the base model ('h')",
    ("mosaicml--mpt-7b", "block.prefix"): "the family writes the prefix under the base model ('blocks')",
    ("meta-llama--Llama-4-Scout-17B-16E", "block.base_model_prefix"): "the family states the default",
    ("meta-llama--Llama-4-Scout-17B-16E", "block.position"):
        "the family sets from_cache_length (its no-rope layers scale queries by the cache length), which the "
        "drafter cannot tell from a cache length used only to slice a bias",
    ("ai21labs--AI21-Jamba-Mini-1.5", "block.call"):
        "neither layer class takes position_embeddings: the draft says so (null), the family leaves it out",
    ("tiiuae--falcon-7b", "kv_groups"): "the family also covers falcon-rw (multi-head), which no preset has",
    ("tiiuae--falcon-40b", "kv_groups"): "the family also covers falcon-rw (multi-head), which no preset has",
    **{(preset, key): "the family also serves transformers 5.24, whose Falcon layers take alibi and cache every KV "
                      "head once per query head; the goldens are 5.25's drafts, which need neither"
       for preset in ("tiiuae--falcon-7b", "tiiuae--falcon-40b") for key in ("kv_cache", "block.call")},
    ("tiiuae--falcon-7b", "block.position"): "alibi_in_mask is for falcon-rw's ALiBi, which no preset has",
    ("tiiuae--falcon-40b", "block.position"): "alibi_in_mask is for falcon-rw's ALiBi, which no preset has",
    ("tiiuae--falcon-7b", "block.mask"): "allow_skip: false is found by hand (FalconModel always builds a mask)",
    ("tiiuae--falcon-40b", "block.mask"): "allow_skip: false is found by hand (FalconModel always builds a mask)",
    ("mistralai--Mamba-Codestral-7B-v0.1", "block.call"):
        "the family drops the padding-mask argument (mask_argument: null); the draft keeps the default (both check)",
    ("mistralai--Mamba-Codestral-7B-v0.1", "block.mask"):
        "the draft maps the layer type to mask kind none; the family passes no mask at all (both check)",
    ("mistralai--Mamba-Codestral-7B-v0.1", "block.attn_implementation"):
        "the model class does not support sdpa: the draft says eager, the family leaves it (no attention)",
    ("tiiuae--falcon-mamba-7b", "block.call"):
        "the family drops the padding-mask argument (mask_argument: null); the draft keeps the default (both check)",
    ("tiiuae--falcon-mamba-7b", "block.mask"):
        "the draft maps the layer type to mask kind none; the family passes no mask at all (both check)",
    ("tiiuae--falcon-mamba-7b", "block.attn_implementation"):
        "the model class does not support sdpa: the draft says eager, the family leaves it (no attention)",
}
COMPARED = ("config_class", "kv_groups", "kv_cache")
COMPARED_BLOCK = ("layer_class", "attention_class", "prefix", "base_model_prefix", "constructor", "call",
                  "position", "mask", "attn_implementation")


def _family_name(preset: str) -> str:
    return "drafted_" + re.sub(r"[^a-z0-9]+", "_", preset.split("--", 1)[1].lower()).strip("_")


def _draft_text(preset: str) -> str:
    """The draft of a preset as ``distconf new`` writes it outside a source checkout."""
    draft = draft_family(_family_name(preset), read_config_json(PRESETS / f"{preset}.json"))
    return draft.to_yaml(schema_path=SCHEMA_ID)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def test_every_preset_has_a_golden_draft() -> None:
    stored = sorted(p.stem for p in GOLDEN.glob("*.yaml"))
    if UPDATE:
        for stale in set(stored) - set(PRESET_NAMES):
            (GOLDEN / f"{stale}.yaml").unlink()
        VERSION_FILE.write_text(_transformers_version() + "\n", encoding="utf-8")
        return
    assert stored == PRESET_NAMES, "run with DISTCONF_UPDATE_GOLDEN=1 to add or drop golden drafts"


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_draft_matches_golden(preset: str) -> None:
    text = _draft_text(preset)
    path = GOLDEN / f"{preset}.yaml"
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    golden = path.read_text(encoding="utf-8") if path.is_file() else ""
    if text == golden:
        return
    diff = "".join(difflib.unified_diff(golden.splitlines(keepends=True), text.splitlines(keepends=True),
                                        fromfile=f"tests/golden/drafts/{preset}.yaml", tofile="draft now"))
    written_with = VERSION_FILE.read_text(encoding="utf-8").strip() if VERSION_FILE.is_file() else "?"
    if written_with != _transformers_version():  # drafts follow transformers' code: compared on its version only
        pytest.skip(f"the draft of presets/{preset}.json differs from its golden, written with transformers "
                    f"{written_with}; installed {_transformers_version()}")
    pytest.fail(f"the draft of presets/{preset}.json changed; if the change is intended, refresh with "
                f"DISTCONF_UPDATE_GOLDEN=1 (see this file's docstring):\n{diff}", pytrace=False)


def _builtin_families() -> dict[str, dict[str, Any]]:
    families: dict[str, dict[str, Any]] = {}
    for path in sorted((REPO / "families").glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        families.setdefault(data["model_type"], data)
    return families


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_golden_draft_agrees_with_the_builtin_family(preset: str) -> None:
    """What the golden draft found is what the hand-written family of its model_type says."""
    draft = yaml.safe_load((GOLDEN / f"{preset}.yaml").read_text(encoding="utf-8"))
    family = _builtin_families().get(draft["model_type"])
    assert family is not None, f"no built-in family for model_type {draft['model_type']!r}"
    pairs = [(key, draft.get(key), family.get(key)) for key in COMPARED]
    pairs += [(f"block.{key}", draft["block"].get(key), family["block"].get(key)) for key in COMPARED_BLOCK]
    differ = {key for key, found, written in pairs if (found or None) != (written or None)}  # {} == absent
    known = {key for name, key in KNOWN_DIFFERENCES if name == preset}
    assert differ <= known, {key: (found, written) for key, found, written in pairs if key in differ - known}
    assert known <= differ, f"KNOWN_DIFFERENCES lists keys where draft and family agree: {sorted(known - differ)}"
