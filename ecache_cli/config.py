"""Profiles: YAML files of settings, and the one precedence rule (defaults < profile < flags).

A profile is ``profiles/<model>/<task>.yaml`` (written by ``ecache calibrate``) or any YAML file::

    model: tiny
    task: arith
    decode: {gen_length: 256, block_length: 32, steps: 256, threshold: null}
    cache: {policy: entropy, tau: 0.8, recent_k: 64, signal: max-entropy}
    measured: {score: 0.95, speedup: 9.1, date: 2026-11-30, n: 50}   # informational
    sandbox: strict   # optional: how model-written code is isolated (tasks/sandbox.py; --sandbox overrides)

Unknown sections or keys are errors (ConfigError, exit 2) naming the key.

Where profiles live (no command ever writes into the package or a checkout's tracked files):
- written by ``ecache calibrate``: ``./profiles/<model>/<task>.yaml`` of the current directory
  (``$ECACHE_PROFILES`` replaces ``./profiles``), or ``--out``;
- looked up, first found wins (:func:`profile_dirs`): ``--profile FILE|NAME``, then ``./profiles``
  (or ``$ECACHE_PROFILES``), then the user's config folder (``platformdirs.user_config_dir("ecache")``
  + ``/profiles``: ``$XDG_CONFIG_HOME/ecache/profiles``, by default ``~/.config/ecache/profiles`` on
  Linux), then the profiles shipped in the package (``ecache_cli/profiles``, read-only).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from .errors import ConfigError

DECODE_KEYS = {"gen_length", "block_length", "steps", "temperature", "top_k", "top_p", "remasking", "threshold",
               "factor", "ban_eos", "low_eos_confidence", "early_exit", "schedule", "compat", "eps", "alg_temp"}
CACHE_KEYS = {"policy", "tau", "recent_k", "signal", "block_refresh", "refresh_every"}
SECTIONS = {"model", "task", "decode", "cache", "measured", "note", "sandbox"}
SANDBOX_MODES = ("strict", "auto", "guard")  # tasks/sandbox.py MODES: how model-written code is isolated


def profiles_dir() -> Path:
    """Where ``ecache calibrate`` writes profiles: ``$ECACHE_PROFILES`` if set, else ``./profiles``
    of the current directory (looked up first as well)."""
    env = os.environ.get("ECACHE_PROFILES")
    return Path(env) if env else Path.cwd() / "profiles"


def user_profiles_dir() -> Path:
    """The user's own profiles: ``<user config dir>/profiles`` (platformdirs: ``$XDG_CONFIG_HOME/ecache``,
    by default ``~/.config/ecache`` on Linux, ``~/Library/Application Support/ecache`` on macOS)."""
    from platformdirs import user_config_dir

    return Path(user_config_dir("ecache", appauthor=False)) / "profiles"


def packaged_profiles_dir() -> Path:
    """The profiles shipped inside the package (read-only; never written)."""
    return Path(__file__).resolve().parent / "profiles"


def profile_dirs() -> list[Path]:
    """The profile folders in lookup order: ./profiles (or $ECACHE_PROFILES), the user's, the package's."""
    return [profiles_dir(), user_profiles_dir(), packaged_profiles_dir()]


def canonical_model_name(name: str) -> str:
    """The folder name used for a model's profiles: the alias, ``tiny`` for the embedded model, or a
    checkpoint directory's base name."""
    if name in ("tiny", "llada-tiny", None):
        return "tiny"
    p = Path(str(name))
    return p.name if p.exists() or "/" in str(name) else str(name)


def profile_path(model: str, task: str) -> Path:
    """Where a profile of (model, task) is written: ``./profiles/<model>/<task>.yaml`` (profiles_dir)."""
    return profiles_dir() / canonical_model_name(model) / f"{task}.yaml"


def profile_candidates(model: str, task: str) -> list[Path]:
    """``<dir>/<model>/<task>.yaml`` for every folder of :func:`profile_dirs`, in lookup order."""
    return [d / canonical_model_name(model) / f"{task}.yaml" for d in profile_dirs()]


def find_profile(model: str, task: str) -> Path | None:
    """The first existing profile of (model, task) in lookup order, or None."""
    return next((c for c in profile_candidates(model, task) if c.is_file()), None)


def load_profile(name_or_path: str | Path, model: str | None = None) -> dict:
    """Read and validate a profile given as a file path, ``<model>/<task>``, or a task name of ``model``.

    Returns the parsed dict (sections: model, task, decode, cache, measured, note).
    Raises ConfigError for a missing file (naming where it looked), bad YAML, or unknown keys.
    """
    cand = [Path(name_or_path)]
    if not str(name_or_path).endswith((".yaml", ".yml")):
        for d in profile_dirs():  # NAME = <model>/<task> or a task of ``model``, first found wins
            cand.append(d / f"{name_or_path}.yaml")
            if model is not None:
                cand.append(d / canonical_model_name(model) / f"{name_or_path}.yaml")
    cand = list(dict.fromkeys(cand))  # each place once (e.g. $ECACHE_PROFILES set to the user's folder)
    path = next((c for c in cand if c.is_file()), None)
    if path is None:
        what = "is a folder, not a profile" if Path(name_or_path).is_dir() else "not found"
        raise ConfigError(f"profile {str(name_or_path)!r} {what} (looked at {', '.join(str(c) for c in cand)}); "
                          "run `ecache calibrate` to write one or pass a YAML file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not readable YAML ({str(e).splitlines()[0]})") from None
    validate_profile(data, path)
    data["_path"] = str(path)
    return data


def validate_profile(data: dict, path: Path | str = "profile") -> None:
    """Reject unknown sections and keys, and wrongly typed values, with a ConfigError naming them
    (numbers YAML read as strings, e.g. ``1e-3``, are converted in place)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a profile must be a YAML mapping")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{path}: unknown key {k!r}; allowed: {', '.join(sorted(SECTIONS))}")
    from .cache import (  # every registered policy's parameters are cache keys
        POLICIES,
        policy_params,
    )

    cache_keys = CACHE_KEYS.union(*(policy_params(n) for n in POLICIES))
    if "sandbox" in data and data["sandbox"] not in SANDBOX_MODES:
        raise ConfigError(f"{path}: sandbox: {data['sandbox']!r} must be one of {', '.join(SANDBOX_MODES)}")
    for section, allowed in (("decode", DECODE_KEYS), ("cache", cache_keys)):
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: '{section}' must be a mapping")
        for k in sec:
            if k not in allowed:
                raise ConfigError(f"{path}: unknown key {section}.{k}; allowed: {', '.join(sorted(allowed))}")
    _check_types(data, path)


def _check_types(data: dict, path) -> None:
    """A wrongly typed value (``tau: abc``, ``gen_length: abc``) is a ConfigError naming the key and the
    value, not a TypeError deep in the engine."""
    kinds = value_kinds()
    for section in ("decode", "cache"):
        sec = data.get(section) or {}
        for k, v in sec.items():
            try:
                sec[k] = check_value(kinds[section].get(k), v)
            except ValueError as e:
                raise ConfigError(f"{path}: {section}.{k}: {v!r} {e}") from None


def value_kinds() -> dict[str, dict]:
    """``{"decode": {key: type}, "cache": {key: type}}``: the type each decode key (``DecodeConfig``) and
    cache key (every policy's parameters) takes, for :func:`check_value`."""
    from .cache import POLICIES
    from .decoding.config import DecodeConfig

    kinds = {"decode": field_types(DecodeConfig), "cache": {"policy": str}}
    for cls in POLICIES.values():
        for k, kind in field_types(cls).items():
            kinds["cache"].setdefault(k, kind)
    return kinds


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


def field_types(cls) -> dict:
    """``{field name: type}`` of a dataclass (annotations resolved, e.g. ``int | None``)."""
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}


def check_value(kind, value):
    """``value`` as a field of type ``kind`` wants it (an int is a valid float), or ValueError saying
    what it must be. Booleans are not numbers here, and NaN is no number: both would be silently
    meaningless as a threshold or a count. Types other than bool/int/float/str pass unchecked."""
    import math
    import types
    import typing

    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        kind = rest[0] if len(rest) == 1 else None
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be a whole number (e.g. 8)")
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number (e.g. 0.5)")
        if math.isnan(value):
            raise ValueError("must be a number, not NaN (e.g. 0.5)")
        return float(value)
    elif kind is str and not isinstance(value, str):
        raise ValueError("must be a string")
    return value
