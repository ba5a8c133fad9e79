"""Weight commitments without a swarm: the manifest file, the refusal rule, and ``distconf manifest``.

Digests come from real blocks of tiny safetensors checkpoints (and of the real GGUF model),
loaded by the server's own loader; servers are judged by the ``rpc_info`` dicts their handler
builds (the keys `distconf.server.handler.BlockHandler.rpc_info` writes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from client_swarm import REPO, make_model_dir

from distconf.cli import main
from distconf.client.commitments import (
    MANIFEST_FORMAT,
    Commitments,
    ManifestError,
    WeightsManifest,
    check_server,
    read_manifest,
    write_manifest,
)
from distconf.server.integrity import block_digests, weights_digest, weights_form
from distconf.server.loading import load_blocks

LAYERS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 checkpoint of 3 blocks with a distributed config.json."""
    directory, _ = make_model_dir(tmp_path_factory.mktemp("commit") / "llama", "llama", layers=LAYERS)
    return directory


def _config(model_dir: Path) -> Any:
    from distconf.loader.auto import AutoDistributedConfig

    return AutoDistributedConfig.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def digests(model_dir: Path) -> list[str]:
    """The float32 per-block digests of ``model_dir``, taken as a server takes them."""
    return block_digests(load_blocks(model_dir, _config(model_dir), 0, LAYERS, torch.float32))


def _manifest(model_dir: Path, digests: list[str], path: Path | None = None) -> WeightsManifest:
    return WeightsManifest(dht_prefix=str(_config(model_dir).dht_prefix), num_blocks=LAYERS,
                           forms={"float32": tuple(digests)}, model="llama", path=str(path) if path else None)


def _info(digests: list[str], start: int = 0, form: str = "float32") -> dict[str, Any]:
    """What a server of blocks ``start..start+len(digests)-1`` announces."""
    return {"start_block": start, "end_block": start + len(digests), "block_sha256": list(digests),
            "weights_form": form}


# ------------------------------------------------------------------ digests and forms


def test_block_digests_are_single_block_weights_digests(model_dir: Path, digests: list[str]) -> None:
    blocks = load_blocks(model_dir, _config(model_dir), 1, LAYERS, torch.float32)
    assert block_digests(blocks, first_block=1) == digests[1:]
    assert digests[1] == weights_digest([blocks[0]], first_block=1)
    assert len(set(digests)) == LAYERS  # the block index is hashed too


def test_weights_form_keys() -> None:
    assert weights_form("fp32", None) == weights_form(torch.float32, "none") == "float32"
    assert weights_form("bf16", "int8") == "bfloat16+int8"
    assert weights_form("bfloat16", "nf4", "cuda") == "bfloat16+nf4"


# ------------------------------------------------------------------ the file


def test_write_then_read(tmp_path: Path, model_dir: Path, digests: list[str]) -> None:
    path = tmp_path / "m.json"
    manifest = _manifest(model_dir, digests)
    assert write_manifest(manifest, path) == path
    assert read_manifest(path) == manifest
    assert read_manifest(path).path == str(path)
    assert json.loads(path.read_text())["format"] == MANIFEST_FORMAT
    assert sorted(os.listdir(tmp_path)) == ["m.json"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def _bad(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "bad.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    message = str(err.value)
    assert message.startswith(f"weights manifest {path}: ") and "\n" not in message
    return message


def test_bad_files_name_the_file_and_the_problem(tmp_path: Path, model_dir: Path, digests: list[str]) -> None:
    good = _manifest(model_dir, digests).to_dict()

    def variant(**changes: Any) -> str:
        return json.dumps({**good, **changes})

    with pytest.raises(ManifestError, match=r"none\.json: cannot be read: No such file"):
        read_manifest(tmp_path / "none.json")
    assert "not JSON" in _bad(tmp_path, '{"format": ')
    assert "not UTF-8" in _bad(tmp_path, b"\xff\xfe")
    assert "expected a JSON object" in _bad(tmp_path, "[]")
    assert "'format'" in _bad(tmp_path, variant(format="other"))
    assert "'version'" in _bad(tmp_path, variant(version=2))
    assert "'version'" in _bad(tmp_path, variant(version=True))
    assert "'dht_prefix'" in _bad(tmp_path, variant(dht_prefix=""))
    assert "'num_blocks'" in _bad(tmp_path, variant(num_blocks=0))
    assert "'forms'" in _bad(tmp_path, variant(forms={}))
    assert "expected a list of 3 block digests, got 2" in _bad(tmp_path, variant(forms={"float32": digests[:2]}))
    tampered = [digests[0], digests[1][:-1], digests[2]]
    assert "block 1" in _bad(tmp_path, variant(forms={"float32": tampered}))
    assert "block 2" in _bad(tmp_path, variant(forms={"float32": [*digests[:2], digests[2].upper()]}))


def test_commitments_refuse_a_manifest_of_another_model(model_dir: Path, digests: list[str]) -> None:
    manifest = _manifest(model_dir, digests, Path("m.json"))
    with pytest.raises(ManifestError, match=r"weights manifest m\.json: it is for model .*, not 'other'"):
        Commitments(manifest, "other", LAYERS)
    with pytest.raises(ManifestError, match="it has 3 blocks, the model 4"):
        Commitments(manifest, manifest.dht_prefix, 4)


# ------------------------------------------------------------------ the refusal rule


def test_an_honest_server_passes(model_dir: Path, digests: list[str]) -> None:
    manifest = _manifest(model_dir, digests)
    assert check_server(manifest, _info(digests), 0, LAYERS) is None
    assert check_server(manifest, _info(digests[1:], start=1), 1, LAYERS) is None
    assert check_server(manifest, _info(digests), 1, 2) is None  # a part of its span


def test_tampered_digests_are_refused(model_dir: Path, digests: list[str]) -> None:
    """A server of other weights in one block: the digest a real load of them gives, not a made-up string."""
    import copy

    manifest = _manifest(model_dir, digests)
    blocks = load_blocks(model_dir, _config(model_dir), 0, LAYERS, torch.float32)
    changed = copy.deepcopy(blocks[2])
    with torch.no_grad():
        next(changed.parameters()).view(-1)[0] += 1e-3
    other = [*digests[:2], block_digests([changed], first_block=2)[0]]
    reason = check_server(manifest, _info(other), 0, LAYERS)
    assert reason is not None and reason.startswith(f"block 2: its announced sha256 {other[2][:16]}")
    assert check_server(manifest, _info(other), 0, 2) is None  # blocks 0..1 are the manifest's
    shifted = check_server(manifest, _info(digests[:2], start=1), 1, 3)  # block 0's digest is not block 1's
    assert shifted is not None and shifted.startswith("block 1:")


def test_no_digests_or_an_unknown_form_is_refused(model_dir: Path, digests: list[str]) -> None:
    manifest = _manifest(model_dir, digests)
    no_form = {k: v for k, v in _info(digests).items() if k != "weights_form"}
    assert "announces no weights form" in check_server(manifest, no_form, 0, LAYERS)
    no_digests = {k: v for k, v in _info(digests).items() if k != "block_sha256"}
    assert "announces no per-block weight digests" in check_server(manifest, no_digests, 0, LAYERS)
    assert "'bfloat16', which the manifest has no digests for (it has float32)" in check_server(
        manifest, _info(digests, form="bfloat16"), 0, LAYERS)
    assert "cover blocks 0..1, not its span 0..2" in check_server(manifest, _info(digests[:2]), 0, LAYERS)
    assert "malformed" in check_server(manifest, {**_info(digests), "block_sha256": "abc"}, 0, LAYERS)


# ------------------------------------------------------------------ distconf manifest


def test_cli_writes_the_server_digests(tmp_path: Path, model_dir: Path, digests: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    assert main(["manifest", str(model_dir), "-o", str(out), "--dtype", "fp32", "bf16", "float32"]) == 0
    manifest = read_manifest(out)
    assert manifest.dht_prefix == _config(model_dir).dht_prefix and manifest.num_blocks == LAYERS
    assert set(manifest.forms) == {"float32", "bfloat16"}
    assert list(manifest.forms["float32"]) == digests
    bf16 = block_digests(load_blocks(model_dir, _config(model_dir), 0, LAYERS, torch.bfloat16))
    assert list(manifest.forms["bfloat16"]) == bf16
    assert f"wrote {out}: 3 blocks" in capsys.readouterr().out


def test_cli_int8_form_and_default_output(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["manifest", str(model_dir), "--quant", "int8"]) == 0
    (written,) = tmp_path.glob("*.manifest.json")
    assert written.name == f"{_config(model_dir).dht_prefix}.manifest.json"
    int8 = block_digests(load_blocks(model_dir, _config(model_dir), 0, LAYERS, torch.float32, quant="int8"))
    assert list(read_manifest(written).forms["float32+int8"]) == int8


def test_cli_unreadable_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["manifest", str(tmp_path / "empty"), "-o", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distconf manifest: ") and "Traceback" not in err
    assert "holds no config.json" in err
    assert main(["manifest", str(tmp_path / "missing")]) == 1
    assert "is not a file or a folder" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_cli_help_examples_parse() -> None:
    """Every example of ``distconf manifest --help`` is a valid command line."""
    import shlex

    from distconf.cli import build_parser

    parser = build_parser()
    epilog = parser._subparsers._group_actions[0].choices["manifest"].epilog  # type: ignore[union-attr]
    lines = [line.strip() for line in epilog.splitlines()[1:]]
    assert len(lines) == 4
    for line in lines:
        command = line.split("  ")[0]
        args = parser.parse_args(shlex.split(command)[1:])
        assert args.command == "manifest" and args.model.startswith("./")


# ------------------------------------------------------------------ the real model


def _real_env(pytestconfig: pytest.Config) -> dict[str, str]:
    from real_helpers import real_cache_dir

    return {"DISTCONF_CACHE": str(real_cache_dir(pytestconfig).parent)}


@pytest.mark.slow
def test_cli_on_the_real_gguf(tmp_path: Path, pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from real_helpers import open_real_source

    from distconf.tools.real_model import gguf_path

    source = open_real_source(pytestconfig)  # converted once, shared with the other real-model tests
    for name, value in _real_env(pytestconfig).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "real.json"
    assert main(["manifest", str(gguf_path()), "-o", str(out), "--dtype", "float32"]) == 0
    manifest = read_manifest(out)
    layers = int(source.config.num_hidden_layers)
    assert manifest.num_blocks == layers and manifest.dht_prefix == source.config.dht_prefix
    assert manifest.model == gguf_path().name
    last = load_blocks(source.checkpoint_dir, source.config, layers - 1, layers, torch.float32)
    assert manifest.forms["float32"][-1] == block_digests(last, first_block=layers - 1)[0]


@pytest.mark.slow
def test_cli_ctrl_c_leaves_no_file(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """SIGINT while the real model's blocks are hashed: exit 130, ``interrupted``, and no file (not even a temp)."""
    from real_helpers import open_real_source

    from distconf.tools.real_model import gguf_path

    open_real_source(pytestconfig)
    env = {**os.environ, **_real_env(pytestconfig), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "distconf", "manifest", str(gguf_path()), "-o", str(tmp_path / "real.json"),
           "--dtype", "fp32", "bf16", "--quant", "none", "int8"]
    # forked (tests/forkserver.py), which gives Ctrl-C Python's own handler: it reaches the command even when this
    # test runs in a background job (which ignores SIGINT)
    proc = forkserver.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        for line in proc.stderr:  # bounded: the process ends, or the deadline check below fails the test
            if "loading blocks: 1/" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ LoRA adapters in the manifest


def test_the_manifest_lists_adapter_digests_and_a_server_is_judged_by_them(tmp_path: Path, model_dir: Path,
                                                                           digests: list[str]) -> None:
    """`distconf manifest --adapters` lists what a server of the adapter announces (``adapter_sha256``); a client
    using the adapter refuses a server whose adapter digests differ, or an adapter the manifest does not list,
    and keeps accepting the same server's base weights."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from distconf.server.adapters import ServedAdapters, parse_adapters

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
                        ).save_pretrained(str(tmp_path / "lora"))
    out = tmp_path / "with-adapter.json"
    assert main(["manifest", str(model_dir), "-o", str(out), "--dtype", "fp32", "--adapters",
                 f"mine={tmp_path / 'lora'}"]) == 0
    manifest = read_manifest(out)
    served = ServedAdapters(parse_adapters([f"mine={tmp_path / 'lora'}"]), _config(model_dir), torch.float32)
    announced = served.digests(1, LAYERS)
    assert list(manifest.adapters["mine"][1:]) == announced["mine"] and len(set(manifest.adapters["mine"])) == LAYERS
    info = {**_info(digests[1:], start=1), "adapter_sha256": announced}
    assert check_server(manifest, info, 1, LAYERS, "mine") is None
    assert check_server(manifest, info, 1, LAYERS) is None
    assert "lists no digests for adapter 'other'" in check_server(manifest, info, 1, LAYERS, "other")
    tampered = {**info, "adapter_sha256": {"mine": ["0" * 64] * (LAYERS - 1)}}
    assert "block 1: its announced sha256 of adapter 'mine'" in check_server(manifest, tampered, 1, LAYERS, "mine")
    assert "announces no digests of adapter 'mine'" in check_server(manifest, _info(digests[1:], start=1), 1,
                                                                     LAYERS, "mine")
    assert read_manifest(write_manifest(manifest, tmp_path / "again.json")).adapters == manifest.adapters
