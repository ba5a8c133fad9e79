"""Every kind of bad family file yields one FamilyValidationError with the right file, line and field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distconf import FamilyValidationError, load_family
from distconf.loader.search import validate_paths
from distconf.loader.source import read_family_file


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _line_of(text: str, needle: str) -> int:
    for number, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in text")


def _variant(family_text, old: str, new: str, name: str = "variant") -> str:
    text = family_text("llama").replace("family: llama", f"family: {name}")
    assert old in text, old
    return text.replace(old, new, 1)


def _single_problem(path: Path):
    with pytest.raises(FamilyValidationError) as info:
        read_family_file(path)
    assert isinstance(info.value, ValueError)
    return info.value.problems


CASES = [
    # (what, old, new, needle for the expected line, field, message regex)
    ("unknown key", "model_type: llama", "model_type: llama\ncolour: blue", "colour:", "colour", "unknown field"),
    ("nested unknown key", "  prefix: model.layers", "  prefix: model.layers\n  prefx: h", "prefx:",
     "block.prefx", "unknown field"),
    ("wrong type", "  prefix: model.layers", "  prefix: 12", "prefix: 12", "block.prefix", "valid string"),
    ("bad prefix pattern", "  prefix: model.layers", "  prefix: model..layers", "prefix:", "block.prefix", "pattern"),
    ("negative kv groups", "kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: 0",
     "kv_groups:", "kv_groups", "positive"),
    ("boolean kv groups", "kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: true",
     "kv_groups:", "kv_groups", "boolean"),
    ("unsafe formula: call", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: \"__import__('os').system('id')\"", "kv_groups:", "kv_groups", "only min"),
    ("unsafe formula: attribute", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: num_attention_heads.real", "kv_groups:", "kv_groups", "Attribute"),
    ("unsafe formula: subscript", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: layer_types[0]", "kv_groups:", "kv_groups", "Subscript"),
    ("unsafe formula: lambda", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: '(lambda x: x)(1)'", "kv_groups:", "kv_groups", "only min"),
    ("unsafe formula: dunder", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: __class__", "kv_groups:", "kv_groups", "may not start with '_'"),
    ("unsafe formula: power", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: 9 ** 9 ** 9", "kv_groups:", "kv_groups", "Pow"),
    ("syntax error formula", "kv_groups: num_attention_heads // num_key_value_heads",
     "kv_groups: num_attention_heads //", "kv_groups:", "kv_groups", "not a valid expression"),
    ("untrusted class path", "config_class: transformers.LlamaConfig", "config_class: os.system",
     "config_class:", "config_class", "not under a trusted module"),
    ("dunder class path", "config_class: transformers.LlamaConfig", "config_class: transformers.__builtins__.eval",
     "config_class:", "config_class", "dunder"),
    ("python tag", "model_type: llama", "model_type: !!python/object/apply:os.system [id]", "model_type:",
     "model_type", "tag .* is not allowed"),
    ("custom tag", "model_type: llama", "model_type: !env HOME", "model_type:", "model_type", "not allowed"),
    ("duplicate key", "model_type: llama", "model_type: llama\nmodel_type: llama2", "model_type: llama2",
     "model_type", "duplicate key"),
    ("bad revision", "after_load:", "revisions:\n  org/model: main\nafter_load:", "revisions:", "revisions",
     "40-hex"),
    ("bad dht rule", "  name: repo", "  name: whole", "name: whole", "dht_prefix.name", "repo"),
    ("bad notice", "    message:", "    colour: red\n    message:", "colour: red", "notices.0.colour",
     "unknown field"),
]


@pytest.mark.parametrize(("what", "old", "new", "needle", "field", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_file(tmp_path, family_text, what, old, new, needle, field, message) -> None:
    text = _variant(family_text, old, new)
    path = _write(tmp_path, "variant", text)
    problems = _single_problem(path)
    assert len(problems) == 1, problems
    problem = problems[0]
    assert problem.path == str(path)
    assert problem.line == _line_of(text, needle), (problem, text)
    assert problem.field == field
    assert re.search(message, problem.message), problem.message
    assert str(problem).startswith(f"{path}:{problem.line}:{problem.column}: {field}: ")


def test_missing_field(tmp_path, family_text) -> None:
    text = _variant(family_text, "config_class: transformers.LlamaConfig\n", "")
    problems = _single_problem(_write(tmp_path, "variant", text))
    assert [(p.field, p.message) for p in problems] == [("config_class", "required field is missing")]


def test_all_problems_at_once(tmp_path, family_text) -> None:
    text = _variant(family_text, "model_type: llama", "model_type: 5\ncolour: blue")
    text = text.replace("  prefix: model.layers", "  prefix: [a]")
    text = text.replace("config_class: transformers.LlamaConfig\n", "")
    problems = _single_problem(_write(tmp_path, "variant", text))
    assert sorted(p.field for p in problems) == ["block.prefix", "colour", "config_class", "model_type"]
    assert [p.line for p in problems] == sorted(p.line for p in problems)


def test_alias_bomb_rejected(tmp_path, family_text) -> None:
    bomb = 'a: &a ["x","x"]\nb: &b [*a,*a]\nc: &c [*b,*b]\n'
    problems = _single_problem(_write(tmp_path, "variant", bomb + family_text("llama")))
    assert len(problems) == 1 and problems[0].line == 1 and "anchors" in problems[0].message


def test_yaml_syntax_error_has_line(tmp_path, family_text) -> None:
    text = _variant(family_text, "  prefix: model.layers", "  prefix: [model.layers")
    problems = _single_problem(_write(tmp_path, "variant", text))
    assert len(problems) == 1 and "invalid YAML" in problems[0].message and problems[0].line >= 9


@pytest.mark.parametrize("text,expected", [("", "empty"), ("- a\n- b\n", "list"), ("just text\n", "str")])
def test_not_a_mapping(tmp_path, text, expected) -> None:
    problems = _single_problem(_write(tmp_path, "variant", text))
    assert expected in problems[0].message


def test_binary_file(tmp_path) -> None:
    path = tmp_path / "variant.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert "UTF-8" in _single_problem(path)[0].message


def test_file_name_differs_from_family(tmp_path, family_text) -> None:
    path = _write(tmp_path, "other", family_text("llama"))
    problems = _single_problem(path)
    assert problems[0].field == "family" and problems[0].line == _line_of(family_text("llama"), "family:")
    assert "other.yaml" in problems[0].message and "llama" in problems[0].message


def test_duplicate_family_in_one_validation(tmp_path, family_text) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write(tmp_path / "a", "llama", family_text("llama"))
    second = _write(tmp_path / "b", "llama", family_text("llama"))
    with pytest.raises(FamilyValidationError) as info:
        validate_paths([tmp_path / "a", tmp_path / "b"])
    (problem,) = info.value.problems
    assert problem.path == str(second.resolve()) and "also declared in" in problem.message
    assert str((tmp_path / "a" / "llama.yaml").resolve()) in problem.message


def test_user_file_overrides_builtin_on_search_path(tmp_path, monkeypatch, family_text, fresh_cache,
                                                     caplog) -> None:
    # A user file with a built-in's name wins, and says so (the plugin-system rule users expect).
    user = _write(tmp_path, "llama", family_text("llama"))
    monkeypatch.setenv("DISTCONF_FAMILIES_PATH", str(tmp_path))
    with caplog.at_level("INFO"):
        cls = load_family("llama")
    assert cls.family_source.path == user.resolve()
    assert "overrides" in caplog.text and "families/llama.yaml" in caplog.text


def test_unknown_formula_name_found_at_resolve(tmp_path, family_text, fresh_cache) -> None:
    text = _variant(family_text, "kv_groups: num_attention_heads // num_key_value_heads",
                    "kv_groups: num_attention_heads // num_kv_head_count")
    path = _write(tmp_path, "variant", text)
    read_family_file(path)  # syntactically fine
    with pytest.raises(FamilyValidationError) as info:
        load_family(path)
    (problem,) = info.value.problems
    assert problem.field == "kv_groups" and problem.line == _line_of(text, "kv_groups:")
    assert "num_kv_head_count" in problem.message and "LlamaConfig" in problem.message


def test_unknown_after_load_field_found_at_resolve(tmp_path, family_text, fresh_cache) -> None:
    text = _variant(family_text, "    use_cache: true", "    use_cash: true")
    with pytest.raises(FamilyValidationError) as info:
        load_family(_write(tmp_path, "variant", text))
    (problem,) = info.value.problems
    assert problem.field == "after_load.set.use_cash" and problem.line == _line_of(text, "use_cash")


def test_unimportable_class_found_at_resolve(tmp_path, family_text, fresh_cache) -> None:
    text = _variant(family_text, "transformers.models.llama.modeling_llama.LlamaAttention",
                    "transformers.models.llama.modeling_llama.LlamaAttentionTypo")
    cls = load_family(_write(tmp_path, "variant", text))
    with pytest.raises(FamilyValidationError) as info:
        _ = cls.attn_class
    (problem,) = info.value.problems
    assert problem.field == "block.attention_class" and problem.line == _line_of(text, "LlamaAttentionTypo")


def test_model_type_must_match_config_class(tmp_path, family_text, fresh_cache) -> None:
    text = _variant(family_text, "model_type: llama", "model_type: mistral")
    with pytest.raises(FamilyValidationError, match="has model_type 'llama', not 'mistral'"):
        load_family(_write(tmp_path, "variant", text))


def test_kv_formula_result_checked(fresh_cache) -> None:
    from distconf import ConfigValueError

    cls = load_family("llama")
    with pytest.raises(ConfigValueError) as info:
        _ = cls(num_attention_heads=9, num_key_value_heads=2, hidden_size=72).num_key_value_groups
    message = str(info.value)
    assert "llama" in message and "num_attention_heads // num_key_value_heads" in message
    assert "num_key_value_heads=2" in message and "gave 4" in message
    with pytest.raises(ConfigValueError, match="falcon"):
        _ = load_family("falcon")(num_attention_heads=8, num_kv_heads=0, new_decoder_architecture=True,
                                  hidden_size=64).num_key_value_groups


def test_trusted_modules_env(tmp_path, monkeypatch, family_text) -> None:
    text = _variant(family_text, "config_class: transformers.LlamaConfig", "config_class: mypkg.configs.MyConfig")
    path = _write(tmp_path, "variant", text)
    with pytest.raises(FamilyValidationError, match="not under a trusted module"):
        read_family_file(path)
    monkeypatch.setenv("DISTCONF_TRUSTED_MODULES", "mypkg")
    assert read_family_file(path).spec.config_class == "mypkg.configs.MyConfig"
