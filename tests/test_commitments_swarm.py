"""Weight commitments on real ``distconf serve`` processes: a client given a manifest refuses other weights.

Three servers of the same 4 blocks on 127.0.0.1: H serves the checkpoint the manifest was made
from (``distconf manifest``), L a copy whose one tensor of block 2 differs, N the honest weights
but started with ``--no-block-digests``. A client given the manifest routes through H only and
generates the local model's tokens; it names L (block 2) and N (no digests) once each at WARNING.
Without a manifest L and N are used like H (L's tokens then differ from the local model's).
An in-process server shows that a span move announces the new span's digests.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import prompts, server_info
from swarm_harness import Swarm as HarnessSwarm
from swarm_harness import swarm_fixture

from distconf.cli import main
from distconf.client.commitments import read_manifest
from distconf.dht import NoRouteError

pytestmark = pytest.mark.swarm

FAST = {"max_retries": 0, "min_backoff": 0.01, "max_backoff": 0.02}
CHANGED = "model.layers.2.mlp.down_proj.weight"


def _liar_copy(model_dir: Path, target: Path) -> Path:
    """A copy of ``model_dir`` (same config, same dht_prefix) whose tensor `CHANGED` has 20 % noise."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, target)
    tensors = load_file(target / "model.safetensors")
    assert CHANGED in tensors, sorted(tensors)
    weight = tensors[CHANGED]
    tensors[CHANGED] = weight + 0.2 * weight.abs().mean() * torch.randn(weight.shape,
                                                                         generator=torch.Generator().manual_seed(1))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


class Swarm(HarnessSwarm):
    """The harness's bootstrap DHT, the honest and the liar folders, the manifest and the three servers."""

    def build(self) -> None:
        self.model_dir, self.local = self.add_model("llama")
        self.liar_dir = _liar_copy(self.model_dir, self.root / "liar")
        self.manifest = self.root / "llama.manifest.json"
        assert main(["manifest", str(self.model_dir), "-o", str(self.manifest), "--dtype", "fp32"]) == 0
        self.start_server(self.model_dir, "0:4", log="honest.log")
        self.start_server(self.liar_dir, "0:4", log="liar.log")
        self.start_server(self.model_dir, "0:4", "--no-block-digests", log="nodigests.log")
        self.wait_ready()
        self.h, self.l, self.n = (s.peer_id for s in self.servers)

    def model(self, directory: Path | None = None, **kwargs: Any) -> Any:
        """A client model on this swarm."""
        return super().model(directory, **{**FAST, **kwargs})

    def expected(self, ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
        return super().expected(ids, max_new_tokens=6, **kwargs)


swarm = swarm_fixture("commitments", None, cls=Swarm)


def _generate(model: Any, ids: torch.Tensor) -> list[list[int]]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=6).tolist()


def _route_peers(model: Any) -> set[str]:
    return {span.peer_id for span in model.remote.manager.plan_route()}


def test_servers_announce_block_digests(swarm: Swarm) -> None:
    probe = swarm.model()
    manifest = read_manifest(swarm.manifest)
    honest, liar, plain = (server_info(probe, p) for p in (swarm.h, swarm.l, swarm.n))
    assert honest["weights_form"] == liar["weights_form"] == plain["weights_form"] == "float32"
    assert honest["block_sha256"] == list(manifest.forms["float32"])
    differ = [i for i, (a, b) in enumerate(zip(liar["block_sha256"], honest["block_sha256"])) if a != b]
    assert differ == [2]
    assert "block_sha256" not in plain


def test_a_client_with_the_manifest_routes_through_the_honest_server_only(
        swarm: Swarm, caplog: pytest.LogCaptureFixture) -> None:
    ids = prompts(batch=2, length=5, seed=1)
    with caplog.at_level(logging.WARNING, logger="distconf.client.commitments"):
        model = swarm.model(weights_manifest=str(swarm.manifest))
        for _ in range(3):
            assert _route_peers(model) == {swarm.h}
        assert _generate(model, ids) == swarm.expected(ids)
        assert _generate(model, prompts(batch=1, length=4, seed=2)) == swarm.expected(prompts(1, 4, seed=2))
    refusals = [r.getMessage() for r in caplog.records if "refusing server" in r.getMessage()]
    assert len(refusals) == 2, refusals  # each once, however many routes were planned
    (liar,) = [m for m in refusals if swarm.l in m]
    assert "block 2: its announced sha256" in liar and str(swarm.manifest) in liar
    (plain,) = [m for m in refusals if swarm.n in m]
    assert "announces no per-block weight digests" in plain
    assert set(model.remote.manager.commitments.refused) == {swarm.l, swarm.n}
    # a refused server is no spot-check checker either (checkers are chosen among usable servers)
    honest = next(s for s in model.remote.manager.state.spans if s.peer_id == swarm.h)
    assert [s.peer_id for s in model.remote.verifier.candidates(honest, set())] == [swarm.h]  # itself, no other
    others = {s.peer_id for s in model.remote.manager.state.spans} - {swarm.h}
    assert others == {swarm.l, swarm.n}  # announced, but refused: never a checker


def test_refused_servers_stay_refused_when_the_honest_one_is_left_out(swarm: Swarm) -> None:
    model = swarm.model(weights_manifest=str(swarm.manifest), blocked_servers=[swarm.h])
    with pytest.raises(NoRouteError):
        model.remote.manager.plan_route()


def test_without_a_manifest_every_server_is_used(swarm: Swarm) -> None:
    ids = prompts(batch=2, length=5, seed=1)
    for peer in (swarm.h, swarm.l, swarm.n):
        others = [p for p in (swarm.h, swarm.l, swarm.n) if p != peer]
        model = swarm.model(blocked_servers=others)
        assert _route_peers(model) == {peer}
        with torch.no_grad():
            logits, local = model(ids).logits, swarm.local(ids).logits
        difference = float((logits - local).norm() / local.norm())
        print(f"via …{peer[-6:]}: relative logit difference to the local model {difference:.2e}")
        if peer == swarm.l:  # its weights matter: the manifest is what kept it out
            assert difference > 1e-3, difference
        else:
            assert difference < 1e-5, difference
            assert _generate(model, ids) == swarm.expected(ids)


def test_a_manifest_of_another_model_is_refused_at_load(swarm: Swarm, tmp_path: Path) -> None:
    import json

    from distconf.client.commitments import ManifestError

    data = json.loads(swarm.manifest.read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "dht_prefix": "another-model"}))
    with pytest.raises(ManifestError, match=r"other\.json: it is for model 'another-model'"):
        swarm.model(weights_manifest=str(other))
    with pytest.raises(ManifestError, match="cannot be read"):
        swarm.model(weights_manifest=str(tmp_path / "missing.json"))


def test_a_span_move_announces_the_new_digests(tmp_path: Path, swarm: Swarm) -> None:
    """An in-process server of blocks 0..1 moves to 1..2: rpc_info then holds blocks 1..2's digests."""
    from hivemind.proto import runtime_pb2
    from hivemind.utils import MSGPackSerializer

    from distconf.server.block_server import BlockServer, ServeOptions
    from distconf.server.integrity import weights_digest

    manifest = read_manifest(swarm.manifest).forms["float32"]
    server = BlockServer(ServeOptions(model_dir=str(swarm.model_dir), new_swarm=True, blocks=(0, 2),
                                      dtype="float32", balance_quality=0, verify_weights=True))
    try:
        server.start()

        def info() -> dict[str, Any]:
            reply = server.rpc.run(server.handler.rpc_info(runtime_pb2.ExpertUID(uid=""), None), timeout=10)
            return MSGPackSerializer.loads(reply.serialized_info)

        assert info()["block_sha256"] == list(manifest[0:2])
        server.move_to(1)
        moved = info()
        assert (moved["start_block"], moved["end_block"]) == (1, 3)
        assert moved["block_sha256"] == list(manifest[1:3]) == server.block_sha256
        assert moved["weights_sha256"] == weights_digest(server.modules, first_block=1) == server.weights_sha256
    finally:
        server.stop()
