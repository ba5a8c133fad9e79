"""``--draft-model``, ``--draft-quant``, ``--draft-tokens`` and ``--prompt-lookup``: speculative decoding for the
commands that generate (``generate``, ``chat``, ``api``).

`add_speculation_arguments` adds them; `speculation_factory` turns them into a function making one
`distconf.client.speculative.Speculation` per generation (the draft model is loaded once and shared, and so is
the controller: what it measured carries over to the next reply; each generation has its own draft cache), or
None when none is asked for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from distconf.cli.helptext import positive_int

__all__ = ["add_speculation_arguments", "speculation_factory"]


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the speculative-decoding options."""
    group = parser.add_argument_group(
        "speculative decoding (several tokens per round trip; the same tokens, or the same distribution when "
        "sampling, as without)")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="a small local model with the same tokenizer that proposes tokens (a folder, a .gguf "
                             "file or a hub id in the local cache; e.g. the same model, quantized)")
    source.add_argument("--prompt-lookup", type=positive_int, default=None, metavar="N",
                        help="propose up to N tokens copied from where the context's last words occurred before "
                             "(transformers' prompt_lookup_num_tokens; no draft model)")
    group.add_argument("--draft-quant", default=None, choices=("none", "int8", "nf4"),
                       help="quantize the draft model's layers (default: none)")
    group.add_argument("--draft-tokens", type=positive_int, default=8, metavar="K",
                       help="most tokens the draft model proposes per round (default 8; fewer when they are "
                            "rejected, none while speculating does not pay)")


def speculation_factory(args: argparse.Namespace, target_config: Any) -> Callable[[], Any] | None:
    """A function making one `Speculation` per generation from the parsed options, or None without them.

    Raises `distconf.errors.ModelSourceError` or `ValueError` (a draft that cannot be loaded, or does not fit
    the target, or a family that cannot roll back) before anything is generated.
    """
    from distconf.client.speculative import (
        DraftModel,
        PromptLookup,
        Speculation,
        SpeculationController,
        refusal_for_family,
    )

    if args.draft_model is None and args.prompt_lookup is None:
        return None
    refusal = refusal_for_family(target_config)
    if refusal is not None:
        raise ValueError(refusal)
    if args.prompt_lookup is not None:
        controller = SpeculationController(max_tokens=int(args.prompt_lookup))  # shared: what it measured stays
        return lambda: Speculation(PromptLookup(), controller)
    from distconf.client.draft import check_draft, load_draft_model

    draft = load_draft_model(args.draft_model, quant=args.draft_quant)
    check_draft(draft, target_config)
    controller = SpeculationController(max_tokens=int(args.draft_tokens))
    return lambda: Speculation(DraftModel(draft), controller)
