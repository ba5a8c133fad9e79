"""The wheel ships the family files, presets and schema, and works from them alone."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.swarm  # builds a wheel (pip, a minute): never in `make test-fast`

REPO = Path(__file__).resolve().parents[1]


def test_wheel_contains_data_and_works(tmp_path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("distconf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for family in ("bloom", "falcon", "llama", "mixtral"):
        assert f"distconf/_data/families/{family}.yaml" in names
    assert "distconf/_data/schemas/family.schema.json" in names
    assert "distconf/_data/presets/tiiuae--falcon-40b.json" in names
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = (
        "import distconf, distconf.loader.data as d\n"
        f"assert str(d.builtin_families_dir()).startswith({str(unpacked)!r}), d.builtin_families_dir()\n"
        "from distconf.cli import main\n"
        "assert main(['validate', '-q']) == 0\n"
        "assert main(['schema', '--check']) == 0\n"
        "cfg = distconf.load_preset('tiiuae/falcon-40b')\n"
        "assert cfg.dht_prefix == 'falcon-40b'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
