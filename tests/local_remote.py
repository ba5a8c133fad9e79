"""`LocalRemote`: stands for the client's `RemoteSequential` by running the blocks in this process.

With it a client model (`distconf.client.model.build_model`) runs without a swarm: its own
model-level modules (embeddings, the hidden state's streams and carried values, the final
norm and LM head) against the family's blocks, as the servers would run them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


class LocalRemote(torch.nn.Module):
    """Runs the blocks in process: forward, and inference sessions keeping each block's cache."""

    def __init__(self, blocks: list[Any]) -> None:
        super().__init__()
        self.blocks = blocks
        self.inputs: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, prompts: Any = None) -> torch.Tensor:
        self.inputs.append(hidden)
        for block in self.blocks:
            hidden = block(hidden)[0]
        return hidden

    def inference_session(self, max_length: int) -> Any:
        remote = self

        class _Session:
            def __init__(self) -> None:
                self.position = 0
                self.caches: list[Any] = [None] * len(remote.blocks)
                self.history: list[torch.Tensor] = []

            def step(self, hidden: torch.Tensor, hypo_ids: Any = None, prompts: Any = None) -> torch.Tensor:
                assert hypo_ids is None
                remote.inputs.append(hidden)
                self.history.append(hidden)
                for i, block in enumerate(remote.blocks):
                    hidden, self.caches[i] = block(hidden, layer_past=self.caches[i], use_cache=True)
                self.position += hidden.shape[1]
                return hidden

            def rewind(self, position: int) -> None:
                """Back to ``position``: the blocks' caches are rebuilt from the inputs kept (a server cuts its
                K/V instead; the result is the same)."""
                if position == self.position:
                    return
                kept = torch.cat(self.history, dim=1)[:, :position]
                self.caches = [None] * len(remote.blocks)
                self.history, self.position = [], 0
                if position:
                    self.step(kept)

            def close(self) -> None:
                pass

        return _Session()


def local_client_model(model_dir: Path) -> tuple[Any, LocalRemote]:
    """The client model of the distributed checkpoint in ``model_dir``, its blocks run here by a `LocalRemote`."""
    from distconf.blocks.checkpoint import Checkpoint
    from distconf.blocks.weights import load_block
    from distconf.client.model import build_model
    from distconf.loader.auto import AutoDistributedConfig
    from distconf.loader.naming import config_num_blocks

    config = AutoDistributedConfig.from_pretrained(str(model_dir))
    num_blocks = config_num_blocks(config)
    swarm = SimpleNamespace(num_blocks=num_blocks, dht_prefix=config.dht_prefix)
    with Checkpoint(model_dir) as checkpoint:
        model = build_model(config, checkpoint, swarm, torch.float32)  # type: ignore[arg-type]
    remote = LocalRemote([load_block(model_dir, config, i, dtype=torch.float32) for i in range(num_blocks)])
    model.remote_layers.remote = remote
    return model, remote
