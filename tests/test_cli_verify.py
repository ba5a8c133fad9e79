"""The spot-check options of ``distconf generate``, ``chat`` and ``api``: help, examples, values passed through.

No swarm: the options are parsed by the real parser and turned into the client config
fields the model is built with (`distconf.cli.swarm_args.verify_fields`); the chat notice
is shown by the real REPL. The swarm end to end is tests/test_verify_report_swarm.py.
"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

from distconf.cli import build_parser
from distconf.cli.chat_repl import ChatRepl, event_notice, lines
from distconf.cli.swarm_args import verify_fields
from distconf.client.textgen import Sampling
from distconf.client.verify_events import VerificationEvent
from distconf.loader.mixins import ClientConfig

COMMANDS = ("generate", "chat", "api")
ADDR = "/ip4/127.0.0.1/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
LIAR = "12D3KooWGGcsZBGHa9Yej7S1Yn8dx3J55ESVKZGmXn4uxrYKbtPT"


def help_text(command: str) -> str:
    """What ``distconf COMMAND --help`` prints."""
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.choices).choices[command]
    return sub.format_help()


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_options(command: str) -> None:
    text = help_text(command)
    for option in ("--verify-fraction F", "--verify-tolerance T", "--weights-manifest FILE"):
        assert option in text
    assert "verification:" in text and "--verify-fraction 0.1" in text.split("examples:")[1]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_examples_parse_as_written(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example using the options parses (ADDR a multiaddr, the manifest file present) into config fields."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.json").write_text("{}")
    examples = [line.strip().split("  ")[0] for line in help_text(command).split("examples:")[1].splitlines()
                if re.search(r"--verify|--weights-manifest", line)]
    assert examples
    for example in examples:
        words = shlex.split(example.replace("ADDR", ADDR))
        assert words[:2] == ["distconf", command]
        args = build_parser().parse_args(words[1:])
        fields = verify_fields(args)
        if "--verify-fraction" in example:
            assert fields["verify_fraction"] == 0.1
        if "--weights-manifest" in example:
            assert fields["weights_manifest"] == str(tmp_path / "m.json")
        assert ClientConfig(initial_peers=[ADDR], **fields).verify_fraction == fields.get("verify_fraction", 0.0)


@pytest.mark.parametrize("command", COMMANDS)
def test_values_pass_through_and_bad_ones_exit_2(command: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "model.manifest.json"
    manifest.write_text("{}")
    args = build_parser().parse_args([command, "./model", "--initial-peers", ADDR, "--verify-fraction", "0.25",
                                      "--verify-tolerance", "0.003", "--weights-manifest", str(manifest)])
    assert verify_fields(args) == {"verify_fraction": 0.25, "verify_tolerance": 0.003,
                                   "weights_manifest": str(manifest)}
    assert verify_fields(build_parser().parse_args([command, "./model"])) == {}  # nothing given: the defaults
    for bad in (["--verify-fraction", "1.5"], ["--verify-fraction", "nan"], ["--verify-tolerance", "0"],
                ["--verify-tolerance", "inf"], ["--weights-manifest", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([command, "./model", *bad])
        assert exited.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_chat_announces_each_server_caught_during_a_reply() -> None:
    """The REPL names, in one line after the reply, every event the model recorded while it ran."""
    events: list[VerificationEvent] = [VerificationEvent(LIAR, 0, 4, 0, 0, 9.0, 0.01, ())]  # before: not shown
    caught = VerificationEvent(LIAR, 4, 8, 2, 5, 0.3, 0.01, ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",))

    def open_stream(model, tokenizer, ids, sampling):  # the reply fails after the verifier caught a server
        events.append(caught)
        raise ConnectionError("the swarm went away")

    class Template:  # the chat template is all the REPL asks of a tokenizer here
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, **kwargs):
            return {"input_ids": [1, 2, 3]}

    out = io.StringIO()
    repl = ChatRepl(None, Template(), Sampling(max_tokens=4), read=lines("Hi", "Hi again"), out=out,
                    open_stream=open_stream, events=events)
    assert repl.run() == 0
    shown = [line for line in out.getvalue().splitlines() if line.startswith("(spot check:")]
    assert shown == [event_notice(caught)] * 2  # one line per new event, after each reply
    assert "blocks 4..7 wrong" in shown[0] and "banned" in shown[0] and LIAR[-6:] in shown[0]
