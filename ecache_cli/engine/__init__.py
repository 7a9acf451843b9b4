"""The engine core: KV store, decode state and the denoising loop."""

from .core import Engine, GenerationResult, Run
from .state import DecodeConfig, DecodeState, StepRecord
from .store import KVStore

__all__ = ["DecodeConfig", "DecodeState", "Engine", "GenerationResult", "KVStore", "Run", "StepRecord"]
