"""``distconf api``: an OpenAI-compatible HTTP API (and a chat page) in front of a model served by a swarm.

A `Backend` holds a distributed model (`distconf.client.AutoDistributedModelForCausalLM`)
and its tokenizer; `build_app` serves it with Starlette: ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent events
with ``stream: true``) and a chat page at ``/``. Each request runs its own inference
session (`distconf.client.textgen`) in a bounded pool of threads.

>>> model = AutoDistributedModelForCausalLM.from_pretrained("./model", initial_peers=peers)  # doctest: +SKIP
>>> app = build_app(Backend(model, tokenizer, "my-model"))                                    # doctest: +SKIP
>>> serve_forever(app, "127.0.0.1", 8000)                                                     # doctest: +SKIP
"""

from __future__ import annotations

from distconf.api.app import build_app
from distconf.api.backend import Backend
from distconf.api.protocol import ApiError, Request, parse_chat, parse_completion

__all__ = ["ApiError", "Backend", "Request", "build_app", "parse_chat", "parse_completion"]
