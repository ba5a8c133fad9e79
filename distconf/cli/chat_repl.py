"""The read-reply loop of ``distconf chat``: a conversation through the chat template, replies streamed.

Each user line is appended to the conversation; the whole conversation goes through the
tokenizer's chat template into a new inference session (`distconf.client.textgen.stream_text`),
whose pieces are printed as they arrive. Ctrl-C during a reply stops it: the first one closes
the reply's session (the servers free its cache) and the loop keeps the text so far as the
assistant's turn; a second Ctrl-C while the step in flight still runs interrupts it at once.
Commands: ``/reset`` (a new conversation, the system message kept), ``/exit`` (also
``/quit`` and end of input), ``/help``. When the model verifies its servers, each server
its spot checks caught during a reply is named in a one-line notice after the reply.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from distconf.client.textgen import Sampling, TextStream, chat_input_ids, stream_text

__all__ = ["Conversation", "ChatRepl", "HELP", "STOPPED", "lines", "event_notice"]

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"
"""The line ``/help`` prints."""
STOPPED = "[stopped]"
"""Printed after a reply cut short by Ctrl-C."""


class Conversation:
    """The messages of one chat: an optional system message, then user and assistant turns."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        """All messages, as the chat template takes them."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def add(self, role: str, content: str) -> None:
        """Append one turn."""
        self.turns.append({"role": role, "content": content})

    def drop_last(self) -> None:
        """Forget the last turn (a user message whose reply failed)."""
        if self.turns:
            self.turns.pop()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.turns.clear()


StreamOpener = Callable[[Any, Any, list[int], Sampling], TextStream]


def event_notice(event: Any) -> str:
    """The terminal's one line for a server caught computing wrong (a `VerificationEvent`)."""
    return f"(spot check: {event.describe()}; the reply keeps the honest results)"


class ChatRepl:
    """The loop: read a line, run a command or reply to it, until ``/exit`` or end of input.

    :param model: the distributed model (anything `stream_text` takes).
    :param tokenizer: its tokenizer, with a chat template.
    :param sampling: how replies are generated (``max_tokens`` per reply).
    :param system: a system message opening the conversation.
    :param read: reads one line given the prompt (default `input`); raises EOFError at the end.
    :param out: where replies and notices go.
    :param open_stream: starts one reply (default `stream_text`).
    :param events: the model's ``verification_events`` when it verifies its servers: the
        events added during a reply are announced after it (None: nothing to announce).
    """

    prompt = "> "

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, *, system: str | None = None,
                 read: Callable[[str], str] = input, out: TextIO | None = None,
                 open_stream: StreamOpener = stream_text, events: list[Any] | None = None) -> None:
        import sys

        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.conversation = Conversation(system)
        self.read, self.out = read, out if out is not None else sys.stdout
        self.open_stream = open_stream
        self.events = events
        self.events_seen = len(events) if events is not None else 0

    def say(self, text: str) -> None:
        """Write a line to the terminal."""
        self.out.write(text + "\n")
        self.out.flush()

    def run(self) -> int:
        """Loop until ``/exit`` or end of input; returns the exit status (0)."""
        while True:
            try:
                line = self.read(self.prompt)
            except EOFError:
                self.say("")
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, not an exit
                self.say(f"\n({HELP})")
                continue
            if not self.handle(line):
                return 0

    def handle(self, line: str) -> bool:
        """Run one input line; False when the chat should end."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                return False
            if command == "/reset":
                self.conversation.reset()
                self.say("(a new conversation)")
            elif command == "/help":
                self.say(HELP)
            else:
                self.say(f"unknown command {command}: {HELP}")
            return True
        self.reply(text)
        return True

    def reply(self, text: str) -> str:
        """Answer ``text`` (streamed to ``out``); the answer, or what was printed of it, is kept in the history.

        Then one notice per server the spot checks caught meanwhile.
        """
        try:
            return self._reply(text)
        finally:
            if self.events is not None:
                for event in self.events[self.events_seen:]:
                    self.say(event_notice(event))
                self.events_seen = len(self.events)

    def _reply(self, text: str) -> str:
        self.conversation.add("user", text)
        try:
            stream = self.open_stream(self.model, self.tokenizer,
                                      chat_input_ids(self.tokenizer, self.conversation.messages()), self.sampling)
        except Exception as exc:  # the session could not open (no route, the swarm gone): one line
            self.conversation.drop_last()
            self.say(f"(no reply: {exc})")
            return ""
        stopped = False
        try:
            with _stop_on_interrupt(stream) as interrupted:
                for piece in stream:
                    self.out.write(piece.text)
                    self.out.flush()
            stopped = interrupted()
        except KeyboardInterrupt:  # the second Ctrl-C, or one outside the main thread's handler
            stopped = True
        except Exception as exc:  # a step failed after the retries: the chat goes on
            stream.close()
            self.conversation.drop_last()
            self.say(f"\n(the reply failed: {exc})")
            return ""
        finally:
            stream.close()
        answer = stream.text.strip()
        self.say(f" {STOPPED}" if stopped else "")
        if answer:
            self.conversation.add("assistant", answer)
        else:
            self.conversation.drop_last()
            if not stopped:
                self.say("(the model ended its reply at once)")
        return answer


class _stop_on_interrupt:
    """While open, the first SIGINT closes ``stream`` (it ends after the step in flight); a second one raises.

    Outside the main thread (where signal handlers cannot be set) Ctrl-C raises KeyboardInterrupt as usual.
    """

    def __init__(self, stream: TextStream) -> None:
        self.stream = stream
        self.count = 0
        self.previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt
        self.stream.close()

    def __enter__(self) -> Callable[[], bool]:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return lambda: self.count > 0

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def lines(*texts: str) -> Callable[[str], str]:
    """A ``read`` for `ChatRepl` that returns ``texts`` one by one, then raises EOFError (scripts, tests)."""
    it: Iterator[str] = iter(texts)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read
