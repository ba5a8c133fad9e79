"""Helpers for the client tests: tiny model folders and real ``distconf serve`` processes on 127.0.0.1."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from blockhelpers import family_config, hf_model

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
START_DEADLINE = 120.0


def make_model_dir(directory: Path, family: str, *, layers: int = 4, seed: int = 0, noise: float = 0.3,
                   variant: int = 0) -> tuple[Path, Any]:
    """A tiny float32 model of ``family`` saved as safetensors with a distributed config.json.

    Returns the folder and the local Hugging Face model (the reference). ``noise`` is
    added to every weight so that greedy generation does not settle on one token.
    """
    from distconf.loader.auto import AutoDistributedConfig

    _, hf_config, _ = family_config(family, variant, num_hidden_layers=layers)
    model = hf_model(hf_config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    prefix = f"test-{family}-{seed}-{directory.name}".replace("_", "-")
    config = AutoDistributedConfig.from_pretrained(str(directory), dht_prefix=prefix)
    config.save_pretrained(directory)
    return directory, model


class ServerProcess:
    """One ``distconf serve`` process (its own process group, so its DHT child goes with it)."""

    def __init__(self, model_dir: Path, peers: list[str], blocks: str, log: Path, *extra: str) -> None:
        cmd = [PYTHON, "-m", "distconf.cli.cmd_serve", str(model_dir), "--initial-peers", *peers,
               "--blocks", blocks, "--dtype", "fp32", "--host", "127.0.0.1", *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.log_path = log
        self.log = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.peer_id: str | None = None
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.put(line)
        self.lines.put(None)

    def wait_serving(self, deadline: float) -> str:
        """Wait (until ``deadline``, monotonic) for the SERVING line; return the peer id."""
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("SERVING"):
                self.peer_id = line.split(" as peer ")[1].split()[0]
                return self.peer_id
        raise RuntimeError(f"server did not start; log {self.log_path}:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash: no OFFLINE announcement)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (announces OFFLINE), then SIGKILL of the group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._pump_thread.join(10)  # the last lines (e.g. the shutdown checks) reach the log before it closes
        self.log.close()


def start_servers(jobs: list[tuple[Path, str]], peers: list[str], log_dir: Path, *extra: str
                  ) -> list[ServerProcess]:
    """Start one server per ``(model_dir, "A:B")`` job, all at once, and wait until all serve."""
    servers = [ServerProcess(model_dir, peers, span, log_dir / f"{model_dir.name}-{i}.log", *extra)
               for i, (model_dir, span) in enumerate(jobs)]
    deadline = time.monotonic() + START_DEADLINE
    try:
        for s in servers:
            s.wait_serving(deadline)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: list[ServerProcess]) -> None:
    """Stop every server (each at most ~30 s)."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        s.stop()


def close_swarm(models: Any, servers: list[ServerProcess], dht: Any) -> None:
    """Shut the client models down, stop the servers, then release the DHT node."""
    for model in models:
        model.shutdown()
    stop_all(servers)
    from distconf.client.swarm import release_dht

    release_dht(dht)


def server_info(model: Any, peer_id: str) -> dict[str, Any]:
    """``rpc_info`` of a server, through the model's swarm connection."""
    from distconf.rpc.calls import call_info

    swarm = model.remote.swarm
    return swarm.run(call_info(swarm.p2p, peer_id, timeout=10.0), timeout=15.0)


def prompts(batch: int = 2, length: int = 5, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    """Random prompts of equal length."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
