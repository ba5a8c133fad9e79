"""How benchmarks/sweep_architectures.py reads a failed step: its first error line, and the class it falls in."""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["NOISE", "classify", "config_hint_text", "first_error"]

NOISE = re.compile(r"^\[transformers\]|Warning|warnings\.warn|^\s*$|^  warnings|FutureWarning")


def first_error(out: str, err: str, family: str) -> tuple[str, list[str]]:
    """The one line that says why a step failed, and tags of what the output showed."""
    tags = ["traceback"] if "Traceback (most recent call last)" in err else []
    lines = (out + "\n" + err).splitlines()
    for line in lines:
        if line.startswith(f"{family} [") and "]: " in line:
            return line.strip(), tags
    if tags:
        raised = [ln for ln in err.splitlines() if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", ln)]
        if raised:
            return raised[-1].strip(), tags
    for line in lines:
        if line.startswith(f"{family}: ") and "layer kind" in line and "covered" not in line:
            return line.strip(), tags
    for line in err.splitlines():
        if not NOISE.search(line):
            return line.strip(), tags
    lines = [ln.strip() for ln in lines if ln.strip() and not NOISE.search(ln)]
    return (lines[-1] if lines else "(no output)"), tags


def config_hint_text(config_json: Path) -> list[str]:
    """Keys of the default config and ``layer_types=<value>`` items, for the classes' config hints."""
    try:
        data = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    items = list(data)
    for key in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        value = data.get(key)
        values = value if isinstance(value, list) else list(value) if isinstance(value, str) else []
        items += [f"layer_types={v}" for v in sorted(set(map(str, values)))]
    return items


def classify(text: str, hints: list[str], classes: dict) -> tuple[str, str]:
    """(class key, what matched) for a failure's text, then for its config hints."""
    for key, spec in classes.items():
        for pattern in spec.get("patterns") or ():
            match = re.search(pattern, text, re.IGNORECASE)
            if match:
                return key, f"text: {match.group(0)!r}"
    for key, spec in classes.items():
        for pattern in spec.get("config_hints") or ():
            for item in hints:
                if re.search(pattern, item, re.IGNORECASE):
                    return key, f"config: {item!r}"
    return "unclassified", ""
