"""Concurrent sessions on real ``distconf serve`` processes: batched on the servers, exact for each.

Two servers (blocks 0:2 and 2:4 of a tiny model) and five client sessions generating at
once from threads (prompts of different lengths, one with two rows, different numbers of
new tokens, so sessions join and leave the servers' batches): every session's greedy
tokens equal the local model's, the servers did compute rows of several sessions together,
and their cache budgets are full again afterwards.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from client_swarm import prompts, server_info
from swarm_harness import Swarm

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with Swarm(tmp_path_factory.mktemp("batching-swarm"), "llama", ("0:2", "2:4")) as s:
        yield s.dht, s.model_dir, s.local, s.servers, s.models


ROUNDS = 3


def run_round(models: list[Any], jobs: list[tuple[torch.Tensor, int]], local: Any) -> None:
    """Every job's generation at once (one thread each); each equals the local model's."""
    results: list[Any] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        ids, new = jobs[i]
        start.wait(timeout=60)
        try:
            with torch.no_grad():
                results[i] = models[i].generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                                max_new_tokens=new).tolist()
        except Exception as exc:  # reported below, with the session it belongs to
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for (ids, new), got in zip(jobs, results, strict=True):
        with torch.no_grad():
            expected = local.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                      max_new_tokens=new).tolist()
        assert got == expected


def test_concurrent_sessions_are_batched_and_exact(swarm: Any) -> None:
    from distconf.client import AutoDistributedModelForCausalLM

    dht, model_dir, local, servers, models = swarm
    jobs = [(prompts(1, 3 + i, seed=i), 6 + 3 * i) for i in range(4)] + [(prompts(2, 4, seed=9), 10)]
    for _ in jobs:
        models.append(AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, max_retries=3))
    budgets = {s.peer_id: server_info(models[0], s.peer_id)["cache_tokens_available"] for s in servers}
    for _ in range(ROUNDS):  # steps overlap by timing: on a loaded machine a round may batch nothing on a server
        run_round(models, jobs, local)
        stats = [server_info(models[0], s.peer_id) for s in servers]
        if all(info["stats"].get("batched_rows", 0) > 0 for info in stats):
            break
    assert all(info["stats"].get("batched_rows", 0) > 0 for info in stats), [i["stats"] for i in stats]
    assert {s.peer_id: i["cache_tokens_available"] for s, i in zip(servers, stats)} == budgets
