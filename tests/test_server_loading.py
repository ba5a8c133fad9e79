"""Loading progress, the announced repository, and loading + measuring real blocks."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
from blockhelpers import family_config, hf_model, record_layers, save_checkpoint

from distconf.server.block_server import hub_repository
from distconf.server.loading import Progress, load_blocks, measure_throughput, plan_span


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    out = _Terminal()
    progress = Progress(2, 3 * 2**20, out)
    progress.advance(2**20)
    progress.advance(2 * 2**20)
    text = out.getvalue()
    assert text.startswith("\rloading blocks: 1/2, 1.0/3.0 MiB") and "\rloading blocks: 2/2, 3.0/3.0 MiB" in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_progress_is_logged_when_not_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="distconf.server.loading"):
        progress = Progress(1, 2**20, out)
        progress.advance(2**20)
    assert out.getvalue() == ""
    assert "loading blocks: 1/1, 1.0/1.0 MiB" in caplog.text


def test_hub_repository_from_a_cache_snapshot(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--org--Model-7b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert hub_repository(snapshot) == "https://huggingface.co/org/Model-7b"
    assert hub_repository(tmp_path) is None


def test_load_measure_and_place_real_blocks(tmp_path: Path) -> None:
    from distconf.loader import load_family

    _, hf_cfg, _ = family_config("llama", num_hidden_layers=3)
    model = hf_model(hf_cfg)
    save_checkpoint(model, tmp_path, shards=2)
    config = load_family("llama").from_pretrained(str(tmp_path), dht_prefix="load-test")
    blocks = load_blocks(tmp_path, config, 1, 3, torch.float32, progress=Progress(2, 1, io.StringIO()))
    assert all(not p.requires_grad for b in blocks for p in b.parameters())
    ids = torch.randint(0, hf_cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    ref = record_layers(model, config, ids)
    h = ref[1][0]
    with torch.no_grad():
        for block in blocks:
            h, _ = block(h)
    assert torch.allclose(h, ref[2][1], atol=1e-5)
    speed = measure_throughput(blocks, config.hidden_size, torch.float32, steps=2, forward_tokens=16)
    assert speed.inference_rps > 0 and speed.forward_rps > 0
    assert speed.throughput == pytest.approx(speed.forward_rps / 1.5)  # 2 blocks: (2 + 1) / 2
    span = plan_span(config, "1GiB", "float32", num_blocks=2)  # empty swarm: the first window
    assert (span.start, span.end) == (0, 2)
    assert plan_span(config, "1GiB", "float32", blocks=(1, 3)).num_blocks == 2
    with pytest.raises(ValueError, match="not inside"):
        plan_span(config, "1GiB", "float32", blocks=(2, 4))
    with pytest.raises(ValueError, match="not one block fits"):
        plan_span(config, 1000, "float32")


@pytest.mark.swarm
def test_stop_while_loading_ends_the_server(tmp_path: Path) -> None:
    """A stop request (SIGINT/SIGTERM in ``distconf serve``) during loading stops at the next block."""
    import threading

    from distconf.loader import load_family
    from distconf.server.block_server import BlockServer, ServeOptions

    _, hf_cfg, _ = family_config("llama", num_hidden_layers=2)
    save_checkpoint(hf_model(hf_cfg), tmp_path, shards=1)
    load_family("llama").from_pretrained(str(tmp_path), dht_prefix="stop-test").save_pretrained(tmp_path)
    stop = threading.Event()
    stop.set()
    server = BlockServer(ServeOptions(model_dir=str(tmp_path), new_swarm=True, blocks=(0, 2), dtype="fp32"),
                         stop_event=stop)
    with pytest.raises(InterruptedError, match="stopped while loading"):
        server.start()
    assert server.dht is None and server.announcer is None and server.handler is None
