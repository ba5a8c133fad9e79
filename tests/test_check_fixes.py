"""``distconf check`` bugs found by the issue-23 sweep, each pinned: one precise located line per failure."""

from __future__ import annotations

import pytest
from blockhelpers import write_family

from distconf.cli import main
from distconf.tools.checker import check_family


def test_an_unimportable_attention_class_is_located_once(tmp_path, fresh_cache, capsys) -> None:
    # before: "x.yaml:14:3: block.attention_class: x.yaml:14:3: block.attention_class: cannot import ..."
    path = write_family(tmp_path, "llama", "llama_noattn",
                        lambda t: t.replace("modeling_llama.LlamaAttention", "modeling_llama.NoSuchAttention"))
    failure = next(r.failure for r in check_family(path) if not r.ok)
    assert failure.field == "block.attention_class"
    assert str(failure).count(str(path)) == 1 and str(failure).count("block.attention_class") == 1, str(failure)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(str(path)) == 1, err


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("family: llama_bad\n", "family: llama_bad\nunknown_section: 1\n"),
    lambda t: t.replace("  prefix: model.layers\n", "  prefix: [model.layers]\n"),
])
def test_check_of_an_invalid_file_is_one_located_failure(tmp_path, fresh_cache, capsys, edit) -> None:
    path = write_family(tmp_path, "llama", "llama_bad", edit)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}:" in err, err
