"""Sum a ``DISTCONF_TEST_CPU_LOG`` file (see conftest.CPU_LOG_ENV) per test file: where the suite's CPU goes.

Usage: ``python tests/cpu_report.py .test-cpu.log [N]`` prints the N (default 30) files of most CPU.
"""

from __future__ import annotations

import sys
from collections import defaultdict


def main(argv: list[str]) -> int:
    """Print CPU seconds, wall seconds and tests per file, most CPU first, and the totals."""
    path, top = argv[0], int(argv[1]) if len(argv) > 1 else 30
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    with open(path, encoding="utf-8") as f:
        for line in f:
            name, _test, spent, took = line.rstrip("\n").split("\t")
            cpu[name] += float(spent)
            wall[name] += float(took)
            count[name] += 1
    total = sum(cpu.values())
    print(f"{'cpu s':>8} {'share':>6} {'wall s':>8} {'tests':>5}  file")
    for name in sorted(cpu, key=cpu.__getitem__, reverse=True)[:top]:
        print(f"{cpu[name]:8.1f} {cpu[name] / total:6.1%} {wall[name]:8.1f} {count[name]:5d}  {name}")
    print(f"{total:8.1f} {'':6} {sum(wall.values()):8.1f} {sum(count.values()):5d}  all {len(cpu)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
