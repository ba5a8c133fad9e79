"""``distconf chat``: an interactive terminal chat with a model on a swarm (history, streamed replies)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from distconf.cli.helptext import add_command, positive_int
from distconf.cli.speculation_args import add_speculation_arguments
from distconf.cli.swarm_args import (
    adapter_fields,
    add_adapter_argument,
    add_swarm_arguments,
    add_verify_arguments,
    verify_fields,
)
from distconf.loader.naming import config_num_blocks

__all__ = ["register", "run", "main"]



def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``chat`` subcommand."""
    p = add_command(
        subparsers, "chat", summary="chat with a model on a swarm in the terminal",
        description="Load the non-block weights of MODEL (an instruction-tuned model with a chat template; "
                    "any source distconf generate takes), join the swarm through --initial-peers and chat: "
                    "each line you type is a user message, the whole conversation goes through the model's chat "
                    "template, and the reply is printed as it is generated."
                    "\n\n"
                    "Ctrl-C stops the current reply (its inference session is closed, the servers free its "
                    "cache) and the chat goes on; /reset starts a new conversation; /exit or Ctrl-D leaves. "
                    "A MODEL that cannot be used exits with status 2, a swarm that cannot serve it with status 1."
                    "\n\n"
                    "With --verify-fraction F the servers are spot-checked (see distconf generate --help): a "
                    "server caught computing wrong is banned, the reply keeps the honest results, and a one-line "
                    "notice after the reply names the server.",
        examples=[("distconf chat ./SmolLM2-135M-Instruct --initial-peers ADDR", "chat (temperature 0.7)"),
                  ("distconf chat ./model.gguf --initial-peers ADDR --temperature 0", "greedy replies"),
                  ("distconf chat ./model --initial-peers ADDR --system 'Answer in one sentence.'",
                   "a system message first"),
                  ("distconf chat ./model --initial-peers ADDR --dht-prefix my-model --max-tokens 100",
                   "another prefix, shorter replies"),
                  ("distconf chat ./model --initial-peers ADDR --verify-fraction 0.1",
                   "spot-check the servers (a notice names a server caught)")],
    )
    add_swarm_arguments(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="most tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="sample within top-p probability mass (default 0.9)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed of every reply's sampling (default: a fresh one)")
    add_adapter_argument(p)
    add_verify_arguments(p)
    add_speculation_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Chat until /exit or end of input; exit 2 on bad arguments or an unusable MODEL, 1 if the swarm cannot serve."""
    from distconf.cli.chat_repl import ChatRepl
    from distconf.cli.swarm_model import (
        CommandFailed,
        close_swarm_model,
        open_speculation,
        open_swarm_model,
        quiet_verification_log,
    )
    from distconf.client.textgen import Sampling, stream_text

    try:
        sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    except ValueError as exc:
        print(f"distconf chat: {exc}", file=sys.stderr)
        return 2
    fields: dict[str, object] = {"show_route": False,  # a log line per reply would break into the conversation
                                 **verify_fields(args), **adapter_fields(args)}
    try:
        model, tokenizer = open_swarm_model(args, need_tokenizer=True, **fields)
    except CommandFailed as exc:
        print(f"distconf chat: {exc}", file=sys.stderr)
        return exc.code
    try:
        try:
            speculation = open_speculation(args, model)
        except CommandFailed as exc:
            print(f"distconf chat: {exc}", file=sys.stderr)
            return exc.code
        if not getattr(tokenizer, "chat_template", None):
            print(f"distconf chat: {args.model}'s tokenizer has no chat template (not a chat model?); "
                  "use distconf generate for raw prompts", file=sys.stderr)
            return 2
        _enable_line_editing()
        print(f"chatting with {model.config.dht_prefix} ({config_num_blocks(model.config)} blocks on the swarm); "
              "/help for commands, Ctrl-C stops a reply, /exit or Ctrl-D leaves", flush=True)
        quiet_verification_log()  # a log line would break into the reply: a notice follows it instead
        events = model.verification_events if model.config.verify_fraction > 0 else None
        def open_stream(model: Any, tokenizer: Any, ids: list[int], sampling: Sampling) -> Any:
            return stream_text(model, tokenizer, ids, sampling, speculation() if speculation else None)

        return ChatRepl(model, tokenizer, sampling, system=args.system, events=events, open_stream=open_stream).run()
    finally:
        close_swarm_model(model)


def _enable_line_editing() -> None:
    """Arrow keys and history at the prompt when Python has readline (importing it is enough)."""
    try:
        import readline  # noqa: F401
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m distconf.cli.cmd_chat ...`` (the same as ``distconf chat ...``)."""
    if argv is None:  # the process's own command line: choose its threads before torch is imported
        from distconf.threads import apply_thread_policy

        apply_thread_policy("process")
    parser = argparse.ArgumentParser(prog="distconf")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["chat", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
