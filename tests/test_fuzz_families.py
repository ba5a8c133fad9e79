"""Mutated family files only ever produce FamilyValidationError (property-based)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distconf import FamilyValidationError
from distconf.loader.source import read_family_file
from distconf.loader.synthesis import resolve_source

REPO = Path(__file__).resolve().parents[1]
SEEDS = ["bloom", "falcon", "llama", "mixtral"]
TEXTS = {name: (REPO / "families" / f"{name}.yaml").read_text(encoding="utf-8") for name in SEEDS}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**15), st.floats(allow_nan=True),
                    st.text(max_size=20), st.just("transformers.LlamaConfig"), st.just("a // b"))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


def _check(name: str, text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            source = read_family_file(path)
        except FamilyValidationError as exc:
            assert exc.problems and all(p.line >= 1 for p in exc.problems)
            return
        try:
            resolve_source(source)
        except FamilyValidationError:
            pass


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _paths(v, (*prefix, i))
    return out


def _parent(data: Any, path: tuple) -> Any:
    for key in path[:-1]:
        data = data[key]
    return data


@SETTINGS
@given(name=st.sampled_from(SEEDS), data=st.data())
def test_truncated(name, data) -> None:
    text = TEXTS[name]
    cut = data.draw(st.integers(0, len(text)))
    _check(name, text[:cut])


@SETTINGS
@given(name=st.sampled_from(SEEDS), data=st.data())
def test_dropped_key(name, data) -> None:
    tree = yaml.safe_load(TEXTS[name])
    path = data.draw(st.sampled_from(_paths(tree)))
    del _parent(tree, path)[path[-1]]
    _check(name, yaml.safe_dump(tree, sort_keys=False))


@SETTINGS
@given(name=st.sampled_from(SEEDS), data=st.data(), value=values)
def test_retyped_value(name, data, value) -> None:
    tree = yaml.safe_load(TEXTS[name])
    path = data.draw(st.sampled_from(_paths(tree)))
    _parent(tree, path)[path[-1]] = value
    _check(name, yaml.safe_dump(tree, sort_keys=False, allow_unicode=True))


@SETTINGS
@given(name=st.sampled_from(SEEDS), data=st.data())
def test_duplicated_line(name, data) -> None:
    lines = TEXTS[name].splitlines(keepends=True)
    i = data.draw(st.integers(0, len(lines) - 1))
    j = data.draw(st.integers(0, len(lines)))
    lines.insert(j, lines[i])
    _check(name, "".join(lines))


@SETTINGS
@given(name=st.sampled_from(SEEDS), data=st.data(), junk=st.text(min_size=1, max_size=12))
def test_inserted_junk(name, data, junk) -> None:
    text = TEXTS[name]
    at = data.draw(st.integers(0, len(text)))
    _check(name, text[:at] + junk + text[at:])
