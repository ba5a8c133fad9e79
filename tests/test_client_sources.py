"""The client reads every model source: a plain Hugging Face folder, a GGUF file, a cached hub id; errors.

The swarm part: a tiny llama folder with no ``dht_prefix`` in its ``config.json`` (and a
word-level tokenizer), served by two ``distconf serve`` processes (blocks 0:2 and 2:4)
under the prefix the family's rule derives from the folder's name. The client opened on
the same folder with no prefix (derived the same way), or with ``dht_prefix=``, and
``distconf generate`` on it give the local transformers model's greedy tokens and text.
The error cases fail before any swarm is joined, so they start no process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest
import torch
from blockhelpers import family_config, hf_model
from client_swarm import REPO
from safetensors.torch import load_file
from swarm_harness import Swarm as HarnessSwarm
from swarm_harness import swarm_fixture
from test_sources import _fake_hub_cache, write_gguf

from distconf.sources import ModelSourceError, open_source

LAYERS = 4
FOLDER_NAME = "Tiny-Llama-Plain"
DERIVED = "Tiny-Llama-Plain-hf"  # the llama family's rule: the repo name plus -hf


def _plain_folder(folder: Path, *, layers: int = LAYERS, seed: int = 0) -> tuple[Path, Any]:
    """A tiny llama saved by transformers as it is (no dht_prefix), with a word-level tokenizer ``w0 .. wN``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, hf_config, _ = family_config("llama", num_hidden_layers=layers)
    model = hf_model(hf_config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # non-trivial weights: greedy generation does not settle on one token
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(hf_config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(folder)
    assert "dht_prefix" not in json.loads((folder / "config.json").read_text())
    return folder, model


def _serve_supports_dht_prefix() -> bool:
    """Whether ``distconf serve`` has ``--dht-prefix`` yet (issue 18's serve path)."""
    from distconf.cli import cmd_serve

    commands = argparse.ArgumentParser(prog="distconf").add_subparsers(dest="command")
    cmd_serve.register(commands)
    return "--dht-prefix" in commands.choices["serve"].format_help()


class Swarm(HarnessSwarm):
    """The harness's bootstrap DHT, the plain folder, its local model and two servers (0:2, 2:4) under the
    derived prefix."""

    def build(self) -> None:
        self.folder, self.local = _plain_folder(self.root / FOLDER_NAME)
        assert open_source(self.folder).dht_prefix == DERIVED  # the servers' rule
        served, extra = self.folder, ["--dht-prefix", DERIVED]
        if not _serve_supports_dht_prefix():  # before the serve path of issue 18: a copy with the prefix saved
            served = shutil.copytree(self.folder, self.root / "served" / FOLDER_NAME)
            open_source(served).load_config().save_pretrained(served)
            extra = []
        self.serve([(served, "0:2"), (served, "2:4")], *extra)

    def model(self, source: Any = None, **kwargs: Any) -> Any:
        return super().model(source or self.folder, max_retries=2, **kwargs)


swarm = swarm_fixture("client-sources", None, cls=Swarm)


def _greedy(model: Any, ids: torch.Tensor, new: int = 8) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


PROMPT = torch.tensor([[5, 17, 42, 9, 77]])


@pytest.mark.swarm
def test_plain_folder_derives_the_servers_prefix(swarm: Swarm) -> None:
    model = swarm.model()
    assert model.config.dht_prefix == DERIVED
    assert _greedy(model, PROMPT) == _greedy(swarm.local, PROMPT)


@pytest.mark.swarm
def test_explicit_dht_prefix(swarm: Swarm) -> None:
    model = swarm.model(dht_prefix=DERIVED)
    assert model.config.dht_prefix == DERIVED
    assert _greedy(model, PROMPT) == _greedy(swarm.local, PROMPT)
    other = swarm.model(dht_prefix="some-other-swarm")  # overrides the derived one (no server holds it)
    assert other.config.dht_prefix == "some-other-swarm"


@pytest.mark.swarm
def test_generate_cli_prints_the_local_text(swarm: Swarm) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(swarm.folder)
    prompt = "w5 w17 w42 w9"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = tokenizer.decode(_greedy(swarm.local, ids, 6)[0], skip_special_tokens=True)
    result = forkserver.run(
        [sys.executable, "-m", "distconf.cli.cmd_generate", str(swarm.folder), prompt, "--initial-peers",
         *swarm.peers, "--max-new-tokens", "6"],
        timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip("\n") == want and want


@pytest.mark.swarm
def test_gguf_gives_the_converted_folders_weights(swarm: Swarm, tmp_path: Path) -> None:
    """A GGUF file (and a folder holding one): the non-block tensors are the converted copy's."""
    from distconf.client.model_source import open_client_source

    holder = tmp_path / "models"
    holder.mkdir()
    file = write_gguf(holder / "Tiny-Client.F32.gguf", layers=2)
    cache = tmp_path / "cache"
    model = swarm.model(file, gguf_cache_dir=cache)
    converted = open_source(file, cache_dir=cache)
    assert model.config.dht_prefix == converted.dht_prefix == "Tiny-Client-F32-hf"
    tensors = load_file(converted.checkpoint_dir / "model.safetensors")
    state = model.state_dict()
    non_block = {k for k in tensors if not k.startswith("model.layers.")}
    assert non_block == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for name in non_block:
        assert torch.equal(state[name], tensors[name]), name
    again = swarm.model(holder, gguf_cache_dir=cache, dht_prefix="tiny-gguf")  # the folder, prefix overridden
    assert again.config.dht_prefix == "tiny-gguf"
    assert torch.equal(again.state_dict()["lm_head.weight"], tensors["lm_head.weight"])
    assert open_client_source(converted).folder == converted.checkpoint_dir  # an opened source is accepted too


@pytest.mark.swarm
def test_hub_id_from_the_local_cache(swarm: Swarm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hub_cache(tmp_path / "hub", "some-org/Tiny-Llama-Plain", swarm.folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = swarm.model("some-org/Tiny-Llama-Plain", cache_dir=tmp_path / "hub")
    assert model.config.dht_prefix == DERIVED  # the repo name: the same swarm as the folder
    assert _greedy(model, PROMPT, 4) == _greedy(swarm.local, PROMPT, 4)


# --- errors: each a ModelSourceError (Python) or one line and exit 2 (CLI), before any swarm is joined ----------

@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _plain_folder(tmp_path_factory.mktemp("plain") / FOLDER_NAME, layers=2)[0]


def _error(model: Any, **kwargs: Any) -> ModelSourceError:
    from distconf.client import AutoDistributedModelForCausalLM

    with pytest.raises(ModelSourceError) as info:
        AutoDistributedModelForCausalLM.from_pretrained(model, initial_peers=["/ip4/127.0.0.1/tcp/1"], **kwargs)
    assert info.value.source == str(model)
    return info.value


def _broken_sources(plain: Path, root: Path) -> dict[str, tuple[Path | str, str]]:
    """``{case: (source, expected reason fragment)}``."""
    odd = shutil.copytree(plain, root / "odd")
    data = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**data, "model_type": "no-such-arch"}))
    bare = shutil.copytree(plain, root / "bare")
    (bare / "model.safetensors").unlink()
    return {
        "absent": (root / "absent", "is not a file or a folder"),
        "architecture": (odd, "unsupported architecture"),
        "no weights": (bare, "no weights"),
        "gguf type": (write_gguf(root / "wide.gguf", dtype=np.float64),
                      "unsupported GGUF tensor type(s) F64"),
        "hub id": ("some-org/not-cached-anywhere", "not in the local Hugging Face cache"),
    }


def test_unusable_sources_raise_model_source_error(plain: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for case, (source, reason) in _broken_sources(plain, tmp_path).items():
        assert reason in _error(source, gguf_cache_dir=tmp_path / "cache").reason, case
    assert "no usable DHT prefix" in _error(plain, dht_prefix="two words").reason


def test_generate_cli_names_an_unusable_source_in_one_line(plain: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from distconf.cli.cmd_generate import main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DISTCONF_CACHE", str(tmp_path / "cache"))
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/1"]
    cases = [([str(source), "--ids", "1,2"], reason) for source, reason in _broken_sources(plain, tmp_path).values()]
    cases.append(([str(plain), "--ids", "1,2", "--dht-prefix", "two words"], "no usable DHT prefix"))
    for argv, reason in cases:
        assert main([*argv, *peers]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and reason in err and "Traceback" not in err, err
        assert err.startswith(f"distconf generate: {argv[0]}: cannot be served: "), err
