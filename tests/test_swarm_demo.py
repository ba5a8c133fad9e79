"""The local swarm demo end to end, and `distconf swarm` / `distconf plan` on live data."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from distconf.dht import ServerInfo, ServerState, announce_blocks, start_local_dht, visible_maddrs


def test_swarm_demo_runs_end_to_end(tmp_path):
    """Servers in separate processes load real weights, place and announce; a client routes."""
    proc = subprocess.run(
        [sys.executable, "-m", "distconf.tools.demo", "--timeout", "200", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=260,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "chose blocks 0..2" in out and "chose blocks 3..5" in out and "chose blocks 5..7" in out
    assert "real parameters" in out and "announced ONLINE" in out
    assert "knows only 'distconf-demo-tiny-" in out
    assert "full route in 3 hop(s)" in out
    assert "server-2 leaves (exit 0, announced OFFLINE): no full route: no online or joining server covers block 3" \
        in out
    assert "stopped 3 servers (cleanly)" in out
    assert len(list(tmp_path.glob("distconf-demo-tiny-*/model.safetensors"))) == 1


@pytest.fixture(scope="module")
def live_swarm():
    nodes = []
    try:
        boot = start_local_dht()
        nodes.append(boot)
        peers = visible_maddrs(boot)
        server = start_local_dht(peers)
        nodes.append(server)
        cfg = SimpleNamespace(dht_prefix="cli-test-model", num_hidden_layers=6, update_period=60.0)
        announce_blocks(server, cfg, 0, 4, ServerInfo(state=ServerState.ONLINE, throughput=3.0, public_name="s1",
                                                       cache_tokens_left=1024))
        announce_blocks(boot, cfg, 4, 6, ServerInfo(state=ServerState.JOINING, throughput=1.0))
        yield SimpleNamespace(peers=peers, server=server)
    finally:
        for node in reversed(nodes):
            node.shutdown()


def run_cli(capsys, *args: str) -> SimpleNamespace:
    from distconf.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def test_swarm_command_shows_coverage_and_route(live_swarm, capsys):
    proc = run_cli(capsys, "swarm", "--initial-peers", *live_swarm.peers, "--model", "cli-test-model")
    assert proc.returncode == 0, proc.stderr
    assert "cli-test-model: 6 blocks, 2 peer(s)" in proc.stdout
    assert "OOOO.." in proc.stdout and "....JJ" in proc.stdout and "1,024" in proc.stdout
    assert "full route in 2 hop(s)" in proc.stdout
    proc = run_cli(capsys, "swarm", "--initial-peers", *live_swarm.peers, "--model", "cli-test-model", "--online-only")
    assert proc.returncode == 1 and "no online server covers block 4" in proc.stdout


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
    assert main(["plan", str(tmp_path), "--memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "blocks that fit" in out and "8 / 32" in out and "7 / 32" in out
    assert "reserves 4.00x the cache" in out
    assert main(["plan", "meta-llama/Llama-2-70b-hf", "--memory", "24GiB", "--quant", "nf4"]) == 0
    assert "46 / 80" in capsys.readouterr().out
    assert main(["plan", "bigscience/bloom", "--memory", "1GiB"]) == 1
    assert main(["plan", "no/such-preset", "--memory", "1GiB"]) == 1
