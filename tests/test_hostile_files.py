"""Hostile family files: huge, endless or blocking files, YAML 1.1 surprises, formula bombs, echoed secrets.

Nothing here allocates gigabytes: big files are sparse, and every read of one runs
under an address-space cap so that a regression fails with MemoryError instead of
eating the machine's memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from distconf import ConfigValueError, FamilyValidationError, load_family, load_preset
from distconf.loader.formula import Formula, FormulaError
from distconf.loader.search import find_family_file, list_families, validate_paths
from distconf.loader.source import read_family_file
from distconf.loader.yamlsafe import parse_yaml

HUGE = 8 << 30  # 8 GiB, sparse


@contextlib.contextmanager
def memory_cap(extra: int = 1 << 30) -> Iterator[None]:
    """Let the process map at most ``extra`` more bytes inside the block (Linux; no-op elsewhere)."""
    try:
        import resource

        status = Path("/proc/self/status").read_text()
    except (ImportError, OSError):
        yield
        return
    vm_kib = int(re.search(r"VmSize:\s+(\d+)", status).group(1))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_kib * 1024 + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def sparse(path: Path, size: int = HUGE) -> Path:
    """A file of ``size`` bytes that takes no disk space (and starts like a family file)."""
    with path.open("wb") as f:
        f.write(b"family: huge\n")
        f.truncate(size)
    return path


def fifo(path: Path) -> Path:
    """A named pipe nobody writes to: opening it for reading blocks forever."""
    os.mkfifo(path)
    return path


def call_bounded(fn: Callable[[], Any], unblock: Path | None = None, seconds: float = 30) -> Any:
    """Run ``fn`` in a thread; if it is still blocked after ``seconds``, unblock the FIFO and fail."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed back to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:
            with contextlib.suppress(OSError):
                os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def problems_of(fn: Callable[[], Any]) -> list:
    with pytest.raises(FamilyValidationError) as info:
        fn()
    return info.value.problems


def variant(family_text, old: str, new: str, name: str = "variant") -> str:
    text = family_text("llama").replace("family: llama", f"family: {name}")
    assert old in text, old
    return text.replace(old, new, 1)


def write(tmp_path: Path, text: str, name: str = "variant") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def line_of(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


# -- files that are too big, endless or blocking -----------------------------------------------------------------

def test_sparse_8gib_file_refused_before_reading(tmp_path) -> None:
    path = sparse(tmp_path / "huge.yaml")
    tracemalloc.start()
    try:
        with memory_cap():
            (problem,) = problems_of(lambda: read_family_file(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert problem.path == str(path) and problem.line == 1
    assert str(HUGE) in problem.message and "limit" in problem.message
    assert peak < 4 << 20, f"{peak} bytes allocated while refusing the file"


def test_just_over_the_limit_refused(tmp_path) -> None:
    path = sparse(tmp_path / "big.yaml", (1 << 20) + 1)
    (problem,) = problems_of(lambda: read_family_file(path))
    assert "limit" in problem.message


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_dev_zero_named_directly(tmp_path) -> None:
    with memory_cap():
        (problem,) = problems_of(lambda: read_family_file("/dev/zero"))
        assert "character device" in problem.message
        link = tmp_path / "zero.yaml"
        link.symlink_to("/dev/zero")
        (problem,) = problems_of(lambda: validate_paths([link]))
        assert problem.path == str(link) and "character device" in problem.message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_named_directly_does_not_block(tmp_path) -> None:
    pipe = fifo(tmp_path / "pipe.yaml")
    (problem,) = problems_of(lambda: call_bounded(lambda: read_family_file(pipe), unblock=pipe))
    assert "FIFO" in problem.message
    (problem,) = problems_of(lambda: call_bounded(lambda: validate_paths([pipe]), unblock=pipe))
    assert "FIFO" in problem.message


@pytest.mark.skipif(not hasattr(os, "mkfifo") or sys.platform == "win32", reason="needs FIFOs and symlinks")
def test_bad_files_on_search_path_are_skipped(tmp_path, monkeypatch, caplog, fresh_cache) -> None:
    from transformers import LlamaConfig  # noqa: F401 - imported (big mappings) before the memory cap

    user = tmp_path / "user"
    user.mkdir()
    sparse(user / "llama.yaml")  # same name as a built-in: skipped, the built-in still loads
    sparse(user / "huge.yaml")
    pipe = fifo(user / "pipe.yaml")
    (user / "zero.yaml").symlink_to("/dev/zero")
    monkeypatch.setenv("DISTCONF_FAMILIES_PATH", str(user))
    caplog.set_level(logging.WARNING, logger="distconf.loader.source")
    with memory_cap():
        names = call_bounded(list_families, unblock=pipe)
        assert {"llama", "falcon", "huge"} <= set(names) and "pipe" not in names and "zero" not in names
        cfg = call_bounded(lambda: load_preset("meta-llama/Llama-2-70b-hf"), unblock=pipe)
        assert type(cfg).__name__ == "DistributedLlamaConfig"
        assert find_family_file("llama") == (Path(__file__).parents[1] / "families" / "llama.yaml").resolve()
        (problem,) = problems_of(lambda: load_family("huge"))  # the only file of that name: its error
        assert problem.path == str(user / "huge.yaml") and "limit" in problem.message
    warned = caplog.text
    for name in ("llama.yaml", "huge.yaml", "pipe.yaml", "zero.yaml"):
        assert str(user / name) in warned, name
    assert "FIFO" in warned and "character device" in warned


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_validate_folder_with_fifo_and_huge_file(tmp_path, family_text, caplog) -> None:
    folder = tmp_path / "fams"
    folder.mkdir()
    write(folder, family_text("llama"), "llama")
    pipe = fifo(folder / "pipe.yaml")
    sparse(folder / "huge.yaml")
    with memory_cap():
        problems = problems_of(lambda: call_bounded(lambda: validate_paths([folder]), unblock=pipe))
    assert [(Path(p.path).name, "limit" in p.message) for p in problems] == [("huge.yaml", True)]
    assert "pipe.yaml" in caplog.text and "FIFO" in caplog.text


# -- YAML: 1.2 core schema, no 1.1 surprises, bounded integers ----------------------------------------------------

def test_base60_integer_rejected_fast(tmp_path, family_text) -> None:
    value = ":".join(["59"] * 2000)
    text = variant(family_text, "after_load:", f"petals_kv_groups: {value}\nafter_load:")
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.line == line_of(text, "petals_kv_groups") and problem.field == "petals_kv_groups"
    assert "YAML 1.1" in problem.message and len(str(problem)) < 400


@pytest.mark.parametrize("written,meaning", [
    ("1:20", "an integer in YAML 1.1"), ("0100", "octal 64"), ("yes", "a boolean"), ("on", "a boolean"),
    ("Off", "a boolean"), ("1_000", "an integer in YAML 1.1"), ("0b11", "an integer in YAML 1.1"),
    ("1e-5", "a string in YAML 1.1"), ("2024-01-01", "a date"),
])
def test_yaml11_only_forms_rejected_at_their_line(tmp_path, family_text, written, meaning) -> None:
    text = variant(family_text, "    use_cache: true", f"    use_cache: {written}")
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.line == line_of(text, "use_cache:") and problem.field == "after_load.set.use_cache"
    assert meaning in problem.message and "quote it" in problem.message


@pytest.mark.parametrize("written,value", [
    ("true", True), ("FALSE", False), ("~", None), ("null", None), ("'yes'", "yes"), ('"0100"', "0100"),
    ("12", 12), ("-3", -3), ("0x1F", 31), ("1.0e-5", 1.0e-5), ("2.5", 2.5), ("n", "n"), ("!!str 1:20", "1:20"),
    ("!!float 3", 3.0),
])
def test_yaml12_core_values(written, value) -> None:
    data, _ = parse_yaml(f"x: {written}\n")
    assert data == {"x": value} and type(data["x"]) is type(value)


@pytest.mark.parametrize("written,message", [
    ("9" * 41, "more than 40 digits"), (".nan", "NaN"), ("-.inf", "infinity"), ("1.0e+999", "out of range"),
    ("!!int 1.5", "not a valid !!int"),
])
def test_unrepresentable_numbers_rejected(tmp_path, family_text, written, message) -> None:
    text = variant(family_text, "    use_cache: true", f"    use_cache: {written}")
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.line == line_of(text, "use_cache:") and message in problem.message
    assert len(str(problem)) < 400


@pytest.mark.parametrize("field,old,new", [
    ("kv_groups", "kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: 2000000"),
    ("petals_kv_groups", "after_load:", "petals_kv_groups: 2000000\nafter_load:"),
    ("kv_cache.num_kv_heads", "kv_cache: {}", "kv_cache:\n  num_kv_heads: 99999999999"),
    ("kv_cache.values_per_token", "kv_cache: {}", "kv_cache:\n  values_per_token: 4194304"),
])
def test_integer_fields_bounded(tmp_path, family_text, field, old, new) -> None:
    text = variant(family_text, old, new)
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.field == field and re.search(r"at most|less than or equal", problem.message)


def test_float_top_level_key_located_at_its_line(tmp_path, family_text) -> None:
    text = family_text("llama").replace("family: llama", "family: variant") + "1.5: x\n"
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.line == len(text.splitlines()) and "float" in problem.message


# -- formulas -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["LlamaForCausalLM", ["LlamaForCausalLM"], None, 10**40])
def test_formula_operands_are_numbers(value) -> None:
    formula = Formula("architectures * 100000000")
    with memory_cap(), pytest.raises(FormulaError) as info:
        formula.evaluate({"architectures": value})
    assert len(str(info.value)) < 300 and "architectures=" in str(info.value)


def test_formula_values_truncated_in_messages() -> None:
    with pytest.raises(FormulaError) as info:
        Formula("a + 1").evaluate({"a": "x" * 1_000_000})
    assert len(str(info.value)) < 300


def test_formula_passes_a_bare_name_and_tests_any_value() -> None:
    assert Formula("layer_types").evaluate({"layer_types": ["a", "b"]}) == ["a", "b"]
    assert Formula("rope_scaling is not None").evaluate({"rope_scaling": {"type": "x"}}) is True
    assert Formula("a == b").evaluate({"a": "x", "b": "x"}) is True
    assert Formula("-x").evaluate({"x": True}) == -1


def test_unary_minus_chain_rejected(tmp_path, family_text) -> None:
    with pytest.raises(FormulaError, match="nested deeper"):
        Formula("-" * 499 + "1")
    text = variant(family_text, "kv_groups: num_attention_heads // num_key_value_heads",
                   "kv_groups: " + "-" * 481 + "num_attention_heads")
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.field == "kv_groups" and "nested deeper" in problem.message


@pytest.mark.parametrize("kv_groups", ["3", "num_key_value_heads + 1"])
def test_kv_groups_checked_against_tiny_config(tmp_path, family_text, kv_groups) -> None:
    text = variant(family_text, "kv_groups: num_attention_heads // num_key_value_heads", f"kv_groups: {kv_groups}")
    (problem,) = problems_of(lambda: read_family_file(write(tmp_path, text)))
    assert problem.field == "kv_groups" and problem.line == line_of(text, "kv_groups:")
    assert "tiny_config" in problem.message and "gave 3" in problem.message
    assert "num_attention_heads=4" in problem.message


def test_plain_integer_kv_groups_checked_on_config(tmp_path, family_text, fresh_cache) -> None:
    text = variant(family_text, "kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: 3")
    text = text.replace("  num_attention_heads: 4\n", "  num_attention_heads: 6\n")
    cls = load_family(write(tmp_path, text))
    assert cls(num_attention_heads=6, hidden_size=48).num_key_value_groups == 3
    with pytest.raises(ConfigValueError, match="gave 3 with num_attention_heads=8"):
        _ = cls(num_attention_heads=8, hidden_size=64).num_key_value_groups


# -- errors quote only short excerpts -----------------------------------------------------------------------------

SECRETS = (
    '{"AKIAIOSFODNN7EXAMPLE-wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY": 1,\n'
    ' "db.internal:5432:orders:admin:S3cr3t-Passw0rd": 1,\n'
    ' "ghp_0123456789abcdefghijklmnopqrstuvwxyzAB": 1}\n'
)


@pytest.mark.parametrize("content", [SECRETS, "user: admin\npin: 0012345\nrecovery_code: 4821_9930_1177\n"])
def test_symlink_to_secrets_file_not_echoed(tmp_path, content) -> None:
    secrets = tmp_path / "credentials"
    secrets.write_text(content)
    link = tmp_path / "variant.yaml"
    link.symlink_to(secrets)
    (problem,) = problems_of(lambda: validate_paths([link]))
    assert "not a family file" in problem.message
    text = str(problem)
    for secret in ("AKIA", "S3cr3t", "ghp_", "wJalr", "admin", "12345", "4821"):
        assert secret not in text


def test_many_unknown_keys_listed_briefly(tmp_path, family_text) -> None:
    junk = "".join(f"junk_{i}_{'z' * 300}: {i}\n" for i in range(200))
    text = family_text("llama").replace("family: llama", "family: variant") + junk
    with pytest.raises(FamilyValidationError) as info:
        read_family_file(write(tmp_path, text))
    problems = info.value.problems
    assert len(problems) == 21 and "180 more" in problems[-1].message
    assert all(len(p.field) <= 120 for p in problems) and len(str(info.value)) < 5000


def test_long_values_cut_in_messages(tmp_path, family_text) -> None:
    text = variant(family_text, "config_class: transformers.LlamaConfig", "config_class: evil." + "A" * 20000)
    text = text.replace("after_load:", f"revisions:\n  org/model: {'f' * 20000}\nafter_load:")
    with pytest.raises(FamilyValidationError) as info:
        read_family_file(write(tmp_path, text))
    assert {p.field for p in info.value.problems} == {"config_class", "revisions"}
    assert len(str(info.value)) < 1000
