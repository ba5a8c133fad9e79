"""The command line, run as a user runs it (subprocesses of the installed entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "distconf", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


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
