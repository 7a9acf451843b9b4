"""Profiles: YAML files of settings, and the one precedence rule (defaults < profile < flags).

A profile is ``profiles/<model>/<task>.yaml`` (written by ``ecache calibrate``) or any YAML file::

    model: tiny
    task: arith
    decode: {gen_length: 256, block_length: 32, steps: 256, threshold: null}
    cache: {policy: entropy, tau: 0.8, recent_k: 64, signal: max-entropy}
    measured: {score: 0.95, speedup: 9.1, date: 2026-11-30, n: 50}   # informational

Unknown sections or keys are errors (ConfigError, exit 2) naming the key. The profiles directory is
``$ECACHE_PROFILES`` if set, else the project's ``profiles/`` folder when running from a checkout
(editable install), else ``./profiles``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from .errors import ConfigError

DECODE_KEYS = {"gen_length", "block_length", "steps", "temperature", "top_k", "top_p", "remasking", "threshold",
               "factor", "ban_eos", "low_eos_confidence", "early_exit"}
CACHE_KEYS = {"policy", "tau", "recent_k", "signal", "block_refresh", "refresh_every"}
SECTIONS = {"model", "task", "decode", "cache", "measured", "note"}


def profiles_dir() -> Path:
    """Where profiles are read from and written to (see the module docstring)."""
    env = os.environ.get("ECACHE_PROFILES")
    if env:
        return Path(env)
    project = Path(__file__).resolve().parent.parent / "profiles"
    if project.is_dir() and (project.parent / "pyproject.toml").exists():
        return project
    return Path.cwd() / "profiles"


def canonical_model_name(name: str) -> str:
    """The folder name used for a model's profiles: the alias, ``tiny`` for the embedded model, or a
    checkpoint directory's base name."""
    if name in ("tiny", "llada-tiny", None):
        return "tiny"
    p = Path(str(name))
    return p.name if p.exists() or "/" in str(name) else str(name)


def profile_path(model: str, task: str) -> Path:
    """``profiles/<model>/<task>.yaml`` for a model name or directory and a task name."""
    return profiles_dir() / canonical_model_name(model) / f"{task}.yaml"


def load_profile(name_or_path: str | Path, model: str | None = None) -> dict:
    """Read and validate a profile given as a file path, ``<model>/<task>``, or a task name of ``model``.

    Returns the parsed dict (sections: model, task, decode, cache, measured, note).
    Raises ConfigError for a missing file (naming where it looked), bad YAML, or unknown keys.
    """
    cand = [Path(name_or_path)]
    if not str(name_or_path).endswith((".yaml", ".yml")):
        cand.append(profiles_dir() / f"{name_or_path}.yaml")
        if model is not None:
            cand.append(profile_path(model, str(name_or_path)))
    path = next((c for c in cand if c.is_file()), None)
    if path is None:
        raise ConfigError(f"profile {str(name_or_path)!r} not found (looked at {', '.join(str(c) for c in cand)}); "
                          "run `ecache calibrate` to write one or pass a YAML file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not readable YAML ({str(e).splitlines()[0]})") from None
    validate_profile(data, path)
    data["_path"] = str(path)
    return data


def validate_profile(data: dict, path: Path | str = "profile") -> None:
    """Reject unknown sections and keys with a ConfigError naming them."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a profile must be a YAML mapping")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{path}: unknown key {k!r}; allowed: {', '.join(sorted(SECTIONS))}")
    from .cache import POLICIES, policy_params  # every registered policy's parameters are cache keys

    cache_keys = CACHE_KEYS.union(*(policy_params(n) for n in POLICIES))
    for section, allowed in (("decode", DECODE_KEYS), ("cache", cache_keys)):
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: '{section}' must be a mapping")
        for k in sec:
            if k not in allowed:
                raise ConfigError(f"{path}: unknown key {section}.{k}; allowed: {', '.join(sorted(allowed))}")


def resolve(defaults: dict, profile: dict | None, flags: dict) -> dict:
    """defaults < profile < flags: a flag given as None does not override."""
    out = dict(defaults)
    for src in (profile or {}, flags):
        out.update({k: v for k, v in src.items() if v is not None})
    return out


def write_profile(path: Path, data: dict, overwrite_same: bool = True) -> None:
    """Write a profile YAML; refuses to overwrite a file that belongs to a different model or task."""
    if path.exists():
        try:
            old = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            old = {}
        if old.get("model") != data.get("model") or old.get("task") != data.get("task") or not overwrite_same:
            raise ConfigError(f"{path} already holds a profile for model {old.get('model')!r} task {old.get('task')!r}; "
                              "move it away or choose another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if not k.startswith("_")}, sort_keys=False))


def dataclass_defaults(cls) -> dict:
    """Field defaults of a dataclass as a dict."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
