"""Hub ids downloaded as people get them, with the real ``huggingface_hub`` client against a stand-in hub on
loopback (``HF_ENDPOINT``): a server fetches the config and only the shards of its blocks, a client only its own
part; a download killed midway resumes; ``--max-disk-space`` evicts the least recently used files of other models
and never one in use; offline, private and missing files are one clear error each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blockhelpers import family_config, hf_model, save_checkpoint
from dhthelpers import stop_process, wait_for
from hub_standin import StandinHub

from distconf.errors import ModelSourceError
from distconf.sources import open_source
from distconf.sources.hub_compat import PARTIAL_SUFFIX
from distconf.sources.hub_fetch import HubOptions

REPO = Path(__file__).resolve().parents[1]
LAYERS = 6


def _model_folder(root: Path, name: str, *, hidden: int = 64, shards: int = 8, seed: int = 0) -> Path:
    """A tiny llama of `LAYERS` layers saved in about ``shards`` safetensors files with an index."""
    _, hf_config, _ = family_config("llama", num_hidden_layers=LAYERS, hidden_size=hidden,
                                    intermediate_size=2 * hidden)
    folder = root / name
    save_checkpoint(hf_model(hf_config, seed=seed), folder, shards=shards)
    return folder


def _shards_of(folder: Path, wanted: Any) -> list[str]:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted({shard for name, shard in weight_map.items() if wanted(name)})


def _layer_shards(folder: Path, layers: range) -> list[str]:
    return _shards_of(folder, lambda n: any(n.startswith(f"model.layers.{i}.") for i in layers))


def _offline(monkeypatch: pytest.MonkeyPatch, offline: bool) -> None:
    """``HF_HUB_OFFLINE`` for this process: the environment distconf reads, and huggingface_hub's reading of it at
    import (a process started with the variable has both)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandinHub]:
    stand_in = StandinHub({"org/tiny": _model_folder(tmp_path / "repos", "tiny")}).start()
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    _offline(monkeypatch, False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        yield stand_in
    finally:
        stand_in.stop()


def test_a_server_fetches_the_config_and_only_the_shards_of_its_blocks(hub: StandinHub, tmp_path: Path) -> None:
    folder = hub.repos["org/tiny"]
    source = open_source("org/tiny", hub=HubOptions(cache_dir=str(tmp_path / "cache")))
    assert source.kind == "hub" and source.hub is not None
    assert set(hub.downloaded("org/tiny")) <= {"config.json", "generation_config.json",
                                               "model.safetensors.index.json"}
    fetched = source.hub.fetch_layers(source.config, range(0, 2))
    assert fetched == _layer_shards(folder, range(0, 2))
    shards = [f for f in hub.downloaded("org/tiny") if f.endswith(".safetensors")]
    assert sorted(shards) == fetched and len(fetched) < len(_shards_of(folder, lambda n: True))
    weights = source.load_block_weights(1)  # read from the cache, as a server loads it
    assert weights and all(t.numel() for t in weights.values())


def test_a_client_fetches_its_part_only(hub: StandinHub, tmp_path: Path) -> None:
    from distconf.client.model_source import open_client_source

    folder = hub.repos["org/tiny"]
    open_client_source("org/tiny", hub=HubOptions(cache_dir=str(tmp_path / "cache")))
    shards = sorted(f for f in hub.downloaded("org/tiny") if f.endswith(".safetensors"))
    assert shards == _shards_of(folder, lambda n: not n.startswith("model.layers."))


def test_offline_a_model_not_in_the_cache_is_named(hub: StandinHub, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _offline(monkeypatch, True)
    with pytest.raises(ModelSourceError, match="offline \\(HF_HUB_OFFLINE=1\\) and it is not in the local"):
        open_source("org/tiny", hub=HubOptions(cache_dir=str(tmp_path / "cache")))
    assert hub.requests == []
    _offline(monkeypatch, False)
    source = open_source("org/tiny", hub=HubOptions(cache_dir=str(tmp_path / "cache")))
    _offline(monkeypatch, True)
    before = len(hub.requests)
    with pytest.raises(ModelSourceError, match="offline \\(HF_HUB_OFFLINE=1\\) and it is not in the cache"):
        source.hub.fetch_layers(source.config, range(0, 1))
    assert len(hub.requests) == before


def test_a_private_repository_needs_its_token_and_a_missing_revision_is_named(hub: StandinHub, tmp_path: Path) -> None:
    hub.repos["org/private"] = hub.repos["org/tiny"]
    hub.tokens["org/private"] = "s3cret"
    cache = str(tmp_path / "cache")
    with pytest.raises(ModelSourceError, match="needs --token"):
        open_source("org/private", hub=HubOptions(cache_dir=cache))
    assert open_source("org/private", hub=HubOptions(cache_dir=cache, token="s3cret")).kind == "hub"
    with pytest.raises(ModelSourceError, match="no revision 'v9'"):
        open_source("org/tiny", hub=HubOptions(cache_dir=cache, revision="v9"))


def test_max_disk_space_evicts_least_recently_used_files_of_other_models(hub: StandinHub, tmp_path: Path) -> None:
    from distconf.sources.hub_fetch import free_disk_space_for

    hub.repos["org/old"] = _model_folder(tmp_path / "repos", "old", seed=1)
    cache = tmp_path / "cache"
    old = open_source("org/old", hub=HubOptions(cache_dir=str(cache)))
    old.hub.fetch_layers(old.config, range(LAYERS))
    old_blobs = sorted((cache / "models--org--old" / "blobs").iterdir())
    old_bytes = sum(p.stat().st_size for p in old_blobs)
    past = time.time() - 3600
    for blob in old_blobs:
        os.utime(blob, (past, past))  # used an hour ago
    tiny = hub.repos["org/tiny"]
    needed = sum((tiny / f).stat().st_size for f in _layer_shards(tiny, range(0, 2)))
    budget = old_bytes + needed  # room for everything but the small files: some old ones must go
    source = open_source("org/tiny", hub=HubOptions(cache_dir=str(cache), max_disk_space=budget))
    source.hub.fetch_layers(source.config, range(0, 2))
    left = sorted((cache / "models--org--old" / "blobs").iterdir())
    assert len(left) < len(old_blobs)
    total = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.is_symlink()
                and "blobs" in p.parts)
    assert total <= budget
    kept = {p.resolve() for p in source.hub.fetched.values()}
    assert all(p.exists() for p in kept)  # files in use are never evicted
    with pytest.raises(ModelSourceError, match="does not fit in --max-disk-space"):
        free_disk_space_for(10 << 20, 1024, str(cache), keep=set(cache.rglob("*")) | kept
                            | {p.resolve() for p in cache.rglob("*") if p.is_file()}, name="x")


# ---------------------------------------------------------------- distconf serve ORG/NAME, as a user runs it

def _serve(hub: StandinHub, cache: Path, *args: str, log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "distconf", "serve", "org/tiny", "--new-swarm", "--host",
                             "127.0.0.1", "--dtype", "float32", "--cache-dir", str(cache), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


@pytest.mark.slow
def test_serve_a_hub_id_downloads_its_blocks_shards_and_resumes_after_a_kill(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "repos", "tiny", hidden=256, shards=6)
    hub = StandinHub({"org/tiny": folder}, rate=400_000).start()  # slow enough to stop a shard midway
    cache = tmp_path / "cache"
    wanted = _layer_shards(folder, range(0, 3))
    try:
        first = _serve(hub, cache, "--blocks", "0:3", log=tmp_path / "first.log")
        try:
            blobs = cache / "models--org--tiny" / "blobs"
            wait_for(lambda: any(p.name.endswith(PARTIAL_SUFFIX) and p.stat().st_size > 0 for p in blobs.glob("*"))
                     if blobs.exists() else False, timeout=120, interval=0.05)
        finally:
            first.kill()
            first.wait(10)
        hub.rate = None
        second = _serve(hub, cache, "--blocks", "0:3", log=tmp_path / "second.log")
        try:
            wait_for(lambda: "SERVING blocks 0:3" in (tmp_path / "second.log").read_text() or second.poll() is not None,
                     timeout=180, interval=0.2)
            assert second.poll() is None, (tmp_path / "second.log").read_text()[-2000:]
        finally:
            stop_process(second, signal.SIGINT)
        shards = sorted({r.filename for r in hub.requests if r.method == "GET" and r.filename.endswith(".safetensors")
                         and r.status in (200, 206)})
        assert shards == wanted  # blocks 0..2's shards, nothing else
        assert any(r.start > 0 and r.status == 206 for r in hub.requests)  # the cut download was resumed
        assert not [p for p in (cache / "models--org--tiny" / "blobs").iterdir()
                    if p.name.endswith((PARTIAL_SUFFIX, ".incomplete"))]
    finally:
        hub.stop()


@pytest.mark.slow
def test_serve_a_hub_id_the_hub_does_not_have_is_one_line(hub: StandinHub, tmp_path: Path) -> None:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "distconf", "serve", "org/nope", "--new-swarm", "--cache-dir",
                           str(tmp_path / "cache")], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        line for line in done.stderr.strip().splitlines() if line.startswith("distconf serve: org/nope")]
    assert "needs --token" in done.stderr and "Traceback" not in done.stderr


def test_a_repository_of_one_gguf_file_is_downloaded_and_converted(hub: StandinHub, tmp_path: Path) -> None:
    from test_sources import write_gguf

    folder = tmp_path / "repos" / "gg"
    folder.mkdir(parents=True)
    write_gguf(folder / "tiny-q.gguf")
    hub.repos["org/gg"] = folder
    source = open_source("org/gg", hub=HubOptions(cache_dir=str(tmp_path / "cache")),
                         cache_dir=tmp_path / "converted")
    assert source.kind == "gguf" and source.config.num_hidden_layers == 2
    assert [f for f in hub.downloaded("org/gg") if f != "(listing)"] == ["tiny-q.gguf"]


def test_a_download_asked_to_stop_ends_at_once_and_resumes(hub: StandinHub, tmp_path: Path) -> None:
    """A server's Ctrl-C / SIGTERM during a shard's download ends it with InterruptedError (what `distconf serve`
    treats as a stop), the partial file stays, and the next attempt resumes it."""
    hub.rate = 200_000
    source = open_source("org/tiny", hub=HubOptions(cache_dir=str(tmp_path / "cache")))
    source.hub.should_stop = lambda: True
    with pytest.raises(InterruptedError, match="stopped while downloading"):
        source.hub.fetch_layers(source.config, range(0, 1))
    blobs = tmp_path / "cache" / "models--org--tiny" / "blobs"
    assert any(p.name.endswith(PARTIAL_SUFFIX) for p in blobs.iterdir())
    hub.rate = None
    source.hub.should_stop = None
    source.hub.fetch_layers(source.config, range(0, 1))
    assert any(r.start > 0 and r.status == 206 for r in hub.requests)
