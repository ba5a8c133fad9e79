"""Shared fixtures: isolate the family search path and the class cache per test."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAMILIES = REPO / "families"


@pytest.fixture(autouse=True)
def _isolated_search_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No user families and no initial-peer env leak into tests unless a test sets them."""
    monkeypatch.delenv("DISTCONF_FAMILIES_PATH", raising=False)
    monkeypatch.delenv("DISTCONF_INITIAL_PEERS", raising=False)
    monkeypatch.delenv("DISTCONF_TRUSTED_MODULES", raising=False)


@pytest.fixture
def fresh_cache():
    """Forget synthesized classes before and after the test (for tests that change the search path)."""
    from distconf.loader.registry import clear_cache

    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def family_text():
    """Text of a built-in family file."""
    return lambda name: (FAMILIES / f"{name}.yaml").read_text(encoding="utf-8")
