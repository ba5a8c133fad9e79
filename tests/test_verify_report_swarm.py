"""A real liar caught by the real CLI: the detection reaches generate's stderr, the API's endpoint and the swarm page.

One swarm: a bootstrap DHT node, two honest ``distconf serve`` processes and one liar
(`hostile_serve.py`, identity blocks, announcing 1000x its throughput so that clients route
through it) of a tiny float32 model's blocks 0:4, whose folder gets a word-level tokenizer
(the commands need text); the monitor reads the swarm in-process. ``distconf generate`` and
``distconf api`` run as a user runs them (subprocesses, ``--verify-fraction 0.25``): each
names the liar (stderr; ``GET /distconf/verification`` and its header; the WARNING log)
and publishes a report, which the monitor shows in its "caught by clients" rows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import forkserver
import pytest
from dhthelpers import wait_for
from hostile_helpers import start_honest, start_hostile
from swarm_harness import Swarm as HarnessSwarm
from swarm_harness import swarm_fixture

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parents[1]
BLOCKS = "0:4"
PROMPT = "t1 t2 t3"
COMMAND_TIMEOUT = 300.0


def save_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer ("t0".."tN") for the tiny model, so that the commands take and give text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0").save_pretrained(model_dir)


class Swarm(HarnessSwarm):
    """The harness's bootstrap node, the model, two honest servers and the liar, a monitor served in-process."""

    def build(self) -> None:
        from distconf.monitor import Monitor, build_app, dht_reader, start_in_thread

        self.model_dir, local = self.add_model("llama", "tiny")
        save_word_tokenizer(self.model_dir, local.config.vocab_size)
        for i in range(2):
            self.add_server(start_honest(self.model_dir, self.peers, BLOCKS, self.root / f"honest-{i}.log"))
        self.liar = self.add_server(start_hostile("identity", self.model_dir, self.peers, BLOCKS,
                                                  self.root / "liar.log", boost=1000.0))
        self.wait_ready()
        reader = self.node(client_mode=True)
        self.running = start_in_thread(build_app(Monitor(dht_reader(reader, {self.prefix: 4}, timeout=20.0),
                                                         refresh=1.0)))
        self.on_close(self.running.stop)

    def command(self, *args: str) -> list[str]:
        """``distconf ARGS`` on this swarm, as a user types it."""
        return [sys.executable, "-m", "distconf", *args[:1], str(self.model_dir), "--initial-peers", *self.peers,
                *args[1:]]


swarm = swarm_fixture("verify-report", None, cls=Swarm)


def caught_rows(swarm: Swarm) -> list[dict]:
    """The monitor's "caught by clients" rows of the model (its JSON, as the page reads it)."""
    with urllib.request.urlopen(f"{swarm.running.url}/api/v1/state", timeout=20) as response:
        models = json.load(response)["models"]
    return next((m["caught"] for m in models if m["dht_prefix"] == swarm.prefix), [])


def test_generate_names_the_liar_on_stderr(swarm: Swarm) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = forkserver.run(swarm.command("generate", "--verify-fraction", "0.25", "--max-new-tokens", "6", PROMPT),
                          timeout=COMMAND_TIMEOUT, env=env, cwd=swarm.root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "no text"
    lines = [line for line in done.stderr.splitlines() if line.startswith("distconf generate: spot check: ")]
    assert lines, done.stderr[-3000:]
    assert all(f"server …{swarm.liar.peer_id[-6:]} computed blocks 0..3 wrong" in line for line in lines), lines
    assert "banned" in lines[0]
    assert "distconf.client.verifier: verification:" not in done.stderr  # said once, by the command
    rows = wait_for(lambda: caught_rows(swarm), timeout=60)
    assert rows and rows[0]["peer_id"] == swarm.liar.peer_id and (rows[0]["start"], rows[0]["end"]) == (0, 4)


def test_the_api_lists_the_liar(swarm: Swarm) -> None:
    log = swarm.root / "api.log"
    with log.open("w") as out:
        proc = subprocess.Popen(swarm.command("api", "--port", "0", "--verify-fraction", "0.25"), stdout=out,
                                stderr=subprocess.STDOUT, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                                cwd=swarm.root)
    try:
        found = wait_for(lambda: re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text()) or proc.poll(),
                         timeout=COMMAND_TIMEOUT, interval=0.5)
        assert isinstance(found, re.Match), log.read_text()[-3000:]
        url = found.group(1)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=20) as response:
            model_id = json.load(response)["data"][0]["id"]
        body = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=COMMAND_TIMEOUT) as response:
            answer = json.load(response)
            count = int(response.headers["X-Distconf-Verification-Events"])
        assert answer["object"] == "text_completion" and "distconf" not in answer  # OpenAI's body, unchanged
        with urllib.request.urlopen(f"{url}/distconf/verification", timeout=20) as response:
            listed = json.load(response)
        assert listed["enabled"] and listed["verify_fraction"] == 0.25 and listed["total"] == count >= 1
        assert {e["peer_id"] for e in listed["data"]} == {swarm.liar.peer_id}
        assert all((e["start"], e["end"]) == (0, 4) and swarm.liar.peer_id not in e["checkers"]
                   for e in listed["data"])
        # logged at WARNING (hivemind names the level WARN)
        assert re.search(r"WARN(ING)? distconf\.client\.verifier: verification: server …" + swarm.liar.peer_id[-6:],
                         log.read_text())
        # the generate client and the API's client each published a report: two claims on the page
        rows = wait_for(lambda: (r := caught_rows(swarm)) and r[0]["reports"] >= 2 and r, timeout=60)
        assert rows, caught_rows(swarm)
        assert rows[0]["peer_id"] == swarm.liar.peer_id and rows[0]["detections"] >= 2
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
