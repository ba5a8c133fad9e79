"""``distconf generate``: generate text (or token ids) through a swarm, printing tokens as they come."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from distconf.cli.helptext import add_command, initial_peers, positive_int

__all__ = ["register", "run", "main", "parse_ids"]


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
                    "through --initial-peers and generate from PROMPT, printing each new token as it arrives. MODEL "
                    "is a Hugging Face model folder as it is (config.json with or without dht_prefix; without, it "
                    "is derived by the family's rule, as the servers do), a folder written by save_pretrained, a "
                    ".gguf file or a folder holding one (converted once into a cache), or a hub id already in the "
                    "local Hugging Face cache. A model without a tokenizer prints token ids; give the prompt as "
                    "--ids 1,2,3 then. A MODEL that cannot be used exits with status 2.",
        examples=[("distconf generate ./model --initial-peers ADDR 'A cat sat'", "greedy, 32 new tokens"),
                  ("distconf generate ./model --initial-peers ADDR --ids 1,2,3 --max-new-tokens 8", "token ids in, "
                   "token ids out"),
                  ("distconf generate ./model --initial-peers ADDR 'Once' --sample --temperature 0.8 --seed 1",
                   "sampling")],
    )
    p.add_argument("model", metavar="MODEL", help="model folder, .gguf file (or a folder holding one), or a cached "
                                                  "hub id")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs a tokenizer in MODEL)")
    p.add_argument("--ids", type=parse_ids, default=None, help="prompt as comma-separated token ids")
    p.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", default=None,
                   help="multiaddrs of swarm peers (default: $DISTCONF_INITIAL_PEERS)")
    p.add_argument("--dht-prefix", default=None, metavar="PREFIX",
                   help="prefix of the model's blocks on the DHT (default: config.json's, else derived from the "
                        "model's name by the family's rule)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within top-p probability mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--no-server-to-server", action="store_true", help="never let servers push to each other")
    p.add_argument("--show-route", action="store_true", help="log the route of the session")
    p.set_defaults(func=run)


class _Printer:
    """A transformers streamer: prints each new token (text, or id when there is no tokenizer)."""

    def __init__(self, tokenizer: Any, prompt_length: int, out: Any) -> None:
        self.tokenizer, self.skip, self.out = tokenizer, prompt_length, out
        self.ids: list[int] = []
        self.printed = ""

    def put(self, value: Any) -> None:
        tokens = value.reshape(-1).tolist()
        if self.skip:  # the first call carries the prompt
            self.skip = 0
            return
        for token in tokens:
            self.ids.append(int(token))
            if self.tokenizer is None:
                self.out.write(f"{token} ")
            else:
                text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
                self.out.write(text[len(self.printed):])
                self.printed = text
            self.out.flush()

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    """Generate and print; exit 2 on bad arguments or an unusable MODEL, 1 if the swarm cannot serve the model."""

    peers = initial_peers(args, "generate")
    if peers is None:
        return 2
    if (args.prompt is None) == (args.ids is None):
        print("distconf generate: give either PROMPT or --ids", file=sys.stderr)
        return 2
    from distconf.client.model_source import open_client_source
    from distconf.sources import ModelSourceError

    try:
        source = open_client_source(args.model, dht_prefix=args.dht_prefix)
        tokenizer = source.load_tokenizer()
    except ModelSourceError as exc:
        print(f"distconf generate: {exc}", file=sys.stderr)
        return 2
    if args.prompt is not None and tokenizer is None:
        print(f"distconf generate: {args.model} has no tokenizer; give the prompt as --ids 1,2,3", file=sys.stderr)
        return 2
    import torch

    from distconf.client import AutoDistributedModelForCausalLM

    ids = torch.tensor([args.ids]) if args.ids is not None else tokenizer(args.prompt, return_tensors="pt").input_ids
    if args.seed is not None:
        torch.manual_seed(args.seed)
    fields: dict[str, Any] = {"initial_peers": peers, "show_route": bool(args.show_route)}
    if args.no_server_to_server:
        fields["use_server_to_server"] = False
    try:
        model = AutoDistributedModelForCausalLM.from_pretrained(source, **fields)
    except ModelSourceError as exc:
        print(f"distconf generate: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TimeoutError) as exc:
        print(f"distconf generate: {exc}", file=sys.stderr)
        return 1
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                           pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
                           streamer=_Printer(tokenizer, ids.shape[1], sys.stdout),
                           **(sampling if args.sample else {"do_sample": False}))
    except Exception as exc:
        print(f"\ndistconf generate: {exc}", file=sys.stderr)
        return 1
    finally:
        model.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m distconf.cli.cmd_generate ...`` (the same as ``distconf generate ...``)."""
    parser = argparse.ArgumentParser(prog="distconf")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
