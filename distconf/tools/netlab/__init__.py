"""A network lab: hosts in Linux network namespaces on an emulated internet, homes behind NAT, slow links.

Used by the tests and benchmarks that cross networks (`tests/test_netlab.py`, `tests/test_lab_swarm.py`,
``benchmarks/bench_wan.py``). Needs root, ``ip`` (iproute2) and ``nft`` (nftables); `Lab` raises
`LabUnavailable` with the reason otherwise. See `distconf.tools.netlab.lab`.
"""

from __future__ import annotations

from distconf.tools.netlab.lab import DEFAULT_INTERNET, Home, Host, Lab, Link
from distconf.tools.netlab.system import LabUnavailable

__all__ = ["DEFAULT_INTERNET", "Home", "Host", "Lab", "LabUnavailable", "Link"]
