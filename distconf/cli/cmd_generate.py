"""``distconf generate``: generate text (or token ids) through a swarm, printing tokens as they come."""

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

__all__ = ["register", "run", "main", "parse_ids", "empty_answer_notice"]


def parse_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids must be comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"--ids must be non-negative token ids, got {text!r}")
    return ids


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    p = add_command(
        subparsers, "generate", summary="generate text through a swarm (blocks on servers, the rest here)",
        description="Load the non-block weights of MODEL (embeddings, final norm, LM head), join the swarm "
                    "through --initial-peers and generate from PROMPT, printing each new token as it arrives. "
                    "PROMPT may stand anywhere on the line (also right after the addresses of --initial-peers), "
                    "or be given as --prompt. MODEL "
                    "is a Hugging Face model folder as it is (config.json with or without dht_prefix; without, it "
                    "is derived by the family's rule, as the servers do), a folder written by save_pretrained, a "
                    ".gguf file or a folder holding one (converted once into a cache), or a hub id already in the "
                    "local Hugging Face cache. A model without a tokenizer prints token ids; give the prompt as "
                    "--ids 1,2,3 then. A MODEL that cannot be used exits with status 2; a swarm that cannot "
                    "serve it, with status 1."
                    "\n\n"
                    "An instruction-tuned model (a chat model) expects its chat template: give --chat, which "
                    "sends PROMPT as the user's message. Without it such a model often ends its answer at once; "
                    "the command then says so on stderr. For a conversation, use distconf chat."
                    "\n\n"
                    "With --verify-fraction F, an independent server of the same blocks recomputes a server's "
                    "first step and then a share F of the steps; a server caught computing wrong is banned, the "
                    "text keeps the honest results, and each detection is printed on stderr after the text (one "
                    "line: the server, its blocks, the step, the size of the difference) and published on the "
                    "swarm's DHT for distconf monitor's page.",
        examples=[("distconf generate ./model --initial-peers ADDR 'A cat sat'", "greedy, 32 new tokens"),
                  ("distconf generate ./chat-model --initial-peers ADDR --chat 'What is the capital of France?'",
                   "through the chat template"),
                  ("distconf generate ./model --initial-peers ADDR --ids 1,2,3 --max-new-tokens 8", "token ids in, "
                   "token ids out"),
                  ("distconf generate ./model --initial-peers ADDR 'Once' --sample --temperature 0.8 --seed 1",
                   "sampling"),
                  ("distconf generate ./model --initial-peers ADDR --verify-fraction 0.1 'A cat sat'",
                   "spot-check the servers (detections on stderr)"),
                  ("distconf generate ./model --initial-peers ADDR --weights-manifest m.json 'A cat sat'",
                   "refuse other weights (m.json: distconf manifest ./model -o m.json)"),
                  ("distconf generate ./model --initial-peers ADDR --draft-model ./model --draft-quant int8 'A cat'",
                   "speculative: the model quantized locally proposes, the swarm checks (same tokens)")],
    )
    add_swarm_arguments(p, prompt=True)
    p.add_argument("--prompt", dest="prompt_option", default=None, metavar="TEXT",
                   help="the prompt, as an option (instead of PROMPT)")
    p.add_argument("--ids", type=parse_ids, default=None, help="prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the tokenizer's chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    p.add_argument("--max-new-tokens", "--max-tokens", type=positive_int, default=32,
                   help="tokens to generate (default 32)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="sample within top-p probability mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--no-server-to-server", action="store_true", help="never let servers push to each other")
    p.add_argument("--show-route", action="store_true", help="log the route of the session")
    add_adapter_argument(p)
    add_verify_arguments(p)
    add_speculation_arguments(p)
    p.set_defaults(func=run)


def _prompt(args: argparse.Namespace) -> str | None:
    """The prompt text (PROMPT or --prompt); raises CommandFailed when the prompt is given twice or not at all."""
    from distconf.cli.swarm_model import CommandFailed

    given = [x for x in (args.prompt, args.prompt_option, args.ids) if x is not None]
    if len(given) != 1:
        raise CommandFailed("give one prompt: PROMPT, --prompt TEXT or --ids 1,2,3", 2)
    if args.chat and args.ids is not None:
        raise CommandFailed("--chat needs a text prompt, not --ids", 2)
    return args.prompt if args.prompt is not None else args.prompt_option


def _input_ids(args: argparse.Namespace, text: str | None, tokenizer: Any) -> list[int]:
    from distconf.cli.swarm_model import CommandFailed
    from distconf.client.textgen import chat_input_ids

    if text is None:
        return list(args.ids)
    if tokenizer is None:
        raise CommandFailed(f"{args.model} has no tokenizer; give the prompt as --ids 1,2,3", 2)
    if not args.chat:
        return [int(i) for i in tokenizer(text)["input_ids"]]
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}]
    try:
        return chat_input_ids(tokenizer, messages)
    except ValueError as exc:
        raise CommandFailed(f"--chat: {exc}", 2) from None


def empty_answer_notice(stream: Any, chat: bool, has_template: bool) -> str | None:
    """Why a finished ``stream`` printed nothing, or None when it printed something (or was not empty)."""
    if stream.text.strip() or stream.finish_reason != "stop":
        return None
    if stream.completion_tokens <= 1:
        why = "the model ended its answer at once (end of sequence as the first token)"
    else:
        why = f"the answer has no printable text ({stream.completion_tokens} tokens, then end of sequence)"
    if not chat and has_template:
        why += "; an instruction-tuned model expects its chat template: add --chat"
    return why


def run(args: argparse.Namespace) -> int:
    """Generate and print; exit 2 on bad arguments or an unusable MODEL, 1 if the swarm cannot serve the model."""
    from distconf.cli.swarm_model import (
        CommandFailed,
        close_swarm_model,
        open_speculation,
        open_swarm_model,
        quiet_verification_log,
    )

    fields: dict[str, Any] = {"show_route": bool(args.show_route), **verify_fields(args), **adapter_fields(args)}
    if args.no_server_to_server:
        fields["use_server_to_server"] = False
    try:
        text = _prompt(args)
        model, tokenizer = open_swarm_model(args, need_tokenizer=False, **fields)
    except CommandFailed as exc:
        print(f"distconf generate: {exc}", file=sys.stderr)
        return exc.code
    quiet_verification_log()  # each event is printed after the text instead
    seen = len(model.verification_events)
    try:
        speculation = open_speculation(args, model)
        return _generate(args, model, tokenizer, text, speculation)
    except CommandFailed as exc:
        print(f"distconf generate: {exc}", file=sys.stderr)
        return exc.code
    finally:
        for event in model.verification_events[seen:]:
            print(f"distconf generate: spot check: {event.describe()}", file=sys.stderr)
        close_swarm_model(model)


def _generate(args: argparse.Namespace, model: Any, tokenizer: Any, text: str | None,
              speculation: Any = None) -> int:
    from distconf.client.textgen import Sampling, stream_text

    ids = _input_ids(args, text, tokenizer)
    try:
        sampling = Sampling(max_tokens=args.max_new_tokens, temperature=args.temperature if args.sample else 0.0,
                            top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed,
                            top_k=args.top_k if args.sample and args.top_k and args.top_k > 0 else None)
    except ValueError as exc:
        print(f"distconf generate: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    spec = speculation() if speculation is not None else None
    stream = stream_text(model, tokenizer, ids, sampling, spec)
    try:
        for piece in stream:
            out.write(piece.text if tokenizer is not None else f"{piece.token_id} ")
            out.flush()
    except Exception as exc:  # the swarm failed mid-way (retries exhausted): one line
        print(f"\ndistconf generate: {exc}", file=sys.stderr)
        return 1
    finally:
        stream.close()
    out.write("\n")
    out.flush()
    notice = empty_answer_notice(stream, args.chat, bool(getattr(tokenizer, "chat_template", None)))
    if notice and tokenizer is not None:
        print(f"distconf generate: {notice}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m distconf.cli.cmd_generate ...`` (the same as ``distconf generate ...``)."""
    if argv is None:  # the process's own command line: choose its threads before torch is imported
        from distconf.threads import apply_thread_policy

        apply_thread_policy("process")
    parser = argparse.ArgumentParser(prog="distconf")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
