"""Generation through real ``distconf serve`` processes equals the local Hugging Face model, token for token.

Each family's tiny model (real weights, float32) is split over two server processes on
127.0.0.1; greedy generation of 16 new tokens for a batch of two equal-length prompts,
beam search and sampling (same seed) must give exactly the local model's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import prompts
from swarm_harness import Swarm, swarm_fixture

from distconf.tools.serving import stop_all

GROUPS = [("bloom", "llama"), ("falcon", "mixtral"), ("qwen3", "gemma2"), ("deepseek_v2",)]
FAMILIES = [family for group in GROUPS for family in group]


class _Swarms(Swarm):
    """One swarm at a time: the group of the family asked for (the previous group is stopped)."""

    def __init__(self, root: Path, *_: Any) -> None:
        super().__init__(root)
        self.group: tuple[str, ...] = ()
        self.folders: dict[str, tuple[Path, Any]] = {}

    def get(self, family: str) -> tuple[Any, Path, Any]:
        if family not in self.group:
            stop_all(self.servers)
            self.servers, self.folders = [], {}
            self.group = next(g for g in GROUPS if family in g)
            for name in self.group:
                self.folders[name] = self.add_model(name)
            self.serve([(self.folders[name][0], span) for name in self.group for span in ("0:2", "2:4")])
        return self.dht, *self.folders[family]


swarms = swarm_fixture("swarm", None, cls=_Swarms)
"""Servers for one group of families at a time (two per family: blocks 0:2 and 2:4), one DHT."""


def _remote(dht: Any, model_dir: Path, **kwargs: Any) -> Any:
    from distconf.client import AutoDistributedModelForCausalLM

    kwargs.setdefault("max_retries", 2)  # every wait bounded
    return AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, **kwargs)


def _generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_beam_match_local(swarms: Any, family: str, request: Any) -> None:
    dht, model_dir, local = swarms.get(family)
    remote = _remote(dht, model_dir)
    request.addfinalizer(remote.shutdown)
    ids = prompts(2, 5, local.config.vocab_size, seed=len(family))
    greedy = _generate(remote, ids, max_new_tokens=16, do_sample=False)
    expected = _generate(local, ids, max_new_tokens=16, do_sample=False)
    assert greedy.shape == (2, 21)
    assert greedy.tolist() == expected.tolist()
    assert len({t for row in greedy[:, 5:].tolist() for t in row}) > 1  # not one repeated token

    beams = _generate(remote, ids, max_new_tokens=6, do_sample=False, num_beams=3)
    assert beams.tolist() == _generate(local, ids, max_new_tokens=6, do_sample=False, num_beams=3).tolist()

    torch.manual_seed(1)
    sampled = _generate(remote, ids, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(1)
    assert sampled.tolist() == _generate(local, ids, max_new_tokens=8, do_sample=True, top_k=20).tolist()

    with torch.no_grad():  # a plain forward (no session) goes through rpc_forward
        assert torch.allclose(remote(ids).logits, local(ids).logits, atol=1e-4, rtol=1e-4)
