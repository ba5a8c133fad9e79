"""`distconf.cli.chat_repl` and the argument parsing of ``distconf generate`` / ``distconf chat``, without a swarm.

The REPL runs the real model locally (its own KV cache stands for the swarm's session, as in
tests/test_client_textgen.py): greedy replies are the known answer, the history goes through
the chat template, /reset forgets it, a real SIGINT during a reply stops it (the stream is
closed) and the chat goes on.
"""

from __future__ import annotations

import io
import os
import signal
from typing import Any

import pytest
from real_helpers import local_sessions
from transformers import DynamicCache

from distconf.cli import build_parser
from distconf.cli.chat_repl import HELP, STOPPED, ChatRepl, lines
from distconf.client.textgen import Sampling, TextStream, chat_input_ids, stream_text
from distconf.tools import real_model as rm

GREEDY = Sampling(max_tokens=24, temperature=0)


class _ClosableCache(DynamicCache):
    """A local cache with the ``close`` a remote session has."""

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(real_tokenizer: Any) -> Any:
    return real_tokenizer


@pytest.fixture(scope="module")
def model(real_local: Any) -> Any:
    with local_sessions(real_local, _ClosableCache) as local:
        yield local


class Recorder:
    """Opens streams with `stream_text` and keeps each (prompt ids, stream)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], TextStream]] = []

    def __call__(self, model: Any, tokenizer: Any, ids: list[int], sampling: Sampling) -> TextStream:
        stream = stream_text(model, tokenizer, ids, sampling)
        self.calls.append((ids, stream))
        return stream


def _repl(model: Any, tokenizer: Any, *typed: str, sampling: Sampling = GREEDY, out: Any = None,
          system: str | None = None) -> tuple[ChatRepl, Recorder, Any]:
    recorder, out = Recorder(), out if out is not None else io.StringIO()
    repl = ChatRepl(model, tokenizer, sampling, system=system, read=lines(*typed), out=out, open_stream=recorder)
    return repl, recorder, out


def test_a_question_gets_the_known_answer_and_the_history_grows(model: Any, tokenizer: Any) -> None:
    repl, recorder, out = _repl(model, tokenizer, rm.QUESTION, "And of Germany?", "/exit", "never read")
    assert repl.run() == 0
    assert rm.ANSWER in out.getvalue()
    first, second = recorder.calls[0][0], recorder.calls[1][0]
    assert first == rm.chat_ids(tokenizer)[0].tolist()  # the template over the one user message
    history = [{"role": "user", "content": rm.QUESTION}, {"role": "assistant", "content": rm.ANSWER},
               {"role": "user", "content": "And of Germany?"}]
    assert second == chat_input_ids(tokenizer, history)
    assert len(repl.conversation.turns) == 4
    assert len(recorder.calls) == 2  # nothing read after /exit


def test_reset_forgets_and_commands_are_not_sent(model: Any, tokenizer: Any) -> None:
    repl, recorder, out = _repl(model, tokenizer, rm.QUESTION, "/reset", "/help", "/nope", "  ", rm.QUESTION,
                                system="You are terse.")
    assert repl.run() == 0  # end of input leaves
    assert len(recorder.calls) == 2
    assert recorder.calls[0][0] == recorder.calls[1][0]  # the same fresh conversation twice
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": rm.QUESTION}]
    assert recorder.calls[0][0] == chat_input_ids(tokenizer, messages)
    text = out.getvalue()
    assert "(a new conversation)" in text and HELP in text and "unknown command /nope" in text


class _InterruptAfter(io.StringIO):
    """Output that sends this process a real SIGINT once ``after`` characters of a reply were written."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.sent = after, False

    def write(self, text: str) -> int:
        n = super().write(text)
        if not self.sent and len(self.getvalue()) >= self.after:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return n


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(model: Any, tokenizer: Any) -> None:
    long = Sampling(max_tokens=200, temperature=0)
    before = signal.getsignal(signal.SIGINT)
    repl, recorder, out = _repl(model, tokenizer, "Write a long story about a dragon.", rm.QUESTION,
                                sampling=long, out=_InterruptAfter(20))
    assert repl.run() == 0
    stopped, then = recorder.calls[0][1], recorder.calls[1][1]
    assert stopped.finish_reason is None and stopped.completion_tokens < 200  # closed early
    assert STOPPED in out.getvalue()
    assert repl.conversation.turns[1] == {"role": "assistant", "content": stopped.text.strip()}  # kept, cut
    assert then.finish_reason == "stop" and then.text.strip()  # the next question is answered
    assert signal.getsignal(signal.SIGINT) is before  # the handler is only set during a reply


def test_ctrl_c_at_the_prompt_does_not_leave(model: Any, tokenizer: Any) -> None:
    typed = iter([KeyboardInterrupt, "/exit"])

    def read(prompt: str) -> str:
        item = next(typed)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return str(item)

    out = io.StringIO()
    assert ChatRepl(model, tokenizer, GREEDY, read=read, out=out).run() == 0
    assert HELP in out.getvalue()


# ------------------------------------------------------------------ where PROMPT may stand

ADDR = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWExample"


@pytest.mark.parametrize("argv", [
    ["./m", "--initial-peers", ADDR, "A cat sat"],  # the documented example
    ["./m", "A cat sat", "--initial-peers", ADDR],
    ["--initial-peers", ADDR, "./m", "A cat sat"],
    ["./m", "--initial-peers", ADDR, "--max-new-tokens", "3", "A cat sat"],
    ["./m", "--max-new-tokens", "3", "--initial-peers", ADDR, "--chat", "A cat sat"],
])
def test_generate_prompt_may_stand_anywhere(argv: list[str]) -> None:
    args = build_parser().parse_args(["generate", *argv])
    assert (args.model, args.prompt, args.initial_peers) == ("./m", "A cat sat", [ADDR])


def test_generate_takes_several_peers_and_prompt_option() -> None:
    args = build_parser().parse_args(["generate", "./m", "--initial-peers", ADDR, ADDR + "2", "--prompt", "Hi"])
    assert args.initial_peers == [ADDR, ADDR + "2"] and args.prompt is None and args.prompt_option == "Hi"


@pytest.mark.parametrize("argv", [
    ["generate", "--initial-peers", ADDR],  # no MODEL
    ["generate", "./m", "--initial-peers", ADDR, "one", "two"],  # a third positional
    ["generate", "./m", "--initial-peers", "not-an-address"],
    ["chat", "./m", "--initial-peers", ADDR, "a prompt"],  # chat takes none
])
def test_bad_lines_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_generate_refuses_two_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    from distconf.cli.cmd_generate import main

    assert main(["./m", "P", "--prompt", "Q", "--initial-peers", ADDR]) == 2
    assert capsys.readouterr().err == "distconf generate: give one prompt: PROMPT, --prompt TEXT or --ids 1,2,3\n"
