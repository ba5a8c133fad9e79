"""Helpers for the client tests: tiny model folders and real ``distconf serve`` processes on 127.0.0.1.

The processes are `distconf.tools.serving.ServerProcess` (the product's one harness); a test's swarm
(DHT node, servers, client models, teardown) is `swarm_harness.Swarm`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from blockhelpers import family_config, hf_model

from distconf.tools.serving import ServerProcess, serve_command

REPO = Path(__file__).resolve().parents[1]
START_DEADLINE = 120.0


def make_model_dir(directory: Path, family: str, *, layers: int = 4, seed: int = 0, noise: float = 0.3,
                   variant: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """A tiny float32 model of ``family`` saved as safetensors with a distributed config.json.

    ``overrides`` replace values of the tiny config (e.g. a hybrid's ``layer_types``).

    Returns the folder and the local Hugging Face model (the reference). ``noise`` is
    added to every weight so that greedy generation does not settle on one token.
    """
    from distconf.loader.auto import AutoDistributedConfig

    _, hf_config, _ = family_config(family, variant, **{"num_hidden_layers": layers, **overrides})
    model = hf_model(hf_config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    prefix = f"test-{family}-{seed}-{directory.name}".replace("_", "-")
    config = AutoDistributedConfig.from_pretrained(str(directory), dht_prefix=prefix)
    config.save_pretrained(directory)
    return directory, model


def start_server(model_dir: Path, peers: list[str], blocks: str, log: Path, *extra: str) -> ServerProcess:
    """A ``distconf serve`` process serving ``blocks`` ("A:B") of ``model_dir`` (float32, 127.0.0.1)."""
    cmd = serve_command(model_dir, "--initial-peers", *peers, "--blocks", blocks, "--dtype", "fp32",
                        "--host", "127.0.0.1", *extra)
    return ServerProcess(cmd, log, name=model_dir.name, env={"PYTHONPATH": str(REPO)})


def server_info(model: Any, peer_id: str) -> dict[str, Any]:
    """``rpc_info`` of a server, through the model's swarm connection."""
    from distconf.rpc.calls import call_info

    swarm = model.remote.swarm
    return swarm.run(call_info(swarm.p2p, peer_id, timeout=10.0), timeout=15.0)


def prompts(batch: int = 2, length: int = 5, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    """Random prompts of equal length."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
