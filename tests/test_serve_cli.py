"""``distconf serve``'s command line and its machine-readable ready line (no process started)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distconf.cli.cmd_serve import READY_TAG, main, parse_blocks, parse_ready_line, ready_line


def test_serve_command_line_errors(tmp_path: Path) -> None:
    assert parse_blocks("2:5") == (2, 5)
    for bad in ("5:2", "a:b", "3"):
        with pytest.raises(argparse.ArgumentTypeError, match="START:END"):
            parse_blocks(bad)
    assert main([str(tmp_path), "--num-blocks", "1"]) == 2  # neither --initial-peers nor --new-swarm
    assert main([str(tmp_path), "--new-swarm"]) == 2  # an empty folder is no model source


def _online_server() -> SimpleNamespace:
    blocks = [SimpleNamespace(module=torch.nn.Linear(3, 2)) for _ in range(2)]  # 8 parameters each
    return SimpleNamespace(peer_id="12D3KooWpeer", maddrs=["/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWpeer"],
                           start_block=2, end_block=4, config=SimpleNamespace(dht_prefix="tiny-llama"),
                           throughput=12.5, handler=SimpleNamespace(ordered=blocks), dtype_name="float32",
                           quant="int8", device="cpu")


def test_ready_line_is_one_json_line_that_parses_back() -> None:
    line = ready_line(_online_server())
    assert "\n" not in line and line.split(" ", 1)[0] == READY_TAG
    record = parse_ready_line(line + "\n")
    assert record == json.loads(line.split(" ", 1)[1])
    assert record == {"peer_id": "12D3KooWpeer", "addresses": ["/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWpeer"],
                      "blocks": [2, 4], "dht_prefix": "tiny-llama", "throughput": 12.5, "parameters": 16,
                      "dtype": "float32", "quant_type": "int8", "device": "cpu"}


def test_other_lines_are_not_ready_lines() -> None:
    assert parse_ready_line("SERVING blocks 0:2 of x as peer p (throughput 1.0)") is None
    assert parse_ready_line("") is None
    with pytest.raises(ValueError, match="malformed"):
        parse_ready_line(f'{READY_TAG} {{"peer_id": "p"}}')
    with pytest.raises(json.JSONDecodeError):
        parse_ready_line(f"{READY_TAG} not json")


def test_serve_help_documents_the_ready_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert f"{READY_TAG} {{json}}" in " ".join(capsys.readouterr().out.split())  # however argparse wraps it
