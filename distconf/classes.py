"""Home module of the synthesized ``Distributed*Config`` classes.

Every synthesized class has ``__module__ == "distconf.classes"``. Looking a class up
here by name (which is what pickle does) synthesizes it on demand, so configs
unpickle in a fresh process too.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("Distributed") and name.endswith("Config"):
        from distconf.loader import load_family_by_class_name

        return load_family_by_class_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _restore_config(class_name: str, source: str | None) -> Any:
    """Unpickling helper: an empty instance of the named class (state is set after)."""
    from distconf.loader import load_family, load_family_by_class_name

    try:
        cls = load_family_by_class_name(class_name)
    except LookupError:
        if source is None:
            raise
        cls = load_family(source)
    return cls.__new__(cls)
