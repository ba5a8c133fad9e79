"""Importing the light layers stays light: no torch, no model code, each checked in a fresh process.

`tests/test_cli.py` covers ``import distconf`` and ``distconf validate``; this file covers each
package on its own (a package can be imported without the top-level one pulling it in), and
synthesizing every built-in family class (which imports transformers' config modules, never a
``modeling_*`` module: block and attention classes are imported on first use).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
{statement}
modules = sorted(sys.modules)
print(json.dumps({{
    "torch": [m for m in modules if m == "torch" or m.startswith("torch.")][:5],
    "transformers": [m for m in modules if m == "transformers" or m.startswith("transformers.")][:5],
    "hivemind": [m for m in modules if m == "hivemind" or m.startswith("hivemind.")][:5],
    "modeling": [m for m in modules if m.startswith("transformers.models.") and ".modeling_" in m
                 and not m.startswith("transformers.models.auto.")],
}}))
"""


def loaded_after(statement: str) -> dict[str, list[str]]:
    """Heavy modules present in ``sys.modules`` of a new interpreter after running ``statement``."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(statement=statement)], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_probe_sees_heavy_modules() -> None:
    # stand-ins registered under the names the probe looks for (importing real torch costs seconds)
    loaded = loaded_after("import types\nfor name in ('torch', 'transformers.models.x.modeling_x', 'hivemind'):\n"
                          "    sys.modules[name] = types.ModuleType(name)")
    assert loaded["torch"] == ["torch"] and loaded["hivemind"] == ["hivemind"]
    assert loaded["modeling"] == ["transformers.models.x.modeling_x"]


# package -> what importing it must not load (its docstring makes the same promise)
LIGHT = {
    "distconf.loader": ("torch", "transformers", "hivemind", "modeling"),
    "distconf.dht": ("torch", "transformers", "hivemind", "modeling"),
    "distconf.planning": ("torch", "transformers", "hivemind", "modeling"),
    "distconf.blocks": ("torch", "hivemind", "modeling"),
    "distconf.cli": ("torch", "transformers", "hivemind", "modeling"),
}


@pytest.mark.parametrize("package", sorted(LIGHT))
def test_import_is_light(package: str) -> None:
    loaded = loaded_after(f"import {package}")
    heavy = {kind: loaded[kind] for kind in LIGHT[package] if loaded[kind]}
    assert not heavy, f"import {package} loads {heavy}"


@pytest.mark.slow
def test_synthesizing_every_family_loads_no_model_code() -> None:
    loaded = loaded_after("import distconf\nfor name in distconf.list_families():\n    distconf.load_family(name)")
    assert loaded["transformers"], "synthesis should import the HF config classes"
    assert not loaded["modeling"], f"synthesis imported model code: {loaded['modeling']}"
    assert not loaded["hivemind"]
