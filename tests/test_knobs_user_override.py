"""A user family file with a built-in family's name overrides the built-in, with a log line."""

from __future__ import annotations

import logging

import pytest

from distconf.cli import main
from distconf.errors import FamilyValidationError
from distconf.loader import load_family
from distconf.loader.data import builtin_families_dir
from distconf.loader.registry import family_for_model_type
from distconf.loader.search import FAMILIES_PATH_ENV, find_family_file, scan_valid_sources


def _user_llama(folder, marker: str):
    folder.mkdir()
    text = (builtin_families_dir() / "llama.yaml").read_text(encoding="utf-8")
    text = text.replace("family: llama\n", f"family: llama\ndisplay_name: {marker}\n", 1)
    (folder / "llama.yaml").write_text(text, encoding="utf-8")
    return folder / "llama.yaml"


def test_user_file_overrides_the_builtin(tmp_path, monkeypatch, fresh_cache, caplog, capsys) -> None:
    user = _user_llama(tmp_path / "mine", "MyLlama")
    monkeypatch.setenv(FAMILIES_PATH_ENV, str(tmp_path / "mine"))
    with caplog.at_level(logging.INFO, logger="distconf.loader.search"):
        assert find_family_file("llama") == user.resolve()
        cls = load_family("llama")
    assert cls.__name__ == "DistributedMyLlamaConfig"
    assert any("overrides the built-in" in r.getMessage() for r in caplog.records)
    assert family_for_model_type("llama") == "llama"
    llamas = [s for s in scan_valid_sources() if s.spec.family == "llama"]
    assert [s.path.resolve() for s in llamas] == [user.resolve()]  # the built-in one is left out
    assert main(["validate", "--resolve", str(tmp_path / "mine")]) == 0  # the loader accepts it too
    assert "DistributedMyLlamaConfig" in capsys.readouterr().out


def test_two_user_files_for_one_family_are_refused(tmp_path, monkeypatch, fresh_cache) -> None:
    _user_llama(tmp_path / "a", "LlamaA")
    _user_llama(tmp_path / "b", "LlamaB")
    monkeypatch.setenv(FAMILIES_PATH_ENV, f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    with pytest.raises(FamilyValidationError, match="more than one file"):
        load_family("llama")


def test_a_folder_added_to_the_search_path_later_is_seen(tmp_path, monkeypatch, fresh_cache) -> None:
    """The model-type map is rescanned when the search path changes (a server started after `new`)."""
    from distconf.errors import FamilyNotFoundError

    folder = tmp_path / "mine"
    folder.mkdir()
    text = (builtin_families_dir() / "llama.yaml").read_text(encoding="utf-8")
    text = text.replace("family: llama\n", "family: my_llama\n", 1)
    text = text.replace("model_type: llama\n", "model_type: my_llama\n", 1)
    (folder / "my_llama.yaml").write_text(text, encoding="utf-8")
    monkeypatch.delenv(FAMILIES_PATH_ENV, raising=False)
    with pytest.raises(FamilyNotFoundError, match="no family serves model_type 'my_llama'"):
        family_for_model_type("my_llama")
    monkeypatch.setenv(FAMILIES_PATH_ENV, str(folder))
    assert family_for_model_type("my_llama") == "my_llama"
    monkeypatch.delenv(FAMILIES_PATH_ENV)
    with pytest.raises(FamilyNotFoundError):
        family_for_model_type("my_llama")
