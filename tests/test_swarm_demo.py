"""The local swarm demo end to end, and `distconf swarm` / `distconf plan` on live data."""

from __future__ import annotations

import json
import os
import re
import sys
from types import SimpleNamespace

import forkserver
import pytest
from real_helpers import real_cache_dir
from swarm_harness import Swarm

from distconf.blocks.quant import nf4_cpu_packed
from distconf.dht import ServerInfo, ServerState, announce_blocks


@pytest.mark.swarm
def test_swarm_demo_runs_end_to_end(tmp_path, request):
    """Block servers in separate processes place themselves and load real weights; a client routes, then
    generates through them while one is stopped, and gets exactly the local model's tokens; then it trains deep
    prompts through the swarm (the loss at least halves) and every server's weights are unchanged at stop.
    The real models, each served from its GGUF by two more servers, answer through the swarm exactly as the local
    transformers model does: SmolLM2 the chat question, Gemma 3 270M a raw prompt."""
    summary_path = tmp_path / "summary.json"
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {**os.environ, "DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}  # the real tests' copy
    # forked, as are its seven servers, from this worker's preloaded interpreter (tests/forkserver.py)
    proc = forkserver.run([sys.executable, "-m", "distconf.tools.demo", "--timeout", "600", "--workdir", str(workdir),
                           "--json", str(summary_path)], timeout=720, env=env, fork_servers=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] is True and summary["clean_stop"] is True and summary["exit_codes"] == [0] * 7
    gemma = summary["real_models"][1]
    assert gemma["model"] == "Gemma 3 270M" and gemma["identical"] is True and gemma["spans"] == [[0, 9], [9, 18]]
    assert gemma["swarm_answer"].startswith(" the capital of the country of France."), gemma
    real = summary["real_model"]
    assert real["swarm_tokens"] == real["local_tokens"] and real["identical"] is True, real
    assert real["swarm_answer"] == real["local_answer"] == real["known_answer"] == "The capital of France is Paris."
    assert real["spans"] == [[0, 15], [15, 30]] and real["dht_prefix"] == "SmolLM2-135M-Instruct-Q4_1-hf"
    assert summary["generation"]["identical"] and summary["generation"]["failed_over"]
    assert summary["tuning"]["halved"] and summary["weights_unchanged"] == [3, 3]
    out = proc.stdout
    spans = re.findall(r"^  (server-\d): blocks (\d)\.\.(\d), ([\d,]+) parameters loaded", out, re.M)
    assert [s[:3] for s in spans[:2]] == [("server-1", "0", "3"), ("server-2", "4", "7")]
    assert spans[2][0] == "server-3" and spans[2][1:3] in (("0", "3"), ("4", "7")) and "(a spare)" in out
    assert "ONLINE" in out and int(spans[0][3].replace(",", "")) > 0
    assert "knows only 'distconf-demo-tiny-" in out
    assert "full route in 2 hop(s)" in out

    local = re.search(r"^  local HF model: +([\d ]+)$", out, re.M).group(1).split()
    remote = re.search(r"^  through the swarm: ([\d ]+)$", out, re.M).group(1).split()
    assert len(local) == 16 and remote == local and len(set(local)) > 1
    assert "  identical: yes: the servers computed exactly what the local model does, across a failover" in out
    stopped = re.search(r"stopped (server-\d) \(blocks (\d\.\.\d)\): exit 0, announced OFFLINE", out)
    replaced = re.search(r"the client banned (server-\d) and replayed the session to (server-\d) "
                         r"\(blocks (\d\.\.\d)\)$", out, re.M)
    assert stopped and replaced, out
    assert replaced.group(1) == stopped.group(1) != replaced.group(2) and replaced.group(3) == stopped.group(2)
    assert "leaves too (exit 0, announced OFFLINE); the client sees:\n  no full route: no online or joining server " \
        "covers block" in out
    tuned = re.search(r"^  loss: ([\d.]+) -> ([\d.]+) \(([\d.]+)x\)", out, re.M)
    assert tuned and float(tuned.group(2)) <= 0.5 * float(tuned.group(1)), out
    assert re.search(r"^  next token after the prompt: \d+ before, \d+ after$", out, re.M), out
    assert "trainable on the client: 2,304 prompt values (no block weight is local)" in out
    assert "stopped 3 tiny-model servers and 4 real-model servers (cleanly)" in out
    assert "server weights unchanged (sha256 at load = at stop): 3 of 3 servers" in out
    assert "  through the swarm:        'The capital of France is Paris.'" in out  # what the user reads
    assert len(list(workdir.glob("distconf-demo-tiny-*/model.safetensors"))) == 1


def test_demo_chooses_a_replaceable_server():
    """The server stopped mid-generation is one whose blocks other servers hold; the placement makes one."""
    from distconf.planning import choose_blocks
    from distconf.tools.demo.generation import replaceable_server
    from distconf.tools.demo.tiny_model import DEMO_LAYERS, blocks_per_server

    spans = {"a": (0, 4), "b": (4, 8), "c": (4, 8)}
    assert replaceable_server([("a", 0, 4), ("c", 4, 8)], spans) == "c"
    assert replaceable_server([("a", 0, 4), ("b", 4, 8)], {"a": (0, 4), "b": (4, 8)}) is None
    assert replaceable_server([("a", 0, 4), ("b", 4, 8)], {**spans, "d": (0, 2), "e": (2, 4)}) == "b"
    assert replaceable_server([("a", 0, 4), ("b", 4, 8)], {"a": (0, 4), "b": (4, 8), "d": (0, 3)}) is None

    # three servers in turn, each on the weakest window: the third lands on a covered span (a spare)
    config = SimpleNamespace(num_hidden_layers=DEMO_LAYERS)
    n = blocks_per_server(3)
    throughputs = [0.0] * DEMO_LAYERS
    placed = []
    for speed in (5.0, 3.0, 4.0):
        start, end = choose_blocks(config, n, throughputs)
        placed.append((start, end))
        throughputs[start:end] = [t + speed for t in throughputs[start:end]]
    assert placed == [(0, 4), (4, 8), (4, 8)]
    assert replaceable_server([("s1", 0, 4), ("s3", 4, 8)], dict(zip(("s1", "s2", "s3"), placed))) == "s3"


@pytest.fixture(scope="module")
def live_swarm():
    with Swarm() as s:
        boot, peers = s.dht, s.peers
        server = s.node()
        cfg = SimpleNamespace(dht_prefix="cli-test-model", num_hidden_layers=6, update_period=60.0)
        announce_blocks(server, cfg, 0, 4, ServerInfo(state=ServerState.ONLINE, throughput=3.0, public_name="s1",
                                                       cache_tokens_left=1024))
        announce_blocks(boot, cfg, 4, 6, ServerInfo(state=ServerState.JOINING, throughput=1.0))
        yield SimpleNamespace(peers=peers, server=server)


def run_cli(capsys, *args: str) -> SimpleNamespace:
    from distconf.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def test_swarm_command_shows_coverage_and_route(live_swarm, capsys):
    args = ("swarm", "--initial-peers", *live_swarm.peers, "--model", "cli-test-model")
    proc = run_cli(capsys, *args, "--json")
    assert proc.returncode == 1, proc.stderr  # clients route through ONLINE servers only; block 4.. is JOINING
    report = json.loads(proc.stdout)
    assert report["dht_prefix"] == "cli-test-model" and report["num_blocks"] == 6
    assert sorted((s["start"], s["end"], s["state"], s["cache_tokens_left"]) for s in report["spans"]) == [
        (0, 4, "online", 1024), (4, 6, "joining", None)]
    assert report["route_exists"] is False and report["skipped_records"] == report["failed_blocks"] == 0
    proc = run_cli(capsys, *args, "--include-joining", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["route_exists"] is True
    proc = run_cli(capsys, *args, "--online-only", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["route_exists"] is False
    # the human form: the coverage bar per state, and the hint to count joining servers
    proc = run_cli(capsys, *args)
    assert proc.returncode == 1 and "OOOO.." in proc.stdout and "....JJ" in proc.stdout
    assert "see --include-joining" in proc.stdout
    proc = run_cli(capsys, *args, "--online-only")
    assert proc.returncode == 1 and "see --include-joining" not in proc.stdout


def test_swarm_command_needs_peers_and_a_listed_model(live_swarm, monkeypatch, capsys):
    monkeypatch.delenv("DISTCONF_INITIAL_PEERS", raising=False)
    proc = run_cli(capsys, "swarm", "--model", "x")
    assert proc.returncode == 2 and "no default swarm" in proc.stderr
    proc = run_cli(capsys, "swarm", "--initial-peers", *live_swarm.peers, "--model", "unknown-model")
    assert proc.returncode == 1 and "lists no model 'unknown-model'" in proc.stderr


def test_plan_command_side_by_side(capsys, tmp_path):
    from distconf import load_preset
    from distconf.cli import main

    # a local model directory of a family whose file records Petals 2.x's fixed KV groups (1)
    load_preset("mistralai/Mixtral-8x7B-v0.1").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--memory", "24GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["num_blocks"], plan["petals_num_blocks"], plan["max_blocks"]) == (8, 7, 32)
    assert plan["petals_kv_groups"] == 1 and plan["petals_over_reservation"] == 4.0
    assert main(["plan", str(tmp_path), "--memory", "24GiB"]) == 0  # the human table says the same
    out = capsys.readouterr().out
    assert "8 / 32" in out and "7 / 32" in out and "reserves 4.00x the cache" in out
    assert main(["plan", "meta-llama/Llama-2-70b-hf", "--memory", "24GiB", "--quant", "nf4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    nf4_blocks = 46 if nf4_cpu_packed() else 47  # the CPU kernel's nf4 layout (AVX512-BF16) or bitsandbytes' own
    assert (plan["num_blocks"], plan["max_blocks"], plan["quant"]) == (nf4_blocks, 80, "nf4")
    assert main(["plan", "bigscience/bloom", "--memory", "1GiB"]) == 1
    assert main(["plan", "no/such-preset", "--memory", "1GiB"]) == 1
