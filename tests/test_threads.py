"""The thread policy of distconf's processes: user-set variables win, defaults fill the rest."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distconf.threads import MARKER, SWITCH, apply_thread_policy, machine_cores, policy_defaults, role_threads


def test_defaults_fill_an_empty_environment() -> None:
    env: dict[str, str] = {}
    chosen = apply_thread_policy("server", env)
    assert chosen == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(role_threads("server", machine_cores())),
                      "MKL_NUM_THREADS": str(role_threads("server", machine_cores()))}
    assert env == {**chosen, MARKER: "OMP_WAIT_POLICY,OMP_NUM_THREADS,MKL_NUM_THREADS"}


def test_user_set_variables_are_kept() -> None:
    env = {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}
    chosen = apply_thread_policy("server", env)
    assert env["OMP_NUM_THREADS"] == "7" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    assert set(chosen) == {"MKL_NUM_THREADS"} and env[MARKER] == "MKL_NUM_THREADS"


def test_switch_off_and_numbers() -> None:
    env = {SWITCH: "off"}
    assert apply_thread_policy("process", env) == {} and env == {SWITCH: "off"}
    assert policy_defaults("server", "3")["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match=SWITCH):
        policy_defaults("server", "many")
    assert [role_threads("server", n) for n in (1, 2, 16)] == [1, 1, 8]
    assert role_threads("process", 16) == 16


def test_inherited_defaults_are_chosen_again_for_the_role() -> None:
    parent: dict[str, str] = {}
    apply_thread_policy("process", parent)
    child = dict(parent)
    apply_thread_policy("server", child)
    assert child["OMP_NUM_THREADS"] == str(role_threads("server", machine_cores()))
    parent_off = {**parent, SWITCH: "off"}
    apply_thread_policy("server", parent_off)
    assert parent_off == {SWITCH: "off"}  # off: torch's defaults, not the parent's choices


def test_the_cli_applies_it_before_torch() -> None:
    code = ("import os, sys; sys.argv = ['distconf', 'list']; from distconf.cli import main; main(); "
            "print(os.environ['OMP_NUM_THREADS'], os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    env = {"PATH": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["1", "PASSIVE", "False"]
