"""No Python file outside tests names a family: families are data, the code stays generic."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

LAYER_KIND_WORDS = {"mamba"}
"""Parts of compound family names that name a layer kind many architectures share, not a family: "mamba" (the
selective state-space mixer of falcon_mamba) prefixes config fields of several families (mamba_d_state,
mamba_n_heads), which generic code reads by name. A family named by the whole word still counts."""


def _family_words() -> set[str]:
    words: set[str] = set()
    for path in (REPO / "families").glob("*.yaml"):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        for key in ("family", "model_type", "display_name"):
            if data.get(key):
                words.add(str(data[key]).lower())
                words.update(part for part in re.split(r"[_-]", str(data[key]).lower())
                             if len(part) > 4 and part not in LAYER_KIND_WORDS)
    return words


def test_no_family_name_in_python_code() -> None:
    words = _family_words()
    assert {"bloom", "llama", "falcon", "mixtral"} <= words
    pattern = re.compile(r"(?<![a-z0-9])(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True))
                         + r")(?![a-z])", re.IGNORECASE)
    offenders = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", ".venv", "build", "dist") or rel.parts[0].startswith("."):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = pattern.search(line)
            if match:
                offenders.append(f"{rel}:{number}: {match.group(0)!r}: {line.strip()}")
    assert not offenders, "family names in Python code (use a family-file knob instead):\n" + "\n".join(offenders)
