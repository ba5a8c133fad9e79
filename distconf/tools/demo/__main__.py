"""``python -m distconf.tools.demo [serve ...]``: run the local swarm demo, or one server of it."""

from __future__ import annotations

import argparse
import logging
import sys

from distconf.threads import apply_thread_policy
from distconf.tools.demo.orchestrator import run_swarm_demo
from distconf.tools.demo.server import serve

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the demo (``--servers``, ``--family``, ``--timeout``, ``--workdir``, ``--no-real-model``, ``--json``).

    ``serve ...`` runs one tiny-model server of it instead.
    """
    if argv is None:  # the process's own command line: choose its threads before torch is imported
        apply_thread_policy("server" if sys.argv[1:2] == ["serve"] else "process")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(prog="python -m distconf.tools.demo",
                                description="A local swarm on 127.0.0.1 serving a tiny model, then the real "
                                            "model from its GGUF (see `distconf demo`).")
    p.add_argument("--servers", type=int, default=3, help="server processes to start (default: 3)")
    p.add_argument("--family", default=None, help="family of the tiny model (default: first with a tiny_config)")
    p.add_argument("--timeout", type=float, default=480.0, help="hard bound on the whole demo, seconds (default 480)")
    p.add_argument("--workdir", default=None, help="where to write the checkpoint and server logs (default: temp)")
    p.add_argument("--no-real-model", action="store_true", help="skip the real model (GGUF) stage")
    p.add_argument("--json", metavar="FILE", default=None, help="write a JSON summary of the run to FILE")
    args = p.parse_args(argv)
    return run_swarm_demo(args.servers, family=args.family, workdir=args.workdir, timeout=args.timeout,
                          real_model=not args.no_real_model, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
