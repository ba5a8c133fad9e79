"""The real model (SmolLM2-135M-Instruct) through a swarm of two ``distconf serve`` processes (0:15, 15:30).

Each served configuration gets its own pair of servers, one after the other (at most two
real servers run at a time):

- ``gguf-fp32``: the GGUF file itself, ``--dtype float32``, the DHT prefix derived from it;
- ``folder-fp32``: a plain Hugging Face folder (the converted copy, no ``dht_prefix``);
- ``gguf-bf16``: ``--dtype bfloat16`` (the client in bf16 too);
- ``gguf-int8`` / ``gguf-nf4``: ``--quant int8`` / ``--quant nf4`` over fp32, with ``--dht-prefix``.

fp32 and bf16: the greedy chat answer through the client is the local transformers model's,
token for token. int8 and nf4: top-1 agreement with the local fp32 model over `FIXED_TEXT`
meets the figures `tests/test_real_model.py` measured (`real_helpers.QUALITY`: int8 >= 91 %,
nf4 >= 68 %), and the chat answer is right (int8: exactly ``ANSWER``; nf4: begins with it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from real_helpers import QUALITY, open_real_source, real_cache_dir
from swarm_harness import Swarm

from distconf.blocks.quant import petals_quant_type
from distconf.sources import ModelSource
from distconf.tools import real_model as rm
from distconf.tools.serving import ServerProcess, serve_command, stop_all, wait_all_ready

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "15:30")
START_DEADLINE = 300.0  # two real servers loading at once on a shared 2-core machine
FOLDER_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Served:
    """One served configuration: what the servers are given and how the client matches it."""

    model: str  # "gguf" or "folder"
    dtype: str = "float32"
    quant: str = "none"
    dht_prefix: str | None = None  # None: derived from the model by the family's rule

    @property
    def client_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


CONFIGS = {
    "gguf-fp32": Served("gguf"),
    "folder-fp32": Served("folder"),
    "gguf-bf16": Served("gguf", dtype="bfloat16", dht_prefix="smollm2-test-bf16"),
    "gguf-int8": Served("gguf", quant="int8", dht_prefix="smollm2-test-int8"),
    "gguf-nf4": Served("gguf", quant="nf4", dht_prefix="smollm2-test-nf4"),
}


@pytest.fixture(scope="module")
def source(request: pytest.FixtureRequest) -> ModelSource:
    return open_real_source(request.config)


@pytest.fixture(scope="module")
def tokenizer(source: ModelSource) -> Any:
    return source.load_tokenizer()


@pytest.fixture(scope="module")
def folder(source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted model copied as a plain Hugging Face folder (no dht_prefix, no cache manifest)."""
    return rm.plain_folder(source.checkpoint_dir, tmp_path_factory.mktemp("real") / FOLDER_NAME)


@pytest.fixture(scope="module")
def bootstrap() -> Any:
    with Swarm() as s:
        yield s.dht, s.peers


@pytest.fixture(scope="module")
def fp32(source: ModelSource) -> Any:
    return rm.local_model(source.checkpoint_dir)


@pytest.fixture(scope="module")
def text_ids(tokenizer: Any) -> torch.Tensor:
    return tokenizer(rm.FIXED_TEXT, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def fp32_logits(fp32: Any, text_ids: torch.Tensor) -> torch.Tensor:
    return rm.next_token_logits(fp32, text_ids)


class Pair:
    """Two servers of one configuration, and the model path the client is given."""

    def __init__(self, name: str, served: Served, model: Path, servers: list[ServerProcess]) -> None:
        self.name, self.served, self.model, self.servers = name, served, model, servers


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request: pytest.FixtureRequest, bootstrap: Any, folder: Path, source: ModelSource,
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A pair of real servers (0:15 and 15:30) of one configuration, stopped after its tests."""
    name, config = request.param, CONFIGS[request.param]
    model = rm.gguf_path() if config.model == "gguf" else folder
    _, peers = bootstrap
    extra = ["--dtype", config.dtype, "--quant", config.quant]
    if config.dht_prefix:
        extra += ["--dht-prefix", config.dht_prefix]
    logs = tmp_path_factory.mktemp(f"real-{name}")
    env = {"PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}
    servers = [ServerProcess(serve_command(model, "--initial-peers", *peers, "--blocks", span, "--host", "127.0.0.1",
                                           *extra), logs / f"server-{i}.log", name=f"{name}-{i}", env=env)
               for i, span in enumerate(SPANS)]
    wait_all_ready(servers, time.monotonic() + START_DEADLINE)
    try:
        yield Pair(name, config, model, servers)
    finally:
        stop_all(servers)


@pytest.fixture(scope="module")
def client(served: Pair, bootstrap: Any, request: pytest.FixtureRequest) -> Any:
    """The distributed model of the pair, loaded from what the servers were given (GGUF or folder)."""
    from distconf.client import AutoDistributedModelForCausalLM

    dht, _ = bootstrap
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served.model, dht=dht, dtype=served.served.client_dtype, dht_prefix=served.served.dht_prefix,
        gguf_cache_dir=real_cache_dir(request.config), max_retries=3)
    try:
        yield model
    finally:
        model.shutdown()


def test_servers_announce_what_they_serve(served: Pair, client: Any) -> None:
    assert [s.span for s in served.servers] == [(0, 15), (15, 30)]
    for server in served.servers:
        assert server.ready is not None
        assert server.ready["dht_prefix"] == client.config.dht_prefix
        assert server.ready["quant_type"] == petals_quant_type(served.served.quant)
    if served.served.dht_prefix is None:  # derived by the family's rule, by servers and client alike
        expected = "SmolLM2-135M-Instruct-Q4_1-hf" if served.served.model == "gguf" else f"{FOLDER_NAME}-hf"
        assert client.config.dht_prefix == expected


def test_chat_answer(served: Pair, client: Any, tokenizer: Any, fp32: Any, source: ModelSource) -> None:
    """fp32/bf16: token for token the local model's answer; int8: the answer; nf4: it begins right."""
    text, tokens = rm.greedy_answer(client, tokenizer)
    config = served.served
    if config.quant == "none":
        local = fp32 if config.dtype == "float32" else rm.local_model(source.checkpoint_dir, torch.bfloat16)
        assert tokens == rm.greedy_answer(local, tokenizer)[1]
        assert text == rm.ANSWER
    elif config.quant == "int8":
        assert text == rm.ANSWER
    else:
        assert text.startswith("The capital of France is Paris"), text


def test_agreement_over_the_fixed_text(served: Pair, client: Any, text_ids: torch.Tensor,
                                       fp32_logits: torch.Tensor) -> None:
    """Top-1 agreement and perplexity ratio of the swarm's forward pass against the local fp32 model."""
    config = served.served
    logits = rm.next_token_logits(client, text_ids)
    agreement = rm.agreement(fp32_logits, logits)
    ratio = rm.perplexity(logits, text_ids) / rm.perplexity(fp32_logits, text_ids)
    key = config.quant if config.quant != "none" else ("bf16" if config.dtype == "bfloat16" else None)
    least, largest = QUALITY[key] if key else (0.99, 1.001)  # fp32: the local model's own predictions
    assert agreement >= least, f"{served.name}: top-1 agreement {agreement:.3f}"
    assert 1 / largest <= ratio <= largest, f"{served.name}: perplexity ratio {ratio:.4f}"
