"""The machines of a network lab: hosts (network namespaces) and homes (NAT routers with a LAN behind them)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["Home", "Host"]


class Host:
    """A machine of the lab: a network namespace with one address others can (or, behind NAT, cannot) dial."""

    def __init__(self, lab: Any, name: str, namespace: str, address: str, home: Home | None) -> None:
        self.lab, self.name, self.namespace, self.address, self.home = lab, name, namespace, address, home

    @property
    def public(self) -> bool:
        """Whether the host is directly on the internet (not behind a home's NAT)."""
        return self.home is None

    @property
    def ip_version(self) -> int:
        """4 or 6: the family of the host's address."""
        return ipaddress.ip_address(self.address).version

    def maddr(self, port: int, transport: str = "tcp") -> str:
        """The multiaddr of ``port`` on this host's address (``/ip6/ADDR/tcp/PORT``)."""
        return f"/ip{self.ip_version}/{self.address}/{transport}/{port}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host (in a process group of its own); the lab stops it at close."""
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.lab.track(process)
        return process

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True, **kwargs: Any
            ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the host and wait (at most ``timeout`` s) for its result (text output)."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(argv), timeout=timeout, check=check, text=True, **kwargs)

    def python(self, code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` (``python -c``) inside the host with this interpreter."""
        return self.run([sys.executable, "-c", code, *args], timeout=timeout)

    def __repr__(self) -> str:
        where = f" behind {self.home.name}" if self.home else ""
        return f"<Host {self.name} {self.address}{where}>"


class Home:
    """A home network: a NAT router on the internet (``address``) and hosts on its private LAN behind it."""

    def __init__(self, lab: Any, name: str, namespace: str, address: str, lan: Any) -> None:
        self.lab, self.name, self.namespace, self.address, self.lan = lab, name, namespace, address, lan
        self.hosts: list[Host] = []

    def __repr__(self) -> str:
        return f"<Home {self.name} {self.address} lan {self.lan}>"
