"""The demo's orchestrator: tiny model, bootstrap DHT, server processes, a client; then the real model's answer."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from distconf.tools.demo.bounded import bounded
from distconf.tools.demo.generation import (
    CLIENT_SETTINGS,
    NEW_TOKENS,
    STOP_AFTER,
    Hop,
    demo_prompt,
    local_generation,
    open_client,
    replaceable_server,
    swarm_generation,
)
from distconf.tools.demo.process import DemoServer
from distconf.tools.demo.real import REAL_MODELS, RealServers, RealStageError, real_answers, start_real_servers
from distconf.tools.demo.tiny_model import (
    DEMO_DTYPE,
    blocks_per_server,
    demo_family,
    demo_prefix,
    make_tiny_checkpoint,
    memory_for,
)
from distconf.tools.demo.tuning import PRE_SEQ_LEN, STEPS, target_token, tune_prompts, weights_report
from distconf.tools.serving import ServerProcess

__all__ = ["run_swarm_demo"]

Out = Callable[[str], None]
STOP_TIMEOUT = 30.0
"""Seconds a server gets to announce OFFLINE and exit before it is terminated."""


@dataclass
class _Demo:
    """What the servers and the client of one demo run share."""

    prefix: str
    num_blocks: int
    model_dir: Path
    memory: int
    blocks_each: int
    peers: list[str]
    t0: float
    deadline: float
    out: Out
    servers: list[DemoServer] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.t0:.1f} s"

    def name(self, peer: str) -> str:
        """The demo name (``server-2``) of a peer id."""
        return next((s.name for s in self.servers if s.peer_id == peer), f"peer ..{peer[-8:]}")

    def stop_timeout(self) -> float:
        """Seconds a server may take to stop now (`STOP_TIMEOUT`, less if the demo's deadline is closer)."""
        return max(0.1, min(self.deadline - time.monotonic(), STOP_TIMEOUT))


def run_swarm_demo(
    num_servers: int = 3,
    *,
    family: str | None = None,
    workdir: str | Path | None = None,
    timeout: float = 300.0,
    real_model: bool = True,
    json_path: str | Path | None = None,
    out: Out = print,
) -> int:
    """Run the local swarm demo; return 0 if the swarm generated the local model's tokens and all stopped cleanly.

    :param num_servers: server processes to start (with 3, two cover the model and one is a spare).
    :param family: family of the tiny model (default: `demo_family`).
    :param workdir: where to write the tiny checkpoint and server logs (default: a temp dir).
    :param timeout: hard bound on the whole demo, in seconds (stopping takes at most ~30 s more).
    :param real_model: also serve the real model from its GGUF (`distconf.tools.demo.real`) and
        require its chat answer through the swarm to equal the local model's.
    :param json_path: write a JSON summary of the run there (what each stage found, and ``ok``).
    :param out: where progress lines go (``print`` by default).
    """
    from distconf.dht import start_local_dht, visible_maddrs

    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="distconf-swarm-"))
        workdir = Path(workdir)
        family = demo_family(family)
        model_dir = workdir / demo_prefix(family)
        config = make_tiny_checkpoint(model_dir, family)
        out(f"tiny model: {type(config).__name__}, {config.num_hidden_layers} blocks, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, KV groups {config.num_key_value_groups}")
        out(f"  dht_prefix {config.dht_prefix!r}, random weights in {model_dir}")
        boot = start_local_dht()
        stack.callback(boot.shutdown)
        blocks_each = blocks_per_server(num_servers, int(config.num_hidden_layers))
        memory = memory_for(config, blocks_each, DEMO_DTYPE)
        demo = _Demo(demo_prefix(family), int(config.num_hidden_layers), model_dir, memory, blocks_each,
                     visible_maddrs(boot), t0, t0 + timeout, out)
        out(f"bootstrap DHT node: {demo.peers[0]}")
        log_path = workdir / "servers.log"
        log = stack.enter_context(log_path.open("w"))
        ok = False
        reals: list[RealServers] = []
        try:
            if real_model:  # started first: the real servers load while the tiny model's parts run
                for spec in REAL_MODELS:
                    reals.append(start_real_servers(spec, demo.peers, workdir, out,
                                                    first=1 + sum(len(r.servers) for r in reals)))
            _start_servers(demo, num_servers, log)
            ok = _client(demo, int(config.vocab_size))
            for real in reals:
                answers = real_answers(real, demo.peers, demo.deadline, out)
                demo.summary.setdefault("real_models", []).append(answers.summary())
                ok = answers.identical and ok
            if reals:
                demo.summary["real_model"] = demo.summary["real_models"][0]
        except KeyboardInterrupt:
            out("interrupted: stopping every server")
        except RealStageError as exc:
            out(f"real model FAILED: {exc}")
        except Exception as exc:
            out(f"swarm demo failed: {exc!r}")
            _show_log(out, log, log_path)
        finally:
            real_servers = [s for real in reals for s in real.servers]
            for server in real_servers:
                server.send_signal()  # they announce OFFLINE while the tiny servers stop
            codes = [s.stop(demo.stop_timeout()) for s in _ask_all_to_stop(demo.servers)]
            real_codes = [s.stop(demo.stop_timeout()) for s in real_servers]
        clean = all(c == 0 for c in codes + real_codes)
        out(f"stopped {_stopped(codes, real_codes)} ({'cleanly' if clean else f'exit codes {codes + real_codes}'}) "
            f"and the DHT in {demo.elapsed()} total")
        log.flush()
        if not clean:
            _show_unclean(out, log_path, [s for s in demo.servers + real_servers if s.proc.returncode != 0])
        unchanged, checked = weights_report(log_path.read_text(errors="replace"))
        frozen = checked == len(codes) and unchanged == checked
        out(f"server weights unchanged (sha256 at load = at stop): {unchanged} of {checked} servers"
            + ("" if frozen else f"; expected {len(codes)} unchanged"))
        code = 0 if ok and clean and frozen else 1
        demo.summary.update(ok=code == 0, seconds=round(time.monotonic() - t0, 1), exit_codes=codes + real_codes,
                            clean_stop=clean, weights_unchanged=[unchanged, checked])
        if real_model:
            demo.summary.setdefault("real_model", None)  # None: the stage did not get to its answer
        if json_path is not None:
            Path(json_path).write_text(json.dumps(demo.summary, indent=2) + "\n", encoding="utf-8")
        return code


def _stopped(codes: list[int], real_codes: list[int]) -> str:
    if not real_codes:
        return f"{len(codes)} servers"
    return f"{len(codes)} tiny-model servers and {len(real_codes)} real-model servers"


def _show_log(out: Out, log: IO[str], log_path: Path) -> None:
    log.flush()
    out(f"last lines of the server log ({log_path}):")
    out("\n".join(log_path.read_text(errors="replace").splitlines()[-20:]))


def _show_unclean(out: Out, shared_log: Path, servers: list[ServerProcess]) -> None:
    """The last log lines of each server that did not exit 0 (what it was doing when it was killed)."""
    shared = shared_log.read_text(errors="replace").splitlines()
    for server in servers:
        if server.log_path is not None:  # a log of its own
            where, own = server.log_path, server.log_tail().splitlines()
        else:  # the tiny servers share one log, each line tagged with the server's name
            where, own = shared_log, [line for line in shared if line.startswith(f"[{server.name}]")]
        out(f"last lines of {server.name}'s log ({where}):")
        out("\n".join(own[-12:]) or "  (none)")


def _ask_all_to_stop(servers: list[DemoServer]) -> list[DemoServer]:
    """Ask every server to stop at once (they announce OFFLINE in parallel), then wait for each."""
    for server in servers:
        server.send("STOP")
    return servers


def _start_servers(demo: _Demo, num_servers: int, log: IO[str]) -> None:
    """Start the processes together, then let them choose their blocks one after another."""
    for i in range(num_servers):
        lifetime = max(30.0, demo.deadline - time.monotonic() + STOP_TIMEOUT)
        demo.servers.append(DemoServer(f"server-{i + 1}", [
            "--model-dir", str(demo.model_dir), "--initial-peers", *demo.peers, "--memory", str(demo.memory),
            "--lifetime", str(lifetime)], log))
    demo.out(f"{num_servers} block servers (distconf serve's code, one process each), "
             f"{demo.memory / 2**20:.1f} MiB each: the planner fits {demo.blocks_each} blocks")
    for server in demo.servers:
        server.peer_id = server.expect("JOINED", demo.deadline).split()[1]
    demo.out(f"  all joined the DHT ({demo.elapsed()}); each in turn takes the weakest part of the chain:")
    for i, server in enumerate(demo.servers):  # one at a time: each sees its predecessors when it places itself
        server.send("GO")
        ready = server.wait_ready(demo.deadline)
        start, end = server.span
        spare = any(s.span[0] < server.span[1] and server.span[0] < s.span[1] for s in demo.servers[:i])
        demo.out(f"  {server.name}: blocks {start}..{end - 1}, {ready['parameters']:,} parameters loaded, "
                 f"{ready['throughput']:.0f} rps measured, ONLINE" + ("  (a spare)" if spare else ""))


def _client(demo: _Demo, vocab_size: int) -> bool:
    """Discovery and route, the generation with a server stopped mid-way, prompt tuning, one more server leaves."""
    model = open_client(demo.model_dir, demo.peers)
    try:
        ok = _route(demo, model.remote.swarm.dht)
        ok = _generate(demo, model, vocab_size) and ok
        ok = _tune(demo, model.remote.swarm.dht, vocab_size) and ok
        _one_leaves(demo, model.remote.swarm.dht)
        return ok
    finally:
        model.shutdown()


def _tune(demo: _Demo, dht: Any, vocab_size: int) -> bool:
    """Deep prompt tuning through the swarm on the servers still up; True if the loss at least halved."""
    prompt = demo_prompt(vocab_size)
    target = target_token(prompt, vocab_size)
    demo.out(f"prompt tuning: {STEPS} Adam steps of deep_ptune ({PRE_SEQ_LEN} prompt positions) teaching the model "
             f"to answer the prompt with token {target}; forward and backward run on the servers")
    result = bounded(lambda: tune_prompts(demo.model_dir, dht, prompt, vocab_size, CLIENT_SETTINGS),
                      demo.deadline, "prompt tuning through the swarm")
    losses = result.losses
    demo.out(f"  trainable on the client: {result.trainable:,} prompt values (no block weight is local)")
    demo.out(f"  loss: {losses[0]:.3f} -> {losses[-1]:.3f} ({losses[-1] / losses[0]:.2f}x), "
             f"{result.seconds_per_step * 1000:.0f} ms per step")
    demo.out(f"  next token after the prompt: {result.answer_before} before, {result.answer_after} after")
    if not result.halved:
        demo.out("  but the loss did not halve")
    demo.summary["tuning"] = {"losses": [losses[0], losses[-1]], "halved": result.halved,
                              "answer_before": result.answer_before, "answer_after": result.answer_after}
    return result.halved


def _route(demo: _Demo, dht: Any) -> bool:
    """A client that knows only the prefix reads the block count, the coverage and a route."""
    from distconf.dht import find_models, find_servers_by_prefix
    from distconf.dht.report import format_coverage, format_route

    num_blocks = find_models(dht, timeout=10)[demo.prefix].num_blocks
    demo.out(f"client: knows only {demo.prefix!r}; the swarm lists it with {num_blocks} blocks")
    state = find_servers_by_prefix(dht, demo.prefix, num_blocks, timeout=10)
    demo.out(format_coverage(state))
    ok, text = format_route(state)
    demo.out(text)
    demo.summary["route"] = ok
    return ok


def _generate(demo: _Demo, model: Any, vocab_size: int) -> bool:
    """Greedy generation locally and through the swarm (one server stopped mid-way); True if identical."""
    prompt = demo_prompt(vocab_size)
    demo.out(f"generation: {NEW_TOKENS} new tokens, greedy, float32 (token ids: the tiny model has no tokenizer)")
    demo.out(f"  prompt:            {_ids(prompt)}")
    expected = local_generation(demo.model_dir, prompt)
    demo.out(f"  local HF model:    {_ids(expected)}")
    by_peer = {s.peer_id: s for s in demo.servers}
    codes: dict[str, int] = {}

    def choose(route: list[Hop]) -> str | None:
        return replaceable_server(route, {s.peer_id: s.span for s in demo.servers if s.alive})

    def stop(peer: str) -> None:
        codes[peer] = by_peer[peer].stop(demo.stop_timeout())

    result = bounded(lambda: swarm_generation(model, prompt, choose=choose, stop=stop), demo.deadline,
                      "the generation through the swarm")
    demo.out(f"  route:             {_route_text(demo, result.route_before)}")
    expect_failover = len(demo.servers) >= 2  # then the placement leaves a spare (`blocks_per_server`)
    if result.stopped is None:
        demo.out(f"  (no server of the route has a replacement among {len(demo.servers)} server(s): "
                 "generation without a failure)")
    else:
        victim = by_peer[result.stopped]
        code = codes[victim.peer_id]
        demo.out(f"  after {STOP_AFTER} tokens:    stopped {victim.label()}: exit {code}"
                 + _offline_if_clean(code))
        new = [by_peer[hop[0]].label() if hop[0] in by_peer else demo.name(hop[0])
               for hop in result.route_after if hop not in result.route_before]
        demo.out(f"  failover:          the client banned {victim.name} and replayed the session to "
                 f"{', '.join(new) or '(none)'}")
    demo.out(f"  through the swarm: {_ids(result.tokens)}")
    identical = result.tokens == expected
    failed_over = result.stopped is not None and result.failovers >= 1 and codes[result.stopped] == 0
    why = "the servers computed exactly what the local model does" + (", across a failover" if failed_over else "")
    demo.out(f"  identical: {'yes: ' + why if identical else 'NO'} ({demo.elapsed()})")
    if expect_failover and not failed_over:
        demo.out(f"  but the failover did not happen as planned (failovers: {result.failovers})")
    demo.summary["generation"] = {"local_tokens": expected, "swarm_tokens": result.tokens, "identical": identical,
                                  "failovers": result.failovers, "failed_over": failed_over}
    return identical and (failed_over or not expect_failover)


def _one_leaves(demo: _Demo, dht: Any) -> None:
    """One more server leaves: the client reads the swarm again and reports the gap."""
    from distconf.dht import find_servers_by_prefix
    from distconf.dht.report import format_route

    leaving = next((s for s in demo.servers if s.alive), None)
    if leaving is None:
        return
    too = " too" if any(not s.alive for s in demo.servers) else ""
    code = leaving.stop(demo.stop_timeout())
    _, text = format_route(find_servers_by_prefix(dht, demo.prefix, demo.num_blocks, timeout=10))
    demo.out(f"then {leaving.name} leaves{too} (exit {code}{_offline_if_clean(code)}); the client sees:")
    demo.out(f"  {text}")


def _offline_if_clean(code: int) -> str:
    """A stopped server's exit said as the demo prints it: a server announces OFFLINE only on a clean exit."""
    return ", announced OFFLINE" if code == 0 else ""


def _ids(tokens: list[int]) -> str:
    return " ".join(str(t) for t in tokens)


def _route_text(demo: _Demo, route: list[Hop]) -> str:
    return " -> ".join(f"{demo.name(peer)}[{start}..{end - 1}]" for peer, start, end in route)
