"""The weights digest of served blocks, and ``distconf serve --verify-weights`` on a real process.

Unit tests show what the digest sees (one ulp, a buffer, the dtype of equal bytes) on real
blocks loaded (memory-mapped) from tiny safetensors checkpoints. An in-process server shows
that a weight changed while serving is reported as an ERROR at stop. A real ``distconf serve``
process on 127.0.0.1 runs forward and backward requests, refuses a backward naming an
adapter it does not have, and at SIGTERM logs a digest equal to the one taken at load.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from blockhelpers import family_config, hf_model, save_checkpoint
from client_swarm import START_DEADLINE, ServerProcess, make_model_dir
from swarm_harness import Swarm

from distconf.server.integrity import weights_digest
from distconf.server.loading import load_blocks

LAYERS = 2
HEX = r"[0-9a-f]{64}"


def _load(model_dir: Path, dtype: torch.dtype = torch.float32, start: int = 0, end: int = LAYERS) -> list[Any]:
    from distconf.loader.auto import AutoDistributedConfig

    config = AutoDistributedConfig.from_pretrained(str(model_dir))
    return load_blocks(model_dir, config, start, end, dtype)


def _mapped_files() -> str:
    return Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""


def _bump(tensor: torch.Tensor, index: int = 0) -> None:
    """Move one element of ``tensor`` by one ulp (towards +inf), in place."""
    with torch.no_grad():
        flat = tensor.data.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=flat.dtype))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 llama checkpoint (2 blocks) with a distributed config.json."""
    directory, _ = make_model_dir(tmp_path_factory.mktemp("integrity") / "llama", "llama", layers=LAYERS)
    return directory


# ------------------------------------------------------------------ the digest


def test_digest_is_stable_and_sees_one_ulp(model_dir: Path) -> None:
    blocks = _load(model_dir)
    if _mapped_files():  # Linux: the served weights are views of the mapped checkpoint file
        assert str((model_dir / "model.safetensors").resolve()) in _mapped_files()
    assert all(not p.requires_grad for b in blocks for p in b.parameters())
    digest = weights_digest(blocks)
    assert re.fullmatch(HEX, digest)
    assert weights_digest(blocks) == digest
    changed = copy.deepcopy(blocks)  # in RAM: same contents, same digest
    assert weights_digest(changed) == digest
    name, weight = sorted(changed[1].named_parameters())[-1]
    before = weight.detach().clone()
    _bump(weight, index=weight.numel() // 2)
    assert (weight != before).sum() == 1, name
    assert weights_digest(changed) != digest
    with torch.no_grad():
        weight.copy_(before)
    assert weights_digest(changed) == digest
    assert weights_digest(blocks, first_block=1) != digest  # the block index is hashed too
    assert weights_digest(blocks[::-1]) != digest


def test_digest_sees_persistent_buffers_only(model_dir: Path) -> None:
    (block,) = _load(model_dir, end=1)
    block = copy.deepcopy(block)
    digest = weights_digest([block])
    block.register_buffer("scale", torch.ones(4))
    with_buffer = weights_digest([block])
    assert with_buffer != digest
    block.scale[2] = 2.0
    assert weights_digest([block]) not in (digest, with_buffer)
    block.register_buffer("table", torch.zeros(3), persistent=False)
    after = weights_digest([block])
    block.table[0] = 5.0  # not part of the state dict: not hashed
    assert weights_digest([block]) == after


def test_digest_differs_between_dtypes_of_equal_bytes() -> None:
    def holder(tensor: torch.Tensor) -> torch.nn.Module:
        module = torch.nn.Module()
        module.register_buffer("w", tensor)
        return module

    x = torch.randn(6, generator=torch.Generator().manual_seed(0))
    half = x.to(torch.bfloat16)
    pairs = [(x, x.view(torch.int32)), (half, half.view(torch.float16)), (half, half.view(torch.int16)),
             (x, x.view(2, 3))]  # the last: equal bytes and dtype, another shape
    for a, b in pairs:
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        assert bytes(a.untyped_storage()) == bytes(b.untyped_storage())
        assert weights_digest([holder(a)]) != weights_digest([holder(b)]), (a.dtype, b.dtype)
    assert weights_digest([holder(x.clone())]) == weights_digest([holder(x)])


def test_memory_mapped_bfloat16_block_hashes(tmp_path: Path) -> None:
    """A bfloat16 checkpoint loaded as bfloat16: the parameters are views of the mapped file."""
    from distconf.loader import load_family

    _, hf_cfg, _ = family_config("llama", num_hidden_layers=1)
    save_checkpoint(hf_model(hf_cfg).to(torch.bfloat16), tmp_path, shards=1)
    load_family("llama").from_pretrained(str(tmp_path), dht_prefix="integrity-bf16").save_pretrained(tmp_path)
    (block,) = _load(tmp_path, torch.bfloat16, end=1)
    assert {p.dtype for p in block.parameters()} == {torch.bfloat16}
    if _mapped_files():
        assert str((tmp_path / "model.safetensors").resolve()) in _mapped_files()
    digest = weights_digest([block])
    assert weights_digest([block]) == digest == weights_digest([copy.deepcopy(block)])
    changed = copy.deepcopy(block)
    weight = next(changed.parameters())
    with torch.no_grad():
        weight.data.view(torch.int16).view(-1)[0] += 1  # one bfloat16 ulp
    assert weights_digest([changed]) != digest
    with pytest.raises(ValueError, match="meta device"):
        weights_digest([torch.nn.Linear(2, 2, device="meta")])


# ------------------------------------------------------------------ an in-process server


@pytest.mark.swarm
def test_server_reports_a_changed_weight_at_stop(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hivemind.proto import runtime_pb2

    from distconf.rpc.protocol import loads_metadata
    from distconf.server.block_server import BlockServer, ServeOptions
    from distconf.server.handler import BlockHandler, HandlerSettings
    from distconf.server.memory import CacheBudget

    caplog.set_level(logging.INFO, logger="distconf.server")
    server = BlockServer(ServeOptions(model_dir=str(model_dir), new_swarm=True, blocks=(0, LAYERS), dtype="fp32",
                                      verify_weights=True))
    try:
        server.start()
        assert server.weights_sha256 == weights_digest(_load(model_dir))
        assert all(not p.requires_grad for m in server.modules for p in m.parameters())
        info = loads_metadata(asyncio.run(server.handler.rpc_info(runtime_pb2.ExpertUID(), None)).serialized_info)
        assert info["weights_sha256"] == server.weights_sha256
        plain = BlockHandler(server.handler.ordered, CacheBudget(2**20), HandlerSettings(
            dht_prefix="x", hidden_size=server.config.hidden_size, dtype=torch.float32, inference_max_length=8),
            executor=None)  # rpc_info computes nothing
        plain_info = loads_metadata(asyncio.run(plain.rpc_info(runtime_pb2.ExpertUID(), None)).serialized_info)
        assert "weights_sha256" not in plain_info
        _bump(next(server.modules[1].parameters()))
    finally:
        server.stop()
    lines = {r.getMessage(): r.levelno for r in caplog.records if "weights sha256" in r.getMessage()}
    assert f"weights sha256 of blocks 0..1 at load: {server.weights_sha256}" in lines
    (changed,) = [m for m in lines if "at stop" in m]
    assert re.fullmatch(rf"weights sha256 of blocks 0\.\.1 at stop: ({HEX}) \(CHANGED since load\)", changed)
    assert lines[changed] == logging.ERROR and server.weights_sha256 not in changed
    assert server.verify_weights() is None  # stopped: nothing left to check


# ------------------------------------------------------------------ a real ``distconf serve`` process


class Served:
    """A bootstrap DHT node on 127.0.0.1, one ``distconf serve --verify-weights`` process, an RPC loop."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        from distconf.loader.auto import AutoDistributedConfig
        from distconf.rpc import RpcLoop, chain_uid

        self.config = AutoDistributedConfig.from_pretrained(str(model_dir))
        self.uid = chain_uid(self.config.dht_prefix, 0, LAYERS)
        self.blocks = _load(model_dir)
        self.loop: Any = None
        self.server: ServerProcess | None = None
        self.swarm = Swarm(root)  # owns the node and the server
        self.dht = self.swarm.dht
        try:
            (self.server,) = self.swarm.serve([(model_dir, f"0:{LAYERS}")], "--verify-weights")
            self.peer = self.server.peer_id
            self.loop = RpcLoop(self.dht)
            self.swarm.on_close(self.loop.shutdown)
        except BaseException:
            self.close()
            raise

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.loop.run(coro, timeout=timeout)

    def sigterm_and_read(self, until: str, timeout: float = 30.0) -> tuple[int | None, str]:
        """SIGTERM the server, wait (bounded) for a line containing ``until`` and the exit; return (code, log)."""
        assert self.server is not None
        self.server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.server.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None or until in line:
                break
        try:
            code = self.server.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        drained = time.monotonic() + 5.0  # let the reader thread reach the end of the output (bounded)
        while (left := drained - time.monotonic()) > 0:
            try:
                if self.server.lines.get(timeout=min(left, 1.0)) is None:
                    break
            except queue.Empty:
                continue
        return code, self.server.log_path.read_text()  # lines are written to the log before they are queued

    def close(self) -> None:
        self.swarm.close()


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Served(model_dir, tmp_path_factory.mktemp("served"))
    try:
        yield s
    finally:
        s.close()


def _local_backward(blocks: list[Any], x: torch.Tensor, grad_out: torch.Tensor, prompts: torch.Tensor
                    ) -> list[torch.Tensor]:
    x, prompts = x.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    h = x
    for i, block in enumerate(blocks):
        pre = prompts.shape[2]
        h = torch.cat([h[:, :pre] + prompts[i], h[:, pre:]], dim=1)
        h = block(h)[0]
    return list(torch.autograd.grad(h, [x, prompts], grad_out))


def test_backward_naming_an_unknown_adapter_is_refused(served: Served) -> None:
    from hivemind.p2p import P2PHandlerError

    from distconf.rpc import call_backward

    g = torch.Generator().manual_seed(3)
    hidden = served.config.hidden_size
    x, grad_out = torch.randn(1, 3, hidden, generator=g), torch.randn(1, 3, hidden, generator=g)
    with pytest.raises(P2PHandlerError, match="adapter 'lora-x' is not served"):
        served.run(call_backward(served.loop.p2p, served.peer, served.uid, x, grad_out, timeout=20,
                                 metadata={"active_adapter": "lora-x"}))
    (grad,) = served.run(call_backward(served.loop.p2p, served.peer, served.uid, x, grad_out, timeout=20,
                                       metadata={"active_adapter": ""}))  # empty: no adapter, served
    assert grad.shape == x.shape and torch.isfinite(grad).all()


def test_weights_unchanged_after_forward_and_backward(served: Served) -> None:
    """Runs last in this module: it stops the server with SIGTERM and reads its log."""
    from distconf.rpc import call_backward, call_forward, call_info

    hidden = served.config.hidden_size
    local = weights_digest(served.blocks)
    info = served.run(call_info(served.loop.p2p, served.peer, timeout=10))
    assert info["weights_sha256"] == local
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(2, 4, hidden, generator=g)
        grad_out = torch.randn(2, 4, hidden, generator=g)
        prompts = torch.randn(LAYERS, 2, 2, hidden, generator=g)
        out = served.run(call_forward(served.loop.p2p, served.peer, served.uid, x, timeout=20))
        with torch.no_grad():
            want = x
            for block in served.blocks:
                want = block(want)[0]
        assert torch.allclose(out, want, atol=1e-4), step
        grads = served.run(call_backward(served.loop.p2p, served.peer, served.uid, x, grad_out, prompts, timeout=20))
        for got, ref in zip(grads, _local_backward(served.blocks, x, grad_out, prompts), strict=True):
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-3), step
    assert served.run(call_info(served.loop.p2p, served.peer, timeout=10))["stats"]["backward"] >= 2
    served.loop.shutdown()
    served.loop = None
    code, log = served.sigterm_and_read("at stop:", timeout=START_DEADLINE / 4)
    assert code == 0, log[-3000:]
    (loaded,) = re.findall(rf"INFO .*weights sha256 of blocks 0\.\.1 at load: ({HEX})$", log, re.MULTILINE)
    (stopped,) = re.findall(rf"INFO .*weights sha256 of blocks 0\.\.1 at stop: ({HEX}) \(unchanged\)$", log,
                            re.MULTILINE)
    assert loaded == stopped == info["weights_sha256"] == local
    assert "CHANGED" not in log
