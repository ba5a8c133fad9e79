"""A real ``distconf serve`` process that lies: patched in-process by test code, then run through the CLI.

    python tests/hostile_serve.py --mode MODE [--every K] [--noise X] [--block I] [--seed S]
        [--throughput-boost F] -- <the usual distconf serve arguments>

Nothing hostile lives in distconf itself: this script patches the server's classes in its own
process and then calls ``distconf.cli.cmd_serve.main``, so everything else (loading, the DHT
announcements, the handlers, batching, the ready line) is the product's own code.

Modes (every compute path is covered: the patches sit below the single-session step, the batched
step of `distconf.server.session_cache`, ``rpc_forward`` and ``rpc_backward``):

- ``noise``: the weights of ONE served block (``--block``, default the first of the span) are
  scaled by ``1 + X * N(0, 1)`` (``--noise X``, default 0.03) once loaded, after the digest and the
  throughput measurement: the server announces the honest weights' digests and serves others.
  Patched: ``BlockServer._make_handler`` (every handler is made there, also after a move).
- ``identity``: every served block returns its inputs (skipped compute): each block module's
  ``forward`` is wrapped (the real block still runs, so the KV cache keeps its shape, and its
  hidden states are thrown away). Every call site (`distconf.server.compute`, `distconf.server.session_cache`)
  calls the module, so all paths lie.
- ``stale``: honest except on every K-th inference step of a session (``--every K``, default 4;
  steps counted per session from 1, empty steps not counted), where it returns yesterday's hidden
  states: the last positions of its previous reply in that session when that reply is large
  enough, else the step's own inputs. The cache is computed honestly. Patched:
  ``Sessions._run_step`` (the one place a session's step, batched or not, gets its output).
  Forward and backward are honest.

- ``nan``, ``huge``, ``mistyped``: the replies of ``rpc_forward`` and of inference steps are,
  respectively, NaN of the right shape; a tensor of ~48 MiB; the right shape with a float16
  buffer whose dtype field says complex128. Patched: ``serialize_tensors`` as the handler and
  the sessions call it (the one place a reply tensor is made).

``--throughput-boost F`` multiplies the announced throughput (a liar wants clients' traffic;
routes prefer fast servers). Each lie is logged at WARNING as ``HOSTILE ...`` on the server's log.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
from typing import Any

logger = logging.getLogger("hostile")

MODES = ("noise", "identity", "stale", "nan", "huge", "mistyped")
REPLY_MODES = ("nan", "huge", "mistyped")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(hostile options, the serve arguments after ``--``)."""
    if "--" not in argv:
        raise SystemExit("hostile_serve.py: give the serve arguments after --")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="hostile_serve.py")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--every", type=int, default=4, help="stale: lie on every K-th step of a session")
    p.add_argument("--noise", type=float, default=0.03, help="noise: relative weight noise X")
    p.add_argument("--block", type=int, default=None, help="noise: the block index (default: the span's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--throughput-boost", type=float, default=1.0)
    options = p.parse_args(argv[:cut])
    if options.every < 1:
        p.error("--every must be at least 1")
    return options, argv[cut + 1:]


def patch_noise(noise: float, block: int | None, seed: int) -> None:
    """Scale one served block's weights by ``1 + noise * N(0, 1)`` when its handler is made."""
    import torch

    from distconf.server.block_server import BlockServer

    original = BlockServer._make_handler

    @functools.wraps(original)
    def make_handler(self: Any, start: int, modules: list[Any], *args: Any, **kwargs: Any) -> Any:
        index = start if block is None else block
        if start <= index < start + len(modules):
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in modules[index - start].parameters():
                    if p.is_floating_point():
                        factor = 1 + noise * torch.randn(p.shape, generator=generator)
                        p.mul_(factor.to(p.device, p.dtype))
            logger.warning("HOSTILE noise: block %d's weights scaled by 1 + %g * N(0, 1)", index, noise)
        return original(self, start, modules, *args, **kwargs)

    BlockServer._make_handler = make_handler  # type: ignore[method-assign]


def _identity_forward(forward: Any) -> Any:
    @functools.wraps(forward)
    def wrapped(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(hidden_states, *args, **kwargs)
        return (hidden_states, *out[1:])

    return wrapped


def patch_identity() -> None:
    """Make every served block's ``forward`` return its inputs (and the real cache)."""
    from distconf.server.block_server import BlockServer

    original = BlockServer._make_handler

    @functools.wraps(original)
    def make_handler(self: Any, start: int, modules: list[Any], *args: Any, **kwargs: Any) -> Any:
        for m in modules:
            m.forward = _identity_forward(m.forward)
        logger.warning("HOSTILE identity: blocks %d..%d return their inputs", start, start + len(modules) - 1)
        return original(self, start, modules, *args, **kwargs)

    BlockServer._make_handler = make_handler  # type: ignore[method-assign]


def patch_stale(every: int) -> None:
    """Every ``every``-th step of a session replies yesterday's hidden states."""
    from distconf.server.sessions import Sessions

    original = Sessions._run_step

    @functools.wraps(original)
    async def run_step(self: Any, cache: Any, step: Any) -> Any:
        output = await original(self, cache, step)
        n = int(step.hidden.shape[1])
        if n == 0:
            return output
        count = getattr(cache, "_hostile_steps", 0) + 1
        previous = getattr(cache, "_hostile_previous", None)
        cache._hostile_steps, cache._hostile_previous = count, output
        if count % every:
            return output
        if previous is not None and previous.shape[0] == output.shape[0] and previous.shape[1] >= n:
            lie, what = previous[:, -n:].clone(), "its previous reply"
        else:
            lie, what = step.hidden.to(output.dtype).clone(), "the inputs"
        logger.warning("HOSTILE stale: step %d of a session (%d tokens) replied with %s", count, n, what)
        return lie

    Sessions._run_step = run_step  # type: ignore[method-assign]


def _bad_reply(mode: str, tensor: Any, dtype: Any) -> Any:
    import torch
    from hivemind.proto import runtime_pb2

    from distconf.rpc.protocol import serialize_tensors

    if mode == "nan":
        return serialize_tensors([torch.full_like(tensor, float("nan"))], dtype)[0]
    if mode == "huge":
        return serialize_tensors([torch.zeros(12 * 1024 * 1024 // tensor.shape[-1], tensor.shape[-1])], dtype)[0]
    buffer = tensor.to(torch.float16).numpy().tobytes()
    return runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, buffer=buffer, size=tensor.shape,
                              dtype="complex128")


def patch_replies(mode: str) -> None:
    """Make every reply tensor of forward and inference steps bad in the way ``mode`` names."""
    from distconf.server import handler, sessions

    for module in (handler, sessions):
        original = module.serialize_tensors

        def serialize(tensors: Any, dtype: Any = None, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            tensors = list(tensors)
            if len(tensors) != 1 or not tensors[0].is_floating_point() or tensors[0].ndim != 3:
                return _original(tensors, dtype, *args, **kwargs)
            logger.warning("HOSTILE %s: a reply of shape %s", mode, list(tensors[0].shape))
            return [_bad_reply(mode, tensors[0], dtype)]

        module.serialize_tensors = serialize


def patch_throughput(boost: float) -> None:
    """Announce ``boost`` times the measured throughput."""
    from distconf.server import loading

    original = loading.measure_throughput

    @functools.wraps(original)
    def measure(*args: Any, **kwargs: Any) -> Any:
        speed = original(*args, **kwargs)
        return dataclasses.replace(speed, throughput=speed.throughput * boost)

    loading.measure_throughput = measure


def main(argv: list[str] | None = None) -> int:
    """Patch this process's server as ``--mode`` says, then run ``distconf serve`` with the rest."""
    options, serve_args = parse(sys.argv[1:] if argv is None else argv)
    from distconf.threads import apply_thread_policy

    apply_thread_policy("server")  # before torch is imported, as cmd_serve.main does for its own command line
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.mode == "noise":
        patch_noise(options.noise, options.block, options.seed)
    elif options.mode == "identity":
        patch_identity()
    elif options.mode in REPLY_MODES:
        patch_replies(options.mode)
    else:
        patch_stale(options.every)
    if options.throughput_boost != 1.0:
        patch_throughput(options.throughput_boost)
    logger.warning("HOSTILE server: mode %s (%s)", options.mode, vars(options))
    from distconf.cli import cmd_serve

    return cmd_serve.main(serve_args)


if __name__ == "__main__":
    sys.exit(main())
