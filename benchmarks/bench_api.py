"""``distconf api`` against the Python client directly, on the real model's swarm, in one run.

Starts a bootstrap DHT node, two ``distconf serve`` processes of the real model's GGUF (fp32,
blocks 0:15 and 15:30 on 127.0.0.1) and ``distconf api`` (a subprocess, as a user runs it); this
process loads the same distributed model for the direct runs. Then, greedy, the same chat prompt:

- one stream at a time, API and direct interleaved round by round: time to first token and ms
  per token (median over rounds; per token = (last - first piece) / (pieces - 1)); the HTTP
  overhead per token as a ratio ``(api - direct) / direct`` (target <= 5 %);
- 8 concurrent streams, API and direct (8 threads on one model): aggregate tokens/s, median
  time to first token and ms per token, against one stream.

Prints only; no assertions. About 3-5 minutes on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "15:30")
PROMPT = "Write a long story about a cat who learns to sail."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def api_stream(port: int, model_id: str, tokens: int) -> tuple[float, float, int]:
    """One streamed chat through the API: (seconds to first piece, seconds per later piece, tokens)."""
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                       "temperature": 0, "max_tokens": tokens, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    times, count = [], 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            count = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
    conn.close()
    return times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1), count


def direct_stream(model: Any, tokenizer: Any, tokens: int) -> tuple[float, float, int]:
    """The same through `distconf.client.textgen` in this process."""
    from distconf.client.textgen import Sampling, chat_input_ids, stream_text

    start = time.perf_counter()
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": PROMPT}])
    stream = stream_text(model, tokenizer, ids, Sampling(max_tokens=tokens, temperature=0))
    times = [time.perf_counter() for piece in stream if piece.text]
    return times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1), stream.completion_tokens


def concurrent(fn: Any, streams: int) -> tuple[float, float, float]:
    """``streams`` runs of ``fn`` at once: (aggregate tokens/s, median s to first token, median s per token)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: fn(), range(streams)))
    wall = time.perf_counter() - start
    return (sum(r[2] for r in results) / wall, statistics.median(r[0] for r in results),
            statistics.median(r[1] for r in results))


def main() -> None:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()

    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs
    from distconf.sources import open_source
    from distconf.tools import real_model as rm
    from distconf.tools.serving import ServerProcess, serve_command, stop_all, wait_all_ready

    cache = Path(os.environ.get("DISTCONF_CACHE") or REPO / ".pytest_cache" / "d" / "distconf-real-model")
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(cache)}
    source = open_source(rm.gguf_path(), cache_dir=cache / "gguf")
    dht = start_local_dht()
    peers = visible_maddrs(dht)
    logs = Path(tempfile.mkdtemp(prefix="bench-api-"))
    servers = [ServerProcess(serve_command(rm.gguf_path(), "--initial-peers", *peers, "--blocks", span, "--host",
                                           "127.0.0.1", "--dtype", "float32"), logs / f"server-{i}.log",
                             name=f"bench-{i}", env=env) for i, span in enumerate(SPANS)]
    api = None
    model = None
    try:
        wait_all_ready(servers, time.monotonic() + 600)
        port = _free_port()
        with open(logs / "api.log", "w") as log:
            api = subprocess.Popen([sys.executable, "-m", "distconf", "api", str(rm.gguf_path()), "--initial-peers",
                                    *peers, "--port", str(port), "--max-concurrent", str(args.streams)],
                                   stdout=subprocess.DEVNULL, stderr=log, env=env)
        model = AutoDistributedModelForCausalLM.from_pretrained(rm.gguf_path(), dht=dht, gguf_cache_dir=cache / "gguf")
        tokenizer = source.load_tokenizer()
        deadline = time.monotonic() + 300
        model_id = None
        while model_id is None:
            if api.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"distconf api did not start: {(logs / 'api.log').read_text()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                model_id = json.loads(conn.getresponse().read())["data"][0]["id"]
            except OSError:
                time.sleep(0.5)
        api_stream(port, model_id, 4)  # warm-up of both paths
        direct_stream(model, tokenizer, 4)
        rows: dict[str, list[tuple[float, float, int]]] = {"api": [], "direct": []}
        for _ in range(args.rounds):
            rows["api"].append(api_stream(port, model_id, args.tokens))
            rows["direct"].append(direct_stream(model, tokenizer, args.tokens))
        print(f"one stream, {args.rounds} interleaved rounds, {args.tokens} new tokens, greedy, the real model "
              "(fp32) on 2 servers")
        print(f"{'path':<8} {'first token ms':>15} {'ms/token':>9} {'tokens/s':>9}")
        med = {}
        for name, got in rows.items():
            ttft, per = statistics.median(r[0] for r in got), statistics.median(r[1] for r in got)
            med[name] = (ttft, per)
            print(f"{name:<8} {1000 * ttft:15.1f} {1000 * per:9.2f} {1 / per:9.1f}")
        overhead = (med["api"][1] - med["direct"][1]) / med["direct"][1]
        print(f"HTTP overhead per token: {100 * overhead:+.1f} % (target <= 5 %); first token: "
              f"{1000 * (med['api'][0] - med['direct'][0]):+.1f} ms")
        print(f"\n{args.streams} concurrent streams")
        print(f"{'path':<8} {'agg tokens/s':>13} {'x one stream':>13} {'first token ms':>15} {'ms/token':>9}")
        for name, fn in (("api", lambda: api_stream(port, model_id, args.tokens)),
                         ("direct", lambda: direct_stream(model, tokenizer, args.tokens))):
            rate, ttft, per = concurrent(fn, args.streams)
            print(f"{name:<8} {rate:13.1f} {rate * med[name][1]:13.2f} {1000 * ttft:15.1f} {1000 * per:9.2f}")
        print(f"\nuptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    finally:
        if api is not None:
            api.terminate()
            try:
                api.wait(30)
            except subprocess.TimeoutExpired:
                api.kill()
        if model is not None:
            model.shutdown()
        stop_all(servers)
        release_dht(dht)


if __name__ == "__main__":
    main()
