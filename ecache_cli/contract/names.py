"""The cache policies' names, read from the module files of ``ecache_cli/cache/`` without importing them.

One module per policy: ``cache/x_y.py`` holds the policy ``x-y``. The help of ``--cache`` lists the names
from here (no torch import for ``-h``); ``cache/__init__.py`` builds the registry in the same order.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

ORDER = ("none", "prefix", "dual", "entropy")  # listed first; the rest by name
NOT_POLICIES = ("base",)


def policy_modules() -> list[str]:
    """The policy modules of ``ecache_cli/cache/`` in registry order (``ORDER`` first, then by name)."""
    folder = Path(__file__).resolve().parent.parent / "cache"
    mods = [m.name for m in pkgutil.iter_modules([str(folder)]) if m.name not in NOT_POLICIES
            and not m.name.startswith("_")]
    first = [m for n in ORDER for m in mods if m.replace("_", "-") == n]
    return first + sorted(set(mods) - set(first))


def policy_names() -> list[str]:
    """The registered policy names, e.g. ``["none", "prefix", "dual", "entropy", "d2cache", ...]``."""
    return [m.replace("_", "-") for m in policy_modules()]
