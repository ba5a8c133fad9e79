"""Whether an installed third-party library is in the range a compat module was written for.

One home for the rule the compat modules (`distconf.dht.hivemind_compat`,
`distconf.client.hf_generation`) apply before touching a library's private API: a version is
supported when it is a valid version inside the module's specifier set, pre-releases included.
The ranges themselves are written once, in ``pyproject.toml``'s dependencies: `declared_range`
reads them from the installed package's metadata (or from ``pyproject.toml`` beside the source).
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["declared_range", "installed_version", "version_in_range"]


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a pip name), or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_in_range(version: str, specifier: str) -> bool:
    """True when ``version`` is a valid version inside ``specifier`` (e.g. ``">=1.1.12,<1.2"``)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def declared_range(distribution: str) -> str:
    """The version specifier distconf's own dependencies give ``distribution`` (e.g. ``">=1.1.12,<1.2"``).

    Read from the installed package's metadata; from ``pyproject.toml`` next to the source when distconf runs
    uninstalled. A `LookupError` when distconf does not depend on ``distribution``.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        requirements = metadata.requires("distconf") or []
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        requirements = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    for line in requirements:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) == canonicalize_name(distribution) and requirement.marker is None:
            return ",".join(sorted((str(s) for s in requirement.specifier), key=lambda s: not s.startswith(">")))
    raise LookupError(f"distconf declares no dependency on {distribution}")
