"""A three-server swarm of one tiny family (server A holds blocks 0:2, servers B and C hold 2:4), for the
swarm tests of families whose blocks keep a per-sequence state (pure state-space and hybrid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from client_swarm import make_model_dir, server_info, start_servers


class SpanSwarm:
    """The bootstrap DHT, the model folder, the local reference model and the three servers."""

    def __init__(self, root: Path, family: str, **overrides: Any) -> None:
        from distconf.dht import start_local_dht, visible_maddrs

        self.dht = start_local_dht()
        self.peers = visible_maddrs(self.dht)
        self.model_dir, self.local = make_model_dir(root / family, family, **overrides)
        self.servers = start_servers([(self.model_dir, "0:2"), (self.model_dir, "2:4"), (self.model_dir, "2:4")],
                                     self.peers, root)
        self.models: list[Any] = []

    def model(self, **kwargs: Any) -> Any:
        """A client model over this swarm (closed with the swarm)."""
        from distconf.client import AutoDistributedModelForCausalLM

        kwargs.setdefault("max_retries", 3)
        model = AutoDistributedModelForCausalLM.from_pretrained(self.model_dir, dht=self.dht, **kwargs)
        self.models.append(model)
        return model

    def expected(self, ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
        """What the local transformers model generates."""
        return generate(self.local, ids, **kwargs)


def generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
    """``model.generate`` on unpadded rows, as token lists."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs).tolist()


def cache_left(model: Any, peer: str) -> int:
    """The cache tokens a server says it has left."""
    from distconf.rpc.protocol import CACHE_TOKENS_AVAILABLE

    return int(server_info(model, peer)[CACHE_TOKENS_AVAILABLE])
