"""The reproducibility manifest of a run: versions, git commit, machine, dtype, threads, seed, settings."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

from .. import __version__
from .settings import Settings


def manifest(lm, settings: Settings | None, seed: int | None, extra: dict | None = None) -> dict:
    """Reproducibility manifest: versions, git commit, device, dtype, threads, seed, settings, model,
    how model-written code was isolated (``sandbox``: mode and programs per isolation; None if none ran)
    and the compiled step's graphs and compile seconds (``compile``: ``CompileStats.as_dict``; None
    without ``--compile``)."""
    import transformers

    from ..models.compiled import compile_report
    from ..tasks.sandbox import manifest_entry as sandbox_manifest

    dev = lm.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {
        "ecache_version": __version__, "git_commit": _git_commit(), "python": sys.version.split()[0],
        "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform(),
        "device": str(dev), "device_name": device_name, "dtype": str(lm.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "seed": seed, "model": lm.name, "model_path": str(lm.path),
        "model_family": lm.spec.family, "config_sha256": lm.config_hash,
        "settings": settings.as_dict() if settings else None, "sandbox": sandbox_manifest(),
        "compile": compile_report(lm.model), "quantize": _quantization(lm.model), **(extra or {}),
    }


def _quantization(model) -> str:
    """The weights' ``--quantize`` format (``int8``, ``int4:64``...), ``none`` for weights as stored."""
    q = getattr(model, "quantization", None)
    return "none" if q is None else str(q)


def cpu_name() -> str:
    """The CPU model ("AMD EPYC ..."): /proc/cpuinfo on Linux, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
