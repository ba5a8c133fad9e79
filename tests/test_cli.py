"""The command line, run as a user runs it (subprocesses of the installed entry point)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

pytestmark = pytest.mark.slow  # each test starts the CLI in a process of its own

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return forkserver.run([sys.executable, "-m", "distconf", *args], timeout=timeout, env=full_env, cwd=REPO)


def test_help_explains() -> None:
    out = run("--help")
    assert out.returncode == 0
    for word in ("validate", "show", "schema", "list", "DISTCONF_FAMILIES_PATH"):
        assert word in out.stdout
    assert run("validate", "--help").returncode == 0


def test_validate_builtins_without_torch() -> None:
    code = ("import sys\nfrom distconf.cli import main\nrc = main(['validate', '-q'])\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
            "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_import_distconf_is_light() -> None:
    code = "import sys, distconf\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_validate_exit_codes(tmp_path) -> None:
    good = run("validate", str(REPO / "families"))
    assert good.returncode == 0 and "ok" in good.stdout
    bad = tmp_path / "llama.yaml"
    bad.write_text((REPO / "families" / "llama.yaml").read_text().replace("kv_groups:", "kv_groupz:"))
    out = run("validate", str(bad))
    assert out.returncode == 1
    assert f"{bad}:" in out.stderr and "kv_groupz: unknown field" in out.stderr
    assert "kv_groups: required field is missing" in out.stderr
    assert run("validate", str(tmp_path / "missing.yaml")).returncode == 1
    assert run("validate", "--no-such-flag").returncode == 2


def test_every_builtin_family_validates_with_resolve(capsys) -> None:
    from distconf.cli import main

    assert main(["validate", "--resolve"]) == 0  # imports every class a built-in family names
    assert "problem" not in capsys.readouterr().out


def test_validate_resolve_catches_bad_names(tmp_path) -> None:
    bad = tmp_path / "llama.yaml"
    bad.write_text((REPO / "families" / "llama.yaml").read_text().replace(
        "num_attention_heads // num_key_value_heads", "num_attention_heads // num_kv_heads"))
    assert run("validate", str(bad)).returncode == 0
    out = run("validate", "--resolve", str(bad))
    assert out.returncode == 1 and "num_kv_heads" in out.stderr and "kv_groups" in out.stderr


def test_schema_check_current_and_stale(tmp_path) -> None:
    assert run("schema", "--check").returncode == 0
    stale = tmp_path / "schema.json"
    stale.write_text("{}\n")
    out = run("schema", "--check", "-o", str(stale))
    assert out.returncode == 1 and "stale" in out.stderr
    assert run("schema", "-o", str(stale)).returncode == 0
    assert run("schema", "--check", "-o", str(stale)).returncode == 0


def test_list() -> None:
    out = run("list")
    assert out.returncode == 0
    for family in ("bloom", "falcon", "llama", "mixtral"):
        assert family in out.stdout


@pytest.mark.parametrize("args,expected", [
    (["show", "falcon", "--preset", "tiiuae/falcon-40b"],
     ["DistributedFalconConfig", "FalconAttention", "transformer.h.<i>.", "falcon-40b.0 ... falcon-40b.59",
      "PinnedRevisionMixin"]),
    (["show", "--preset", "meta-llama/Llama-2-70b-hf", "--name", "someone/Llama-2-70b-chat.v2"],
     ["DistributedLlamaConfig", "Llama-2-70b-chat-v2-hf.0 ... Llama-2-70b-chat-v2-hf.79"]),
    (["show", "bloom"], ["DistributedBloomConfig", "BloomAttention", "h.<i>."]),
])
def test_show(args, expected) -> None:
    out = run(*args)
    assert out.returncode == 0, out.stderr
    for text in expected:
        assert text in out.stdout


def test_show_local_config_keeps_prefix(tmp_path) -> None:
    from distconf import load_family

    load_family("mixtral")(num_hidden_layers=3, dht_prefix="local-swarm").save_pretrained(tmp_path)
    out = run("show", "--config", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "local-swarm.0 ... local-swarm.2" in out.stdout


def test_show_errors_are_clean() -> None:
    out = run("show", "nonexistent_family")
    assert out.returncode == 1 and "Traceback" not in out.stderr and "known families" in out.stderr
    assert run("show").returncode == 2


def _one_clean_error(out: subprocess.CompletedProcess) -> str:
    """The single stderr line of a failed command (no traceback, non-zero exit)."""
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_check_unknown_family_is_one_clean_error() -> None:
    line = _one_clean_error(run("check", "nosuchfamily", timeout=60))
    assert line.startswith("distconf check: ") and "nosuchfamily" in line and "known families" in line
    verbose = run("-v", "check", "nosuchfamily", timeout=60)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr and "FamilyNotFoundError" in verbose.stderr


def test_os_error_is_one_clean_error(tmp_path) -> None:
    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("x\n")
    line = _one_clean_error(run("schema", "-o", str(not_a_folder / "family.schema.json"), timeout=60))
    assert line.startswith("distconf schema: ") and str(not_a_folder) in line


def test_validate_non_regular_paths_neither_trace_nor_hang(tmp_path) -> None:
    out = run("validate", "/dev/null", timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "/dev/null" in out.stderr
    not_families = tmp_path / "notes"
    not_families.mkdir()
    (not_families / "readme.txt").write_text("not a family\n")
    out = run("validate", str(not_families), timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "no family files" in out.stderr
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    try:
        out = run("validate", str(fifo), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("distconf validate blocked reading a FIFO")
    assert out.returncode == 1 and "Traceback" not in out.stderr and str(fifo) in out.stderr


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_plan_num_devices_must_be_a_positive_integer(value, capsys) -> None:
    from distconf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "no/such-preset", "--memory", "24GiB", "--num-devices", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--num-devices" in err and ("positive integer" in err or "whole number" in err)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from distconf.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_commands_are_the_explicit_ordered_list() -> None:
    from distconf.cli import COMMANDS, build_parser

    assert list(_subcommands()) == list(COMMANDS)
    top = build_parser().format_help()
    positions = [top.index(f"    {name} ") for name in COMMANDS]
    assert positions == sorted(positions)  # --help lists them in that order


@pytest.mark.parametrize("name", [
    "list", "validate", "show", "check", "new", "plan", "serve", "manifest", "generate", "chat", "api", "swarm",
    "monitor", "demo", "schema",
])
def test_command_help_has_examples(name) -> None:
    text = _subcommands()[name].format_help()
    assert "example" in text
    assert f"distconf {name}" in text.split("example", 1)[1]


def test_the_console_script_freezes_what_it_made_before_the_process_ends(monkeypatch, capsys) -> None:
    """The interpreter's last collection would visit every object torch and transformers made (0.86 s of a 5 s
    command, benchmarks/bench_cli_exit.py); the console script (no argv) freezes them first, an in-process call
    does not."""
    import gc

    from distconf.cli import main

    gc.unfreeze()  # frozen objects can still die by refcount: only a count from 0 says who froze
    try:
        assert main(["list"]) == 0 and gc.get_freeze_count() == 0
        monkeypatch.setattr(sys, "argv", ["distconf", "list"])
        monkeypatch.setattr("distconf.cli.apply_thread_policy", lambda role: {})  # this process's env stays
        assert main() == 0 and gc.get_freeze_count() > 0
    finally:
        gc.freeze()  # the worker's objects stay frozen, as conftest froze them after collection
    assert "llama" in capsys.readouterr().out
