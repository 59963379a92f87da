"""The package probe: versions of the packages the prompt names, read from metadata directory names."""

from __future__ import annotations

import os

PACKAGES = {  # import name -> distribution name as its metadata directory spells it (lowercased)
    "numpy": "numpy",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
    "openpyxl": "openpyxl",
    "PIL": "pillow",
    "scipy": "scipy",
}

_VERSION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+!")


def _is_version(text: str) -> bool:
    return 0 < len(text) <= 64 and text[0].isascii() and text[0].isalnum() and _VERSION_CHARS.issuperset(text)


def package_versions(paths: list[str]) -> dict[str, str | None]:
    """Versions of PACKAGES from the names of their metadata directories on ``paths``, first hit wins
    as for import. Listing a few directories costs well under a millisecond; importlib.metadata costs
    tens of milliseconds to import, and importing the packages themselves, seconds."""
    wanted = {dist: name for name, dist in PACKAGES.items()}
    found: dict[str, str] = {}
    for entry in paths:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for item in names:
            if not item.endswith((".dist-info", ".egg-info")):
                continue
            parts = item[: item.rindex(".")].split("-")
            name = wanted.get(parts[0].lower())
            # A version is a short run of safe characters; anything else (a name that is not UTF-8
            # comes back with surrogates) would make the host refuse the whole "ready".
            if name is not None and len(parts) >= 2 and name not in found and _is_version(parts[1]):
                found[name] = parts[1]
    return {name: found.get(name) for name in PACKAGES}
