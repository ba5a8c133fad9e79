"""A LoRA adapter for the real model (SmolLM2-135M-Instruct), trained here with ``peft``, served by two servers.

The adapter is trained for a few steps on a fixed sentence, so that it measurably changes the model's answer. Two
``distconf serve --adapters`` processes (blocks 0:15 and 15:30, float32) serve it beside the base blocks:

- greedy tokens of a session with ``adapter=`` equal the local ``peft`` model's, and a session without it, on the
  same servers at the same time, keeps the base model's tokens (the two are batched on the servers);
- ``distconf generate --adapter`` prints the adapter's answer; an adapter no server serves is one line, exit 1;
- the servers announce the adapter in their records, and a request naming another adapter is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from dhthelpers import stop_process, wait_for
from real_helpers import open_real_source, real_cache_dir
from swarm_harness import Swarm as HarnessSwarm

from distconf.tools import real_model as rm
from distconf.tools.serving import ServerProcess

pytestmark = pytest.mark.swarm


def peft() -> Any:
    """``peft``, imported at first use: it takes about 2 s, which collecting the suite need not pay."""
    import peft as module

    return module

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "15:30")
START_DEADLINE = 300.0
COMMAND_TIMEOUT = 240.0
NAME = "secret"
TEXT = "The secret word is banana. The secret word is banana. The secret word is banana."
PROMPT = "The secret word is"
NEW_TOKENS = 8


def _train(checkpoint: str, folder: Path) -> None:
    """A LoRA on q_proj and v_proj, 8 AdamW steps on `TEXT` (seeded: the same adapter every run;
    the answer turns to "banana" from the 6th)."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = rm.local_model(checkpoint).requires_grad_(False)
    tuned = peft().get_peft_model(model, peft().LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    ids = AutoTokenizer.from_pretrained(checkpoint)(TEXT, return_tensors="pt")["input_ids"]
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    tuned.train()
    for _ in range(8):
        loss = tuned(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tuned.save_pretrained(str(folder))


def _greedy(model: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The adapter's folder, the prompt's ids and the local base and ``peft`` models' greedy tokens."""
    source = open_real_source(request.config)
    folder = tmp_path_factory.mktemp("adapter") / NAME
    _train(str(source.checkpoint_dir), folder)
    tokenizer = source.load_tokenizer()
    ids = [int(i) for i in tokenizer(PROMPT)["input_ids"]]
    base = rm.local_model(source.checkpoint_dir)
    expected_base = _greedy(base, ids)
    tuned = peft().PeftModel.from_pretrained(rm.local_model(source.checkpoint_dir), str(folder)).eval()
    expected_adapter = _greedy(tuned, ids)
    assert expected_adapter != expected_base, "the adapter does not change the answer: the test would prove nothing"
    return {"folder": folder, "ids": ids, "base": expected_base, "adapter": expected_adapter,
            "tokenizer": tokenizer, "source": source}


class Swarm:
    """Two servers serving the adapter, the DHT they joined and the commands' environment."""

    def __init__(self, peers: list[str], env: dict[str, str], servers: list[ServerProcess]) -> None:
        self.peers, self.env, self.servers = peers, env, servers

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``distconf ARGS`` to its end."""
        return forkserver.run([sys.executable, "-m", "distconf", *args], timeout=COMMAND_TIMEOUT, cwd=REPO,
                              env=self.env)


@pytest.fixture(scope="module")
def swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          trained: dict[str, Any]) -> Iterator[Swarm]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}
    env.pop("DISTCONF_INITIAL_PEERS", None)
    with HarnessSwarm(tmp_path_factory.mktemp("adapter-swarm")) as s:
        for i, span in enumerate(SPANS):
            s.start_server(rm.gguf_path(), span, "--adapters", f"{NAME}={trained['folder']}", log=f"server-{i}.log",
                           name=f"adapter-{i}", env=env, dtype="float32")
        s.wait_ready(timeout=START_DEADLINE)
        yield Swarm(s.peers, env, s.servers)


@pytest.fixture(scope="module")
def model(swarm: Swarm, trained: dict[str, Any]) -> Iterator[Any]:
    from distconf.client import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(trained["source"], initial_peers=swarm.peers,
                                                            max_retries=2)
    try:
        yield model
    finally:
        model.shutdown()


def _stream(model: Any, ids: list[int], adapter: str | None) -> list[int]:
    from distconf.client.textgen import Sampling, stream_text

    sampling = Sampling(max_tokens=NEW_TOKENS, temperature=0)
    with stream_text(model, None, ids, sampling, adapter=adapter) as stream:
        return [piece.token_id for piece in stream]


def test_an_adapters_session_and_a_base_one_at_once_give_the_local_models_tokens(model: Any, swarm: Swarm,
                                                                                  trained: dict[str, Any]) -> None:
    from client_swarm import server_info

    adapters = (NAME, None, NAME, None)  # two sessions of each at once
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = _stream(model, trained["ids"], adapters[i])

    def batched_rows() -> int:
        return sum(int(server_info(model, s.peer_id)["stats"].get("batched_rows", 0)) for s in swarm.servers)

    for _ in range(5):  # batches form when sessions' steps queue together: a matter of timing
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(adapters))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [results[i] for i in range(len(adapters))] == [
            trained["adapter"] if a else trained["base"] for a in adapters]
        if batched_rows() > 0:
            break
    assert batched_rows() > 0


def test_servers_announce_the_adapter_and_refuse_another(model: Any, swarm: Swarm, trained: dict[str, Any]) -> None:
    from distconf.dht import find_block_servers

    state = find_block_servers(model.remote.swarm.dht, model.config, timeout=20)
    assert {s.peer_id: tuple(s.info.adapters) for s in state.spans} == {s.peer_id: (NAME,) for s in swarm.servers}
    with pytest.raises(Exception, match="do not serve adapter 'other'"):
        _stream(model, trained["ids"], "other")


def test_generate_with_adapter_prints_the_adapters_answer(swarm: Swarm, trained: dict[str, Any]) -> None:
    tokenizer = trained["tokenizer"]
    expected = tokenizer.decode(trained["adapter"], skip_special_tokens=True)
    done = swarm.cli("generate", str(rm.gguf_path()), PROMPT, "--initial-peers", *swarm.peers, "--adapter", NAME,
                     "--max-new-tokens", str(NEW_TOKENS))
    assert done.returncode == 0, done.stderr
    assert expected.strip() in done.stdout
    missing = swarm.cli("generate", str(rm.gguf_path()), PROMPT, "--initial-peers", *swarm.peers, "--adapter",
                        "nobody-serves-this", "--max-new-tokens", "2")
    assert missing.returncode == 1 and "do not serve adapter 'nobody-serves-this'" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_the_api_serves_the_adapter_as_a_model_id_to_the_openai_client(swarm: Swarm, trained: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    import socket

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log = tmp_path / "api.log"
    with open(log, "w") as out:
        proc = forkserver.popen([sys.executable, "-m", "distconf", "api", str(rm.gguf_path()), "--initial-peers",
                                 *swarm.peers, "--port", str(port), "--model-id", "smol", "--adapters", NAME],
                                stdout=out, stderr=out, env=swarm.env, cwd=REPO)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)

        def listed() -> list[str] | None:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return [m.id for m in client.models.list().data]
            except openai.APIConnectionError:
                return None

        assert wait_for(listed, timeout=240, interval=0.5) == ["smol", f"smol:{NAME}"]
        tokenizer = trained["tokenizer"]
        for model_id, tokens in (("smol", trained["base"]), (f"smol:{NAME}", trained["adapter"])):
            done = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
            assert done.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True), model_id
            assert done.model == model_id
        with pytest.raises(openai.NotFoundError, match="this server serves 'smol', 'smol:secret'"):
            client.completions.create(model="smol:other", prompt=PROMPT, max_tokens=2)
    finally:
        stop_process(proc)


def test_deep_prompt_tuning_through_the_adapter_equals_local_autograd(swarm: Swarm, trained: dict[str, Any]) -> None:
    """Prompts trained with an adapter active: logits and prompt gradients through the servers (forward and
    backward carry ``active_adapter``) equal the local ``peft`` model's with the same prompts."""
    from test_client_ptune import local_logits, randomize, rel_err

    from distconf.client import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(trained["source"], initial_peers=swarm.peers,
                                                            max_retries=2, tuning_mode="deep_ptune", pre_seq_len=2,
                                                            active_adapter=NAME)
    try:
        prompts = model.prompts
        randomize(prompts)
        x = torch.tensor([trained["ids"]])
        weights = torch.randn(1, x.shape[1], model.config.vocab_size, generator=torch.Generator().manual_seed(3))
        logits = model(x, use_cache=False).logits
        (logits * weights).sum().backward()
        local = peft().PeftModel.from_pretrained(rm.local_model(trained["source"].checkpoint_dir),
                                               str(trained["folder"])).eval().base_model.model
        prompt = prompts.prompt_embeddings.detach().clone().requires_grad_(True)
        deep = prompts.deep_prompt_embeddings.detach().clone().requires_grad_(True)
        expected = local_logits(local, x, prompt, deep)
        (expected * weights).sum().backward()
        assert rel_err(logits.detach(), expected.detach()) < 1e-4
        assert rel_err(prompts.deep_prompt_embeddings.grad, deep.grad) < 1e-4
        assert rel_err(prompts.prompt_embeddings.grad, prompt.grad) < 1e-4
    finally:
        model.shutdown()
