"""The engine: the denoising loop (``core``) and how a step's forwards are grouped (``forward``).

The names users need are exported here lazily, so importing this package costs nothing until one is
used: ``Engine``, ``Run``, ``GenerationResult``, and for convenience ``DecodeConfig`` (decoding/config.py),
``DecodeState``, ``StepRecord`` (contract/state.py) and ``KVStore`` (kvstore.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "ecache_cli.engine.core", "GenerationResult": "ecache_cli.engine.ledger",
            "Run": "ecache_cli.engine.core", "DecodeConfig": "ecache_cli.decoding.config",
            "DecodeState": "ecache_cli.contract.state", "StepRecord": "ecache_cli.contract.state",
            "KVStore": "ecache_cli.kvstore"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
