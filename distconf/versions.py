"""Whether an installed third-party library is in the range a compat module was written for.

One home for the rule the compat modules (`distconf.dht.hivemind_compat`,
`distconf.client.hf_generation`) apply before touching a library's private API: a version is
supported when it is a valid version inside the module's specifier set, pre-releases included.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["installed_version", "version_in_range"]


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
