"""The distributed model (and its tokenizer) of a command that talks to a swarm, each failure one line.

`open_swarm_model` is what ``distconf generate`` and ``distconf chat`` share: read MODEL
(exit 2 when it cannot be used), join the swarm through the initial peers, and check that a
route through every block exists before the first token is asked for (a swarm without one is
said in one line, exit 1, instead of retrying forever). A model that verifies its servers
(``verify_fraction > 0``) publishes a report of each server it catches to the swarm's DHT
(`distconf.dht.reports.ReportPublisher`, registered as a listener of the model's
verifier); `close_swarm_model` waits briefly for the last report, then shuts the model down.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from distconf.loader.naming import config_num_blocks

__all__ = ["CommandFailed", "REPORT_FLUSH_SECONDS", "open_swarm_model", "check_route", "close_swarm_model",
           "publish_reports", "quiet_verification_log"]

REPORT_FLUSH_SECONDS = 5.0
"""Longest wait, when a command ends, for the report of a server caught just before to be stored."""


CLI_RETRIES = 3
"""Retries of a failed request a command makes before it gives up with one error (the library's default is to keep
trying; ``DISTCONF_MAX_RETRIES`` or a command's own flag say otherwise)."""


class CommandFailed(Exception):
    """A command cannot go on: ``str(exc)`` is the line to print, ``code`` the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def open_swarm_model(args: argparse.Namespace, *, need_tokenizer: bool, **fields: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``args.model`` on the swarm of ``args.initial_peers`` (or the environment's).

    ``fields`` are client config fields (``show_route``, ``max_retries``, ...). The tokenizer
    is None for a model without one, unless ``need_tokenizer`` (then that is a failure).
    Raises `CommandFailed`: code 2 for a missing address or an unusable MODEL, 1 when the
    swarm cannot be joined or has no route. The caller shuts the model down.
    """
    from distconf.loader.mixins import default_initial_peers

    peers = list(args.initial_peers or default_initial_peers())
    if not peers:
        raise CommandFailed("give --initial-peers (or set DISTCONF_INITIAL_PEERS); there is no default swarm", 2)
    from distconf.cli.swarm_args import hub_options
    from distconf.client.model_source import open_client_source
    from distconf.sources import ModelSourceError

    try:
        source = open_client_source(args.model, dht_prefix=args.dht_prefix, hub=hub_options(args))
        tokenizer = source.load_tokenizer()
    except ModelSourceError as exc:
        raise CommandFailed(str(exc), 2) from None
    if need_tokenizer and tokenizer is None:
        raise CommandFailed(f"{args.model} has no tokenizer", 2)
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.errors import SwarmJoinError
    from distconf.loader.mixins import MAX_RETRIES_ENV

    if "max_retries" not in fields and not os.environ.get(MAX_RETRIES_ENV):
        fields["max_retries"] = CLI_RETRIES
    try:
        model = AutoDistributedModelForCausalLM.from_pretrained(source, initial_peers=peers, **fields)
    except ModelSourceError as exc:
        raise CommandFailed(str(exc), 2) from None
    except SwarmJoinError as exc:
        raise CommandFailed(str(exc), 2) from None
    except (OSError, ValueError, TimeoutError) as exc:
        raise CommandFailed(f"cannot join the swarm through {' '.join(peers)}: {exc}") from None
    try:
        check_route(model)
    except CommandFailed:
        model.shutdown()
        raise
    if model.config.verify_fraction > 0:
        publish_reports(model)
    return model, tokenizer


def open_speculation(args: argparse.Namespace, model: Any) -> Any:
    """The speculation factory of ``args`` (`distconf.cli.speculation_args`) for ``model``; `CommandFailed` (code 2)
    when the draft cannot be used. The caller shuts the model down."""
    from distconf.cli.speculation_args import speculation_factory
    from distconf.errors import ModelSourceError

    try:
        return speculation_factory(args, model.config)
    except (ModelSourceError, ValueError, OSError) as exc:
        raise CommandFailed(f"--draft-model / --prompt-lookup: {exc}", 2) from None


def publish_reports(model: Any) -> None:
    """Publish a report to the swarm's DHT for every server ``model``'s spot checks catch."""
    from distconf.dht.reports import ReportPublisher

    publisher = ReportPublisher(model.remote.swarm.dht, model.config.dht_prefix, config_num_blocks(model.config))
    model.remote.verifier.listeners.append(publisher)


def close_swarm_model(model: Any) -> None:
    """Wait (at most `REPORT_FLUSH_SECONDS`) for the reports being published, then shut ``model`` down."""
    from distconf.dht.reports import ReportPublisher

    if model.config.verify_fraction > 0:
        for listener in list(model.remote.verifier.listeners):
            if isinstance(listener, ReportPublisher):
                listener.flush(REPORT_FLUSH_SECONDS)
    model.shutdown()


def check_route(model: Any) -> None:
    """Raise `CommandFailed` (one line) unless the swarm has a chain of servers through all of ``model``'s blocks."""
    from distconf.dht.routing import NoRouteError

    try:
        model.remote.manager.plan_route(inference=True)
    except NoRouteError as exc:
        raise CommandFailed(f"the swarm cannot serve {model.config.dht_prefix!r} now: {exc}") from None


def quiet_verification_log() -> None:
    """Leave the detections to the command: the verifier's own WARNING line would repeat each one (mid-text).

    For ``generate`` and ``chat``, which print every event themselves (``api`` keeps the log line).
    """
    from distconf.client import verifier

    verifier.logger.setLevel(logging.ERROR)
