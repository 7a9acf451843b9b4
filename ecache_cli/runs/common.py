"""Pieces every subcommand shares: settings resolution, prompt reading, JSONL writing, the manifest."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

import torch

from .. import __version__
from ..cache import make_policy, policy_params
from ..cache.entropy import DEFAULT_TAU
from ..config import dataclass_defaults, load_profile, profile_path, resolve
from ..engine.state import DecodeConfig
from ..errors import DataError, UsageError


@dataclass
class Settings:
    """Resolved settings of a run: decoding config, cache policy name and its parameters.

    ``all_cache_params``: every resolved cache setting (defaults < profile < flags) whatever policy it
    belongs to, so a run over several policies (``ecache profile``) gives each the ones it declares.
    """

    decode: DecodeConfig
    cache: str
    cache_params: dict
    profile: str | None = None
    all_cache_params: dict = field(default_factory=dict)

    def policy(self, name: str | None = None, **override):
        """A fresh policy object (``name`` defaults to the resolved cache)."""
        name = name or self.cache
        if name == self.cache:
            params = {**self.cache_params, **override}
        else:
            known = policy_params_or_all(name)
            params = {**{k: v for k, v in self.all_cache_params.items() if k in known}, **override}
        if name == "entropy" and "tau" not in params:
            params["tau"] = self.cache_params.get("tau", DEFAULT_TAU)
        return make_policy(name, **params)

    def as_dict(self) -> dict:
        return {"decode": self.decode.as_dict(), "cache": self.cache, "cache_params": self.cache_params,
                "profile": self.profile}


def resolve_settings(model: str, decode_flags: dict, cache_flags: dict, profile: str | None = None,
                     task: str | None = None) -> Settings:
    """defaults < profile (``--profile``, or ``profiles/<model>/<task>.yaml`` for ``--task``, or the
    model's ``default.yaml``) < flags. Raises ConfigError/UsageError for bad profiles or values."""
    prof = None
    if profile:
        prof = load_profile(profile, model)
    elif task and profile_path(model, task).is_file():
        prof = load_profile(profile_path(model, task))
    elif profile_path(model, "default").is_file():
        prof = load_profile(profile_path(model, "default"))
    p_dec = (prof or {}).get("decode") or {}
    p_cache = dict((prof or {}).get("cache") or {})
    decode = resolve(dataclass_defaults(DecodeConfig), p_dec, decode_flags)
    cache = resolve({"policy": "entropy", "tau": DEFAULT_TAU}, p_cache, cache_flags)
    name = cache.pop("policy")
    params = {k: v for k, v in cache.items() if v is not None and k in policy_params_or_all(name)}
    validate_decode(decode)
    make_policy(name, **params)  # validates name and values early
    return Settings(decode=DecodeConfig(**decode), cache=name, cache_params=params,
                    profile=(prof or {}).get("_path"), all_cache_params={k: v for k, v in cache.items() if v is not None})


def policy_params_or_all(name: str) -> set[str]:
    try:
        return policy_params(name)
    except KeyError:
        from ..cache import POLICIES

        raise UsageError(f"--cache {name!r} is not a cache policy; use one of {', '.join(POLICIES)}") from None


def validate_decode(d: dict) -> None:
    """Range checks for decode settings that the schedule does not check (one-line UsageErrors)."""
    if d.get("temperature") is not None and d["temperature"] < 0:
        raise UsageError(f"--temperature {d['temperature']} must be ≥ 0 (0 = greedy)")
    if d.get("threshold") is not None and d["threshold"] <= 0:
        raise UsageError(f"--threshold {d['threshold']} must be > 0 (Fast-dLLM uses 0.9)")
    if d.get("factor") is not None and d["factor"] <= 0:
        raise UsageError(f"--factor {d['factor']} must be > 0 (Fast-dLLM uses 1.0)")
    # the block schedule and remasking rule, checked here so that a bad flag fails before the model loads
    # (the engine checks them again for library callers)
    from ..decoding.remasking import validate_remasking
    from ..decoding.schedule import default_steps, plan_blocks

    parallel = d.get("threshold") is not None or d.get("factor") is not None
    if d.get("gen_length") is not None and d.get("block_length") is not None:
        plan_blocks(d["gen_length"], d["block_length"], default_steps(d["gen_length"], d.get("steps"), parallel), parallel)
    if d.get("remasking") is not None:
        validate_remasking(d["remasking"], parallel=parallel)


def read_prompts(args: list[str] | None, input_file: Path | None, stdin: IO | None) -> Iterator[tuple[str | list, dict]]:
    """Yield (prompt, record) pairs: arguments first, else ``--input`` JSONL (``prompt`` or ``messages``
    field), else stdin (one prompt per line, blank lines skipped). Raises DataError naming the file and
    line of a malformed record, after every earlier prompt has been yielded."""
    if args:
        for a in args:
            yield a, {"prompt": a}
        return
    if input_file is not None:
        try:
            fh = open(input_file, "rb")  # decoded line by line: a bad byte fails at its line, after earlier ones
        except OSError as e:
            raise DataError(f"--input {input_file}: cannot read ({e.strerror})") from None
        with fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{input_file}:{n}: not UTF-8 text; save the file as UTF-8 JSONL") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{input_file}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
                yield _prompt_of(rec, f"{input_file}:{n}"), rec
        return
    if stdin is not None:
        try:
            for line in stdin:
                line = line.rstrip("\n")
                if line.strip():
                    yield line, {"prompt": line}
        except UnicodeDecodeError:
            raise DataError("stdin: not UTF-8 text; pipe UTF-8 prompts, one per line") from None
        return
    raise UsageError("no prompt given: pass it as an argument, pipe prompts on stdin (one per line) or use --input FILE.jsonl")


def _prompt_of(rec, where: str) -> str | list:
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in rec["messages"]):
        return rec["messages"]
    raise DataError(f"{where}: a record needs a string 'prompt' or a 'messages' list of {{role, content}}")


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Group an iterable into lists of ``size``; an exception from the source is raised only after the
    items read before it have been yielded (so their results get written)."""
    batch = []
    try:
        for x in items:
            batch.append(x)
            if len(batch) == size:
                yield batch
                batch = []
    except Exception:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def write_jsonl(fh: IO, record: dict) -> None:
    """Write one JSON record and flush it at once (nothing is lost if a later record fails)."""
    fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    fh.flush()


def manifest(lm, settings: Settings | None, seed: int | None, extra: dict | None = None) -> dict:
    """Reproducibility manifest: versions, git commit, device, dtype, threads, seed, settings, model."""
    import transformers

    dev = lm.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    return {
        "ecache_version": __version__, "git_commit": _git_commit(), "python": sys.version.split()[0],
        "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform(),
        "device": str(dev), "device_name": device_name, "dtype": str(lm.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "seed": seed, "model": lm.name, "model_path": str(lm.path),
        "model_family": lm.spec.family, "config_sha256": lm.config_hash,
        "settings": settings.as_dict() if settings else None, **(extra or {}),
    }


def _cpu_name() -> str:
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
