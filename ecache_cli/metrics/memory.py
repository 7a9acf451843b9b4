"""Peak memory of one engine run: CUDA peak allocated on a GPU, peak resident set size on CPU.

CUDA: ``torch.cuda.reset_peak_memory_stats`` before the run, ``max_memory_allocated`` after (bytes of
tensors, the caching allocator's own reserve excluded). CPU: the process's resident set size. On Linux
the kernel's high-water mark (VmHWM) is reset before the run by writing 5 to /proc/self/clear_refs and
read after it, which gives the true peak RSS of the run; elsewhere (or when that file is not writable)
psutil's RSS read right after the run, while the KV store is still allocated. Both RSS numbers include
the model weights and the Python runtime, so they compare policies on one machine, not across machines.
Resets and reads happen outside the timed region. ``growth_bytes()`` is the peak minus what was in use
at ``reset()`` (CUDA: allocated bytes; CPU: RSS): what the run itself added on top of the loaded weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class MemoryProbe:
    """``reset()`` before a run, ``peak_bytes()`` after it; ``kind`` says what is measured."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.kind = "cuda_peak_allocated"
        elif self._hwm_resettable():
            self.kind = "peak_rss"
        else:
            self.kind = "rss_after_run"

    @staticmethod
    def _hwm_resettable() -> bool:
        try:
            _CLEAR_REFS.write_text("5")
            return _read_hwm() is not None
        except OSError:
            return False

    base: int | None = None  # bytes in use at reset() (CUDA allocated, CPU RSS)

    def reset(self) -> None:
        if self.kind == "cuda_peak_allocated":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = int(torch.cuda.memory_allocated(self.device))
            return
        if self.kind == "peak_rss":
            _CLEAR_REFS.write_text("5")
        self.base = current_rss()

    def growth_bytes(self, peak: int | None = None) -> int | None:
        """The peak since ``reset`` (``peak``: :meth:`peak_bytes` already read) minus the bytes in use at
        ``reset``, at least 0; None when either is unknown."""
        peak = self.peak_bytes() if peak is None else peak
        if peak is None or self.base is None:
            return None
        return max(0, peak - self.base)

    def peak_bytes(self) -> int | None:
        """Bytes since the last ``reset`` (see the module docstring), or None if nothing can be read."""
        if self.kind == "cuda_peak_allocated":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "peak_rss":
            return _read_hwm()
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - psutil missing or unsupported platform: report unknown
            return None


def current_rss() -> int | None:
    """This process's resident set size in bytes (VmRSS on Linux, else psutil), or None."""
    try:
        m = re.search(r"VmRSS:\s+(\d+)\s*kB", _STATUS.read_text())
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported platform: report unknown
        return None


def _read_hwm() -> int | None:
    """VmHWM of this process in bytes (Linux), or None."""
    try:
        m = re.search(r"VmHWM:\s+(\d+)\s*kB", _STATUS.read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None
