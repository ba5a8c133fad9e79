"""``distconf api`` on a real swarm serving the real model (SmolLM2-135M-Instruct), through real clients.

One swarm for the module: a bootstrap DHT node, two ``distconf serve`` processes of the GGUF in
fp32 (blocks 0:15 and 15:30) and ``distconf api`` as a user runs it (a subprocess, with an API key).
The official ``openai`` package, ``curl -N`` and a headless Chromium talk to it:

- temperature 0 gives exactly the local transformers model's greedy text, non-streaming and
  streaming (joined deltas), chat and completions; 4 concurrent streaming chats are each exact;
- 6 streams dropped after their first chunk leave both servers' cache budgets full again, and a
  following chat is still exact;
- ``curl -N`` sees ``data:`` lines ending with ``data: [DONE]``;
- errors: a bad parameter 400 (named), an unknown model 404, a bad key 401, and a model no server
  holds 503 with the reason (an in-process app on the same swarm);
- the chat page: a typed question gets the streamed answer, with no console error.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import forkserver
import pytest
from dhthelpers import wait_for, wait_until
from real_helpers import open_real_source, real_cache_dir
from swarm_harness import Swarm as HarnessSwarm
from test_monitor_browser import CHROMIUM, browser  # noqa: F401  (the fixture: a headless Chromium)

from distconf.tools import real_model as rm
from distconf.tools.serving import ServerProcess

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "15:30")
START_DEADLINE = 300.0  # two real servers loading at once on a shared 2-core machine
KEY = "test-key-123"
QUESTIONS = (rm.QUESTION, "Name a primary color.", "What is 2 plus 2?", "Say hello in French.")


class Api:
    """The running ``distconf api``: its URL, model id, log, the swarm's servers and DHT node."""

    def __init__(self, url: str, model_id: str, log: Path, servers: list[ServerProcess], dht: Any) -> None:
        self.url, self.model_id, self.log, self.servers, self.dht = url, model_id, log, servers, dht

    def openai(self, key: str = KEY) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, timeout=120.0, max_retries=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, key: str | None = KEY) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    open_real_source(request.config)  # converted once, before the servers need it
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}
    env.pop("DISTCONF_INITIAL_PEERS", None)
    proc = None
    logs = tmp_path_factory.mktemp("api-swarm")
    swarm = HarnessSwarm(logs)
    try:
        peers, dht = swarm.peers, swarm.dht
        servers = [swarm.start_server(rm.gguf_path(), span, log=f"server-{i}.log", name=f"api-{i}", env=env,
                                      dtype="float32") for i, span in enumerate(SPANS)]
        swarm.wait_ready(timeout=START_DEADLINE)
        port = _free_port()
        log = logs / "api.log"
        with open(log, "w") as out:
            proc = forkserver.popen([sys.executable, "-m", "distconf", "api", str(rm.gguf_path()), "--initial-peers",
                                     *peers, "--port", str(port), "--api-key", KEY], stdout=out, stderr=out,
                                    env=env, cwd=REPO)
        url = f"http://127.0.0.1:{port}"

        def models() -> Any:
            assert proc.poll() is None, f"distconf api exited {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                status, body = _get(url + "/v1/models")
            except OSError:
                return None
            return body if status == 200 else None

        body = wait_for(models, timeout=240, interval=0.2)
        assert body, f"distconf api did not start: {log.read_text()[-3000:]}"
        yield Api(url, body["data"][0]["id"], log, servers, dht)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        swarm.close()


@pytest.fixture(scope="module")
def local(real_local: Any, real_tokenizer: Any) -> tuple[Any, Any]:
    return real_local, real_tokenizer


def _greedy(local: tuple[Any, Any], question: str | None = None, prompt: str | None = None, n: int = 24) -> str:
    """The local transformers model's greedy text (a chat answer to ``question``, or a completion of ``prompt``)."""
    import torch

    model, tokenizer = local
    ids = rm.chat_ids(tokenizer, question) if question else tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _chat_stream(api: Api, question: str, n: int = 24) -> str:
    stream = api.openai().chat.completions.create(model=api.model_id, messages=[{"role": "user", "content": question}],
                                                  temperature=0, max_tokens=n, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_openai_chat_is_the_local_greedy_text(api: Api, local: tuple[Any, Any]) -> None:
    client = api.openai()
    assert [m.id for m in client.models.list()] == [api.model_id]
    reply = client.chat.completions.create(model=api.model_id, messages=[{"role": "user", "content": rm.QUESTION}],
                                           temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == _greedy(local, rm.QUESTION) == rm.ANSWER
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 8
    assert _chat_stream(api, rm.QUESTION) == rm.ANSWER
    text = _greedy(local, prompt="A cat sat", n=12)
    done = client.completions.create(model=api.model_id, prompt="A cat sat", temperature=0, max_tokens=12)
    assert done.choices[0].text == text and done.choices[0].finish_reason == "length"
    pieces = client.completions.create(model=api.model_id, prompt="A cat sat", temperature=0, max_tokens=12,
                                       stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == text
    log = api.log.read_text()
    assert f"POST /v1/chat/completions model={api.model_id} prompt_tokens=" in log and "status=200" in log


def test_four_concurrent_streaming_chats_are_each_exact(api: Api, local: tuple[Any, Any]) -> None:
    expected = [_greedy(local, q) for q in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda q: _chat_stream(api, q), QUESTIONS))
    assert got == expected


def _cache_left(api: Api, model: Any) -> dict[str, int]:
    from distconf.rpc import CACHE_TOKENS_AVAILABLE
    from distconf.rpc.calls import call_info

    swarm = model.remote.swarm
    return {s.peer_id: swarm.run(call_info(swarm.p2p, s.peer_id, timeout=10.0), timeout=15.0)[CACHE_TOKENS_AVAILABLE]
            for s in api.servers}


@pytest.fixture(scope="module")
def nowhere(api: Api, request: pytest.FixtureRequest) -> Iterator[Any]:
    """An in-process API for the same model under a DHT prefix no server holds (and its model)."""
    from distconf.api import Backend, build_app
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.monitor.serve import start_in_thread

    model = AutoDistributedModelForCausalLM.from_pretrained(
        rm.gguf_path(), dht=api.dht, dht_prefix="nobody-serves-this-hf", gguf_cache_dir=real_cache_dir(request.config),
        max_retries=0)
    source = open_real_source(request.config)
    running = start_in_thread(build_app(Backend(model, source.load_tokenizer(), "nowhere")))
    try:
        yield running, model
    finally:
        running.stop()
        model.shutdown()


def test_dropped_streams_free_the_servers_cache(api: Api, nowhere: Any, local: tuple[Any, Any]) -> None:
    _, model = nowhere
    full = _cache_left(api, model)
    host, port = api.url.removeprefix("http://").split(":")
    body = json.dumps({"model": api.model_id, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "stream": True, "max_tokens": 500})

    def drop_after_first_chunk(_: int) -> bytes:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        line = response.readline()
        conn.close()
        return line

    with ThreadPoolExecutor(6) as pool:
        firsts = list(pool.map(drop_after_first_chunk, range(6)))
    assert all(line.startswith(b"data: {") for line in firsts)
    assert wait_until(lambda: _cache_left(api, model), lambda left: left == full, timeout=60, interval=0.2) == full
    assert api.log.read_text().count("stream cancelled") >= 6
    assert _chat_stream(api, rm.QUESTION) == _greedy(local, rm.QUESTION)


def test_curl_sees_server_sent_events(api: Api) -> None:
    body = json.dumps({"model": api.model_id, "stream": True, "temperature": 0, "max_tokens": 8,
                       "messages": [{"role": "user", "content": rm.QUESTION}]})
    out = subprocess.run(["curl", "-sN", "--max-time", "120", f"{api.url}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}", "-d", body],
                         capture_output=True, text=True, timeout=150, check=True).stdout
    lines = [line for line in out.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == rm.ANSWER
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_errors(api: Api, nowhere: Any) -> None:
    import openai

    client = api.openai()
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=api.model_id, messages=messages, temperature=7)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=messages)
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        api.openai(key="wrong").chat.completions.create(model=api.model_id, messages=messages)
    running, _ = nowhere
    import openai as oa

    far = oa.OpenAI(base_url=running.url + "/v1", api_key="none", timeout=120.0, max_retries=0)
    with pytest.raises(oa.InternalServerError) as no_route:
        far.chat.completions.create(model="nowhere", messages=messages, stream=True)
    assert no_route.value.status_code == 503
    assert "nobody-serves-this-hf" in no_route.value.message and "Traceback" not in no_route.value.message


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium: apt-get install -y chromium")
def test_chat_page_in_chromium(api: Api, request: pytest.FixtureRequest) -> None:
    tools = request.getfixturevalue("browser")
    tools.call("Page.navigate", url=api.url + "/")
    status = "(document.getElementById('status') || {}).textContent || ''"  # '' until the page has loaded
    assert wait_for(lambda: "Incorrect API key" in tools.evaluate(status), timeout=30)  # the key is asked for
    tools.evaluate(f"document.getElementById('api-key').value = {json.dumps(KEY)};"
                   "document.getElementById('api-key').dispatchEvent(new Event('change'))")
    assert wait_for(lambda: tools.evaluate("(document.getElementById('model') || {}).textContent") == api.model_id,
                    timeout=30)
    tools.evaluate(f"document.getElementById('input').value = {json.dumps(rm.QUESTION)};"
                   "document.getElementById('form').requestSubmit()")
    done = "(() => { const a = document.querySelector('li.assistant'); return a && a.dataset.done === '1'; })()"
    assert wait_for(lambda: tools.evaluate(done), timeout=120)
    assert tools.evaluate("document.querySelector('li.user').textContent") == rm.QUESTION
    assert tools.evaluate("document.querySelector('li.assistant').textContent") == rm.ANSWER
    assert tools.evaluate("document.querySelector('li.assistant').dataset.finish") == "stop"
    tools.poll(0.5)
    assert [e for e in tools.errors() if "401" not in e] == []  # the first model list, before the key, is a 401
