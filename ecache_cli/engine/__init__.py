"""The engine: KV store, decode state, row bookkeeping, the hook surface and the denoising loop.

Names are exported lazily, so importing a leaf module (``engine.state``, ``engine.rows``,
``engine.hooks``, ``engine.store``) does not import the loop (``engine.core``).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "core", "GenerationResult": "core", "Run": "core", "DecodeConfig": "state",
            "DecodeState": "state", "StepRecord": "state", "KVStore": "store"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
