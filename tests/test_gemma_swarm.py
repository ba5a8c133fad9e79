"""The second real model, Gemma 3 270M (``gemma3_text``: sliding-window and global layers, a 262k vocabulary),
served from its GGUF by two ``distconf serve`` processes (blocks 0:9 and 9:18, float32): greedy tokens through the
swarm equal the local transformers model's, and its known continuation comes out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from real_helpers import real_cache_dir
from swarm_harness import Swarm

from distconf.sources import open_source
from distconf.tools import real_model as rm

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:9", "9:18")
START_DEADLINE = 300.0
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def gemma(request: pytest.FixtureRequest) -> Any:
    """The Gemma GGUF as a source (converted once into the real-model cache)."""
    try:
        path = rm.second_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return open_source(path, cache_dir=real_cache_dir(request.config))


@pytest.fixture(scope="module")
def swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gemma: Any
          ) -> Iterator[list[str]]:
    env = {"DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}
    with Swarm(tmp_path_factory.mktemp("gemma-swarm")) as s:
        for i, span in enumerate(SPANS):
            s.start_server(gemma.origin, span, log=f"server-{i}.log", name=f"gemma-{i}", env=env, dtype="float32")
        s.wait_ready(timeout=START_DEADLINE)
        yield s.peers


def test_gemma_through_two_servers_gives_the_local_models_greedy_tokens(gemma: Any, swarm: list[str]) -> None:
    from distconf.client import AutoDistributedModelForCausalLM

    tokenizer = gemma.load_tokenizer()
    ids = tokenizer(rm.SECOND_PROMPT, return_tensors="pt")["input_ids"]
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    local = rm.local_model(gemma.checkpoint_dir)
    with torch.no_grad():
        expected = local.generate(ids, **greedy)[0, ids.shape[1]:].tolist()
    del local
    model = AutoDistributedModelForCausalLM.from_pretrained(gemma, initial_peers=swarm, max_retries=2)
    try:
        with torch.no_grad():
            got = model.generate(ids, **greedy)[0, ids.shape[1]:].tolist()
    finally:
        model.shutdown()
    assert got == expected
    assert tokenizer.decode(got).startswith(rm.SECOND_CONTINUATION)
