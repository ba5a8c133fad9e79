"""``distconf api``: serve a model of a swarm through an OpenAI-compatible HTTP API, with a chat page at ``/``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from distconf.cli.helptext import add_command, positive_int
from distconf.cli.speculation_args import add_speculation_arguments
from distconf.cli.swarm_args import add_swarm_arguments, add_verify_arguments, verify_fields

__all__ = ["API_KEY_ENV", "register", "run"]

logger = logging.getLogger(__name__)

API_KEY_ENV = "DISTCONF_API_KEY"
"""Environment variable holding the API key when ``--api-key`` is not given."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``api`` subcommand."""
    p = add_command(
        subparsers, "api", summary="an OpenAI-compatible API (and a chat page) for a model on a swarm",
        description="Load the non-block weights and the tokenizer of MODEL, join the swarm through --initial-peers "
                    "and serve OpenAI's API on http://HOST:PORT/v1: GET /v1/models, POST /v1/chat/completions "
                    "(messages through the tokenizer's chat template) and POST /v1/completions (a raw prompt), "
                    "streamed as server-sent events with \"stream\": true. Supported: max_tokens "
                    "(max_completion_tokens), temperature (0 is greedy), top_p, stop, seed, n, logprobs "
                    "(chat: logprobs and top_logprobs; completions: logprobs 0..5), stream_options.include_usage; "
                    "penalties, logit_bias, tools and echo are refused (400).\n\n"
                    "A chat page is at http://HOST:PORT/. Each request runs its own inference session; "
                    "--max-concurrent requests generate at once, later ones wait. With --api-key (or $"
                    f"{API_KEY_ENV}) every /v1 request must send 'Authorization: Bearer KEY'. Listens on "
                    "127.0.0.1 unless --host says otherwise.\n\n"
                    "A streamed chat: curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: "
                    "application/json' -d '{\"model\": \"ID\", \"stream\": true, \"messages\": [{\"role\": "
                    "\"user\", \"content\": \"Hi\"}]}' (ID: from GET /v1/models).\n\n"
                    "With --verify-fraction F the servers are spot-checked (see distconf generate --help): a "
                    "server caught computing wrong is banned, the answer keeps the honest results, the "
                    "detection is logged at WARNING and listed as JSON by GET /distconf/verification (outside "
                    "OpenAI's /v1; the API key applies), and every completion answer carries the number of "
                    "detections so far in the X-Distconf-Verification-Events header.",
        examples=[
            ("distconf api ./model --initial-peers ADDR", "serve on http://127.0.0.1:8000/v1"),
            ("distconf api ./model --initial-peers ADDR --port 8080 --api-key s3cret", "another port, a key"),
            ("DISTCONF_API_KEY=s3cret distconf api model.gguf --initial-peers ADDR", "the key from the environment"),
            ("curl http://127.0.0.1:8000/v1/models", "the model's id (for the requests' \"model\")"),
            ("distconf api ./model --initial-peers ADDR --verify-fraction 0.1", "spot-check the servers"),
            ("curl http://127.0.0.1:8000/distconf/verification", "the servers caught so far (JSON)"),
            ("distconf api ./model --initial-peers ADDR --adapters ./my-lora support=./support-lora",
             "also serve ID:./my-lora and support, each through its LoRA adapter on the servers"),
        ],
    )
    add_swarm_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; another address exposes the API to the network)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}; none if unset)")
    p.add_argument("--model-id", default=None, metavar="ID",
                   help="the model's id in the API (default: its DHT prefix)")
    p.add_argument("--max-concurrent", type=positive_int, default=8,
                   help="requests generating at once (default 8; later ones wait)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                   help="largest request body in bytes (default 1048576)")
    p.add_argument("--adapters", nargs="+", default=(), metavar="ADAPTER",
                   help="LoRA adapters the servers serve (by the names they announce), each offered as one more "
                        "model id: 'ID:ADAPTER' (ID: --model-id), or the id you give as NEW_ID=ADAPTER; requests for "
                        "different ids are batched together on the servers")
    p.add_argument("--max-retries", type=int, default=3,
                   help="retries of a failed swarm request before answering 503 (default 3)")
    add_verify_arguments(p)
    add_speculation_arguments(p)
    p.set_defaults(func=run)


def adapter_model_ids(model_id: str, arguments: Sequence[str]) -> dict[str, str]:
    """``{model id: adapter}`` of ``--adapters`` arguments: ``ID=ADAPTER``, or ``ADAPTER`` as ``MODEL_ID:ADAPTER``."""
    ids: dict[str, str] = {}
    for argument in arguments:
        new_id, sep, adapter = argument.partition("=")
        if not (sep and new_id and adapter):
            new_id, adapter = f"{model_id}:{argument}", argument
        if new_id in ids or new_id == model_id:
            raise ValueError(f"--adapters: model id {new_id!r} is given twice")
        ids[new_id] = adapter
    return ids


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve the API until interrupted; 2 for bad arguments or MODEL, 1 if the swarm fails."""
    from distconf.cli.swarm_model import CommandFailed, close_swarm_model, open_swarm_model

    if not 0 <= args.port <= 65535:
        print("distconf api: --port must be in 0..65535", file=sys.stderr)
        return 2
    if args.max_retries < 0:
        print("distconf api: --max-retries must be >= 0", file=sys.stderr)
        return 2
    try:
        model, tokenizer = open_swarm_model(args, need_tokenizer=True, max_retries=args.max_retries,
                                            **verify_fields(args))
    except CommandFailed as exc:
        print(f"distconf api: {exc}", file=sys.stderr)
        return exc.code
    from distconf.cli.swarm_model import open_speculation

    try:
        speculation = open_speculation(args, model)
    except CommandFailed as exc:
        model.shutdown()
        print(f"distconf api: {exc}", file=sys.stderr)
        return exc.code
    from distconf.api import Backend, build_app
    from distconf.api.protocol import now
    from distconf.monitor.app import LOOPBACK_HOSTS
    from distconf.monitor.serve import is_loopback, serve_forever

    model_id = args.model_id or model.config.dht_prefix
    try:
        adapters = adapter_model_ids(model_id, args.adapters)
    except ValueError as exc:
        close_swarm_model(model)
        print(f"distconf api: {exc}", file=sys.stderr)
        return 2
    backend = Backend(model, tokenizer, model_id, max_concurrent=args.max_concurrent, created=now(),
                      verification_events=model.verification_events,
                      verify_fraction=model.config.verify_fraction, speculation=speculation, adapters=adapters)
    try:
        loopback = is_loopback(args.host)
        if not loopback:
            logger.warning("listening on %s: the API is reachable from the network", args.host)
        app = build_app(backend, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        allowed_hosts=LOOPBACK_HOSTS if loopback else None, max_body_bytes=args.max_body_bytes)
        def ready(port: int) -> None:  # printed once it listens (--port 0: the port chosen)
            print(f"distconf api: serving {model_id!r} at http://{args.host}:{port}/v1 and a chat page at "
                  f"http://{args.host}:{port}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)

        # uvicorn stops gracefully on SIGTERM, then raises it again: end through the finally below
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        serve_forever(app, args.host, args.port, log_level="warning", on_ready=ready)
    finally:
        backend.shutdown()
        close_swarm_model(model)
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
