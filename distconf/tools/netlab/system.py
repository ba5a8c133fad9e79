"""What the network lab asks of the machine: root, ``ip``, ``nft``, TUN devices; and the namespaces it leaves.

Every namespace the lab creates is named ``dcl-<pid>-<name>`` after the process that created it, so a
lab that was killed before it could clean up (SIGKILL, a crash) is swept by the next lab on the machine:
`sweep_stale` deletes the namespaces of processes that no longer exist, and kills what still runs in them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["PREFIX", "LabUnavailable", "check_lab_support", "delete_namespace", "kill_namespace_processes",
           "lab_namespaces", "run", "sweep_stale"]

PREFIX = "dcl-"
"""Name prefix of every namespace a lab creates (``dcl-<pid>-<name>``)."""
COMMAND_TIMEOUT = 20.0


class LabUnavailable(RuntimeError):
    """This machine cannot host the lab (not root, no ``ip``/``nft``, no namespaces or TUN devices): the reason."""


def run(argv: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT, stdin: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run a command and return its result; `RuntimeError` naming it and its stderr when it fails."""
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=stdin, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


def check_lab_support() -> None:
    """Return if the lab can run here, else raise `LabUnavailable` naming what is missing."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        raise LabUnavailable("the network lab needs Linux network namespaces")
    if os.geteuid() != 0:
        raise LabUnavailable("the network lab needs root (network namespaces, TUN devices, nftables)")
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"the network lab needs `{tool}` (Debian: apt-get install {package})")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        os.close(fd)
    except OSError as exc:
        raise LabUnavailable(f"the network lab needs TUN devices: /dev/net/tun: {exc.strerror}") from None
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        raise LabUnavailable(f"cannot create a network namespace: {result.stderr.strip()}")
    try:
        steps = (("ip", "-n", probe, "link", "set", "lo", "up"),
                 ("ip", "-n", probe, "addr", "add", "2001:db8::1/128", "dev", "lo", "nodad"),
                 ("ip", "netns", "exec", probe, "nft", "add", "table", "ip6", "probe"),
                 ("ip", "netns", "exec", probe, "nft", "add", "chain", "ip6", "probe", "post",
                  "{ type nat hook postrouting priority srcnat; }"))
        for step, what in zip(steps, ("a loopback device", "IPv6", "nftables", "nftables NAT for IPv6")):
            result = run(step, check=False)
            if result.returncode != 0:
                raise LabUnavailable(f"the network lab needs {what} in a namespace: {result.stderr.strip()}")
    finally:
        delete_namespace(probe)


def lab_namespaces() -> list[str]:
    """Names of the namespaces labs created (``dcl-*``) that exist now."""
    result = run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(PREFIX)]


def kill_namespace_processes(name: str, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to every process in namespace ``name``; return their pids."""
    result = run(["ip", "netns", "pids", name], check=False)
    pids = [int(p) for p in result.stdout.split() if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def delete_namespace(name: str) -> None:
    """Kill what runs in namespace ``name`` and delete it (its devices go with it); no error if it is gone."""
    kill_namespace_processes(name)
    run(["ip", "netns", "delete", name], check=False)


def sweep_stale() -> list[str]:
    """Delete the lab namespaces whose creating process is gone; return their names."""
    swept = []
    for name in lab_namespaces():
        owner = name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            delete_namespace(name)
            swept.append(name)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
