"""``distconf chat`` and ``distconf generate`` on a real swarm serving the real model (SmolLM2-135M-Instruct).

One swarm for the module: a bootstrap DHT node and two ``distconf serve`` processes of the GGUF
in fp32 (blocks 0:15 and 15:30). The commands run as a user runs them:

- ``distconf generate GGUF --initial-peers ADDR 'A cat sat'`` (the prompt after the addresses)
  prints the local transformers model's greedy text; ``--chat`` prints the known answer; the raw
  question, which the instruction-tuned model ends at once, prints a notice suggesting ``--chat``;
- ``distconf chat`` in a real tmux session: the typed question gets the known answer, Ctrl-C during
  a long reply stops it and the chat goes on (the servers' cache is full again: the reply's session
  was closed), ``/reset`` and the question again give the answer again, ``/exit`` leaves with status 0;
- a prefix no server holds: one line, exit 1, no traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import pytest
from dhthelpers import wait_until
from real_helpers import open_real_source, real_cache_dir
from swarm_harness import Swarm as HarnessSwarm

from distconf.tools import real_model as rm
from distconf.tools.serving import ServerProcess

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "15:30")
START_DEADLINE = 300.0  # two real servers loading at once on a shared 2-core machine
COMMAND_TIMEOUT = 240.0  # one CLI run: load the model, join, generate


class Swarm:
    """The running swarm: its addresses and the environment its commands run with."""

    def __init__(self, peers: list[str], env: dict[str, str], servers: list[ServerProcess], dht: Any) -> None:
        self.peers, self.env, self.servers, self.dht = peers, env, servers, dht

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``distconf ARGS`` to its end."""
        return forkserver.run([sys.executable, "-m", "distconf", *args], timeout=COMMAND_TIMEOUT, cwd=REPO,
                              env=self.env)


@pytest.fixture(scope="module")
def swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    open_real_source(request.config)  # converted once, before the servers need it
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}
    env.pop("DISTCONF_INITIAL_PEERS", None)
    with HarnessSwarm(tmp_path_factory.mktemp("chat-swarm")) as s:
        for i, span in enumerate(SPANS):
            s.start_server(rm.gguf_path(), span, log=f"server-{i}.log", name=f"chat-{i}", env=env, dtype="float32")
        s.wait_ready(timeout=START_DEADLINE)
        yield Swarm(s.peers, env, s.servers, s.dht)


@pytest.fixture(scope="module")
def local(real_local: Any, real_tokenizer: Any) -> tuple[Any, Any]:
    return real_local, real_tokenizer


@pytest.fixture(scope="module")
def observer(swarm: Swarm, request: pytest.FixtureRequest) -> Iterator[Any]:
    """An in-process client of the swarm, to ask the servers how much cache they have left."""
    from distconf.client import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(rm.gguf_path(), dht=swarm.dht, max_retries=0,
                                                            gguf_cache_dir=real_cache_dir(request.config))
    try:
        yield model
    finally:
        model.shutdown()


def _cache_left(swarm: Swarm, model: Any) -> dict[str, int]:
    from distconf.rpc import CACHE_TOKENS_AVAILABLE
    from distconf.rpc.calls import call_info

    client = model.remote.swarm
    return {s.peer_id: client.run(call_info(client.p2p, s.peer_id, timeout=10.0), timeout=15.0)[CACHE_TOKENS_AVAILABLE]
            for s in swarm.servers}


def _wait_cache(swarm: Swarm, model: Any, done: Any, timeout: float) -> dict[str, int]:
    """Poll the servers' cache left until ``done(left)``; the last reading."""
    return wait_until(lambda: _cache_left(swarm, model), done, timeout=timeout, interval=0.1)


# ------------------------------------------------------------------ distconf generate


def test_generate_prompt_after_the_addresses(swarm: Swarm, local: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = local
    ids = tokenizer("A cat sat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    result = swarm.cli("generate", str(rm.gguf_path()), "--initial-peers", *swarm.peers, "A cat sat",
                       "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == want + "\n" and want.strip()


def test_generate_chat_and_the_empty_answer_notice(swarm: Swarm) -> None:
    chat = swarm.cli("generate", str(rm.gguf_path()), "--initial-peers", *swarm.peers, "--chat", rm.QUESTION)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.strip() == rm.ANSWER
    raw = swarm.cli("generate", str(rm.gguf_path()), "--initial-peers", *swarm.peers, "--prompt", rm.QUESTION)
    assert raw.returncode == 0, raw.stderr[-2000:]
    assert raw.stdout == "\n"  # end of sequence at once ...
    assert "ended its answer at once" in raw.stderr and "add --chat" in raw.stderr  # ... and why


def test_chat_without_a_route_is_one_line(swarm: Swarm) -> None:
    result = swarm.cli("chat", str(rm.gguf_path()), "--initial-peers", *swarm.peers, "--dht-prefix", "nobody-serves")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("distconf chat: the swarm cannot serve 'nobody-serves' now: "), result.stderr[-2000:]


# ------------------------------------------------------------------ distconf chat in tmux


class Tmux:
    """One tmux session on a private server socket (no other tmux is touched); every wait is bounded."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.socket = f"distconf-test-{uuid.uuid4().hex[:8]}"
        self.name = "chat"
        line = " ".join(_quote(part) for part in command)
        self.tmux("new-session", "-d", "-s", self.name, "-x", "220", "-y", "60", line, env=env)
        self.tmux("set-option", "-t", self.name, "remain-on-exit", "on")

    def tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run one tmux command on this server; its stdout."""
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True,
                              timeout=30, env=env).stdout

    def screen(self) -> str:
        """The pane's text with its scrollback, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-2000", "-t", self.name)

    def keys(self, *keys: str) -> None:
        """Type ``keys`` (tmux key names such as Enter and C-c, or literal text)."""
        self.tmux("send-keys", "-t", self.name, *keys)

    def wait_for(self, done: Any, timeout: float, what: str) -> str:
        """Poll the screen until ``done(screen)`` is true; fail (with the screen) after ``timeout`` s."""
        screen = wait_until(self.screen, done, timeout=timeout, interval=0.1)
        if not done(screen):
            pytest.fail(f"tmux: no {what} after {timeout:.0f} s; the screen:\n{screen[-3000:]}")
        return screen

    def pane(self, field: str) -> str:
        """A pane format field (``pane_dead``, ``pane_dead_status``)."""
        return self.tmux("display-message", "-p", "-t", self.name, f"#{{{field}}}").strip()

    def kill(self) -> None:
        """Stop this tmux server and what runs in it."""
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _reply_text(screen: str, question: str) -> str:
    """What the screen shows after the last ``question``, log lines left out."""
    after = screen.rsplit(question, 1)[-1]
    return "\n".join(line for line in after.splitlines() if not line.startswith(("INFO ", "WARNING "))).strip()


def _quote(part: str) -> str:
    return "'" + part.replace("'", "'\\''") + "'"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_in_tmux(swarm: Swarm, observer: Any) -> None:
    command = [sys.executable, "-m", "distconf", "chat", str(rm.gguf_path()), "--initial-peers", *swarm.peers,
               "--temperature", "0", "--max-tokens", "400"]
    term = Tmux(command, {**swarm.env, "TERM": "xterm"})
    try:
        term.wait_for(lambda s: "chatting with" in s, COMMAND_TIMEOUT, "banner")
        term.keys(rm.QUESTION, "Enter")
        term.wait_for(lambda s: s.count(rm.ANSWER) == 1 and s.rstrip().endswith(">"), 120, "answer")
        full = _wait_cache(swarm, observer, lambda left: False, 0)  # no session open between replies

        story = "Write a very long story about a dragon who learns to cook."
        term.keys(story, "Enter")
        term.wait_for(lambda s: len(_reply_text(s, story)) >= 40, 120, "start of the story")
        # the reply's session holds cache (polled, bounded: a reading can fall between the client's span calls)
        during = _wait_cache(swarm, observer, lambda left: all(left[p] < full[p] for p in full), 10)
        assert all(during[p] < full[p] for p in full), (during, full)
        term.keys("C-c")
        screen = term.wait_for(lambda s: "[stopped]" in s and s.rstrip().endswith(">"), 60, "stopped reply")
        assert term.pane("pane_dead") == "0"  # still chatting
        assert _wait_cache(swarm, observer, lambda left: left == full, 30) == full  # its session was closed
        assert "Traceback" not in screen and "KeyboardInterrupt" not in screen

        term.keys("/reset", "Enter")
        term.wait_for(lambda s: "(a new conversation)" in s, 30, "reset")
        term.keys(rm.QUESTION, "Enter")
        term.wait_for(lambda s: s.count(rm.ANSWER) == 2 and s.rstrip().endswith(">"), 120, "answer again")

        term.keys("/exit", "Enter")
        term.wait_for(lambda s: term.pane("pane_dead") == "1", 60, "exit")
        assert term.pane("pane_dead_status") == "0"
    finally:
        term.kill()


# ------------------------------------------------------------------ speculative decoding

REPEAT = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."


def test_assisted_generation_on_the_real_model_gives_plain_greedy_tokens(local: tuple[Any, Any], observer: Any) -> None:
    """transformers' assisted generation through two real servers (the issue's case: prompt lookup returned 48
    tokens where plain greedy returns 17, and the same model as assistant diverged after the third token)."""
    import torch

    from distconf.client.textgen import chat_input_ids

    model, tokenizer = local
    ids = torch.tensor([chat_input_ids(tokenizer, [{"role": "user", "content": REPEAT}])])

    def greedy(target: Any, **kwargs: Any) -> list[int]:
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    plain = greedy(model)
    assert tokenizer.eos_token_id in plain  # the answer ends well before max_new_tokens
    assert greedy(observer) == plain
    assert greedy(observer, prompt_lookup_num_tokens=8) == plain
    assert greedy(observer, assistant_model=model) == plain


def test_generate_with_a_draft_or_prompt_lookup_prints_plain_greedy_text(swarm: Swarm) -> None:
    """``distconf generate --prompt-lookup`` and ``--draft-model`` (the same GGUF, int8 on the client) print the
    text plain greedy generation prints."""
    base = ("generate", str(rm.gguf_path()), "--initial-peers", *swarm.peers, "--chat", REPEAT,
            "--max-new-tokens", "40")
    plain = swarm.cli(*base)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "quick brown fox" in plain.stdout
    for extra in (("--prompt-lookup", "8"), ("--draft-model", str(rm.gguf_path()), "--draft-quant", "int8")):
        result = swarm.cli(*base, *extra)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout == plain.stdout, extra
