"""`distconf.api` without a swarm: request checks, response shapes, errors, keys, limits, a dropped stream.

The parsing tests are pure. The HTTP tests serve the real model run locally (its own KV cache stands
for the swarm's session, counting its closes) with the real app in uvicorn, over real HTTP.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest
from dhthelpers import wait_for
from real_helpers import local_sessions
from transformers import DynamicCache

from distconf.api import ApiError, Backend, build_app, parse_chat, parse_completion
from distconf.api.app import EVENTS_HEADER
from distconf.client.verify_events import VerificationEvent
from distconf.monitor.serve import start_in_thread
from distconf.tools import real_model as rm

MODEL_ID = "smol-local"
KEY = "k3y"
EVENTS: list[VerificationEvent] = []
"""The served model's verification events (a client model appends to its list as its verifier catches servers)."""
MESSAGES = [{"role": "user", "content": rm.QUESTION}]


# ------------------------------------------------------------------ parsing


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": MESSAGES, **fields}


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 9}, "n"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"),
    ({"seed": 1.5}, "seed"), ({"stream": "yes"}, "stream"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"1": 2}}, "logit_bias"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": None}, "model"),
])
def test_a_bad_chat_parameter_is_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat(_chat(**fields))
    assert caught.value.status == 400 and caught.value.param == param
    assert set(caught.value.body["error"]) == {"message", "type", "param", "code"}


def test_chat_fields() -> None:
    r = parse_chat(_chat(temperature=0, max_completion_tokens=5, stop="\n", seed=3, n=2, stream=True,
                         stream_options={"include_usage": True}, logprobs=True, top_logprobs=3, user="u",
                         frequency_penalty=0, messages=[{"role": "developer", "content": "Be brief."},
                                                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    assert (r.max_tokens, r.n, r.stream, r.include_usage, r.logprobs) == (5, 2, True, True, True)
    assert r.sampling.temperature == 0 and r.sampling.stop == ("\n",) and r.sampling.seed == 3
    assert r.sampling.top_logprobs == 3
    assert r.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert parse_chat(_chat(top_p=0)).sampling.temperature == 0  # top_p 0: only the most likely token
    assert parse_chat(_chat()).max_tokens is None


def test_completion_fields() -> None:
    r = parse_completion({"model": MODEL_ID, "prompt": ["A cat"], "logprobs": 2})
    assert (r.prompt, r.max_tokens, r.logprobs, r.sampling.top_logprobs) == ("A cat", 16, True, 2)
    for bad, param in (({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"logprobs": 6}, "logprobs"),
                       ({"echo": True}, "echo"), ({"best_of": 2}, "best_of")):
        with pytest.raises(ApiError) as caught:
            parse_completion({"model": MODEL_ID, "prompt": "x", **bad})
        assert caught.value.param == param


# ------------------------------------------------------------------ over HTTP, the model run locally


class _CountingCache(DynamicCache):
    """A local cache with the ``close`` of a remote session; counts sessions opened and closed."""

    opened = 0
    closed = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).opened += 1

    def close(self) -> None:
        if not getattr(self, "_done", False):
            self._done = True
            type(self).closed += 1


@pytest.fixture(scope="module")
def server(real_local: Any, real_tokenizer: Any) -> Any:
    with local_sessions(real_local, _CountingCache) as model:
        backend = Backend(model, real_tokenizer, MODEL_ID, max_concurrent=2, verification_events=EVENTS,
                          verify_fraction=0.25)
        running = start_in_thread(build_app(backend, api_key=KEY, max_body_bytes=4096))
        try:
            yield running
        finally:
            running.stop()
            backend.shutdown()


def _post(server: Any, path: str, body: Any, key: str | None = KEY) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(server.url + path, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_answer_and_usage(server: Any) -> None:
    status, body = _post(server, "/v1/chat/completions", _chat(temperature=0, max_tokens=24))
    assert status == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": rm.ANSWER, "refusal": None}
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["total_tokens"] == \
        body["usage"]["prompt_tokens"] + 8


def test_stream_shape(server: Any) -> None:
    status, text = _post(server, "/v1/chat/completions", _chat(temperature=0, stream=True, max_tokens=24,
                                                               stream_options={"include_usage": True}))
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    events = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == rm.ANSWER
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1]["usage"]["completion_tokens"] == 8


def test_n_seed_stop_and_logprobs(server: Any) -> None:
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "n": 2, "seed": 5, "max_tokens": 6, "logprobs": 2}
    _, first = _post(server, "/v1/completions", body)
    _, again = _post(server, "/v1/completions", body)
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]  # seeded
    assert [c["index"] for c in first["choices"]] == [0, 1] and first["usage"]["completion_tokens"] == 12
    lp = first["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(len(t) == 2 for t in lp["top_logprobs"])
    _, cut = _post(server, "/v1/chat/completions", _chat(temperature=0, stop=["Paris"]))
    assert cut["choices"][0]["message"]["content"] == "The capital of France is "
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_errors_are_openai_shaped(server: Any) -> None:
    cases = [
        (_post(server, "/v1/chat/completions", _chat(), key="wrong"), 401, "invalid_api_key"),
        (_post(server, "/v1/chat/completions", _chat(), key=None), 401, "invalid_api_key"),
        (_post(server, "/v1/chat/completions", _chat(model="nope")), 404, "model_not_found"),
        (_post(server, "/v1/chat/completions", _chat(top_p=2)), 400, "invalid_value"),
        (_post(server, "/v1/chat/completions", b"{not json"), 400, None),
        (_post(server, "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "x" * 5000}])), 413,
         "request_too_large"),
        (_post(server, "/v1/chat/completions", _chat(max_tokens=10**6)), 400, "context_length_exceeded"),
        (_post(server, "/v1/nothing", {}), 404, None),
    ]
    for (status, body), want_status, want_code in cases:
        assert status == want_status, body
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == want_code


def test_models_and_page(server: Any) -> None:
    req = urllib.request.Request(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == MODEL_ID
    with urllib.request.urlopen(server.url + "/", timeout=10) as r:  # the page needs no key
        assert "default-src 'none'" in r.headers["Content-Security-Policy"] and b"chat.js" in r.read()


def _get(server: Any, path: str, key: str | None = KEY) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_verification_events_are_listed_and_counted(server: Any) -> None:
    """GET /distconf/verification lists the model's events; completion answers count them in a header."""
    EVENTS.clear()
    assert _get(server, "/distconf/verification") == (200, {"object": "list", "enabled": True,
                                                           "verify_fraction": 0.25, "total": 0, "data": []})
    liar = "12D3KooWGGcsZBGHa9Yej7S1Yn8dx3J55ESVKZGmXn4uxrYKbtPT"
    honest = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    EVENTS.extend([VerificationEvent(liar, 0, 15, 3, 9, float("inf"), 0.02, (honest,)),
                   VerificationEvent(liar, 15, 30, 0, 0, 0.5, 0.02, (honest,), kind="forward")])
    status, body = _get(server, "/distconf/verification")
    assert status == 200 and body["total"] == 2 and body["data"] == [e.to_dict() for e in EVENTS]
    assert body["data"][0]["difference"] == "inf" and body["data"][1]["kind"] == "forward"
    assert _get(server, "/distconf/verification?limit=1")[1]["data"] == [EVENTS[1].to_dict()]  # the latest
    assert _get(server, "/distconf/verification?limit=x")[0] == 400
    assert _get(server, "/distconf/verification", key=None)[0] == 401  # the key applies as for /v1
    for stream in (False, True):
        req = urllib.request.Request(server.url + "/v1/chat/completions",
                                     json.dumps(_chat(temperature=0, max_tokens=2, stream=stream)).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.headers[EVENTS_HEADER] == "2"
            r.read()
    EVENTS.clear()


def test_a_dropped_stream_closes_its_session(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="distconf.api.app")
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(_chat(stream=True, max_tokens=400, temperature=1.0, seed=1))
    opened = _CountingCache.opened
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.close()  # gone after the first chunk
    wait_for(lambda: _CountingCache.closed >= _CountingCache.opened, timeout=30, interval=0.02)
    assert _CountingCache.opened == opened + 1 and _CountingCache.closed == _CountingCache.opened
    line = next(r.getMessage() for r in caplog.records if "stream" in r.getMessage())
    assert "stream cancelled" in line and "status=200" in line, line
    assert int(line.split("completion_tokens=")[1].split()[0]) < 400  # cut short, not run to the end
