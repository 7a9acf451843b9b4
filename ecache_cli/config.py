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

#: The largest count or length any setting takes (tokens, steps, positions, threads): 2**31 − 1, what a
#: 32-bit index holds; far above any canvas a model takes, and a 64-bit overflow never reaches torch.
INT_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: ``lo``/``hi`` bounds (None = unbounded), each inclusive
    unless ``lo_open``/``hi_open``; never NaN, never ±inf. ``example``: a good value, for the message."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    example: str = ""
    why: str = ""
    integer: bool = False

    def describe(self) -> str:
        """The range in words: ``in [0, 1]``, ``≥ 1``, ``> 0``, ``in 1..2147483647`` (whole numbers)."""
        if self.lo is not None and self.hi is not None:
            if self.integer:
                return f"in {self.lo}..{self.hi}"
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '≥'} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '≤'} {self.hi:g}"
        return "a finite number"

    def check(self, value) -> None:
        """Raise ValueError (``must be in [0, 1] (e.g. 0.9)``) for a value outside the range, NaN or ±inf."""
        import math

        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        finite = not isinstance(value, float) or math.isfinite(value)
        bad = not finite
        if not bad and self.lo is not None:
            bad = value <= self.lo if self.lo_open else value < self.lo
        if not bad and self.hi is not None:
            bad = value >= self.hi if self.hi_open else value > self.hi
        if bad:
            hint = "; ".join(x for x in (self.why, f"e.g. {self.example}" if self.example else "") if x)
            what = self.describe() if finite else f"a finite number {self.describe()}"
            if finite and self.integer:  # a count: name the side it fell off
                what = f"≥ {self.lo}" if self.lo is not None and value < self.lo else f"≤ {self.hi}"
            raise ValueError(f"must be {what}" + (f" ({hint})" if hint else ""))


def _count(lo: int = 0, example: str = "", why: str = "") -> Range:
    return Range(lo, INT_MAX, example=example, why=why, integer=True)


#: The range of every numeric decode key (``DecodeConfig``) and cache-policy parameter, by name; a
#: ``(policy, key)`` entry overrides the name's for one policy. The sources: LLaDA's and Dream's
#: generate code (decode keys), each policy's paper (module docstrings in ``ecache_cli/cache``).
#: :func:`field_types` attaches them, so a profile value, a ``--policies name:key=value`` variant, a
#: flag and an lm-eval model_arg are checked alike (:func:`check_value`).
RANGES: dict = {
    "gen_length": _count(1, "256"), "block_length": _count(1, "32"), "steps": _count(1, "256"),
    "temperature": Range(0, example="0.7", why="0 = greedy"),
    "top_k": _count(1, "50", "leave it unset to keep every token"),
    "top_p": Range(0, 1, lo_open=True, example="0.95", why="a probability mass"),
    "threshold": Range(0, 1, lo_open=True, example="0.9", why="a confidence"),
    "factor": Range(0, lo_open=True, example="1.0"),
    "eps": Range(0, 1, hi_open=True, example="1e-3", why="Dream's last timestep"),
    "alg_temp": Range(0, example="0.5", why="0 = the top-scoring positions"),
    # cache policies
    "tau": Range(0, example="0.5", why="an entropy in nats"),
    "recent_k": _count(0, "64"),
    "refresh_every": _count(0, "8", "ecache help cache"),
    ("dkv", "refresh_every"): _count(1, "8", "dkv refreshes every N steps of a block"),
    "kp": _count(1, "50", "steps between prompt refreshes"),
    "kr": _count(1, "7", "steps between response refreshes"),
    "rho": Range(0, 1, example="0.25", why="a share of the response"),
    "tol": Range(0, 2, example="1e-3", why="a cosine change 1 − cos"),
    "rollout_p": Range(0, 1, example="0.1", why="a share of the total importance"),
    "current_k": _count(1, "32"),
    "sigma": Range(0, 65536, lo_open=True, example="10", why="a width in positions"),
    "gamma": Range(0, 1, example="0.9", why="a cosine similarity"),
    "window": _count(0, "16", "positions"),
}


def range_of(key: str, policy: str | None = None) -> Range | None:
    """The declared :data:`RANGES` entry of setting ``key`` (``policy``'s own first), or None."""
    return RANGES.get((policy, key)) or RANGES.get(key)


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
    data = read_yaml(path)
    if data is None or data == {}:
        raise ConfigError(f"{path}: the profile is empty; write settings under decode: and cache: (e.g. "
                          "cache: {policy: entropy, tau: 0.5}) or drop --profile")
    validate_profile(data, path)
    data["_path"] = str(path)
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (YAML 1.2 §3.2.1.1
    requires unique keys; PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (lines {seen[key]} and {line}); keep one",
                        key_node.start_mark)
                seen[key] = line
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path):
    """Parse a YAML file: UTF-8 text (a BOM is accepted), no key twice in a mapping.

    Returns what the file holds (None for an empty file). Raises ConfigError, one line naming the file:
    unreadable, not UTF-8 (naming the byte and its line), malformed YAML, or a duplicate key."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror}); check the path") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); save the file "
                          "as UTF-8") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{path}: not valid YAML ({msg})") from None


def validate_profile(data: dict, path: Path | str = "profile") -> None:
    """Reject unknown sections and keys, and wrongly typed values, with a ConfigError naming them
    (numbers YAML read as strings, e.g. ``1e-3``, are converted in place)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a profile must be a YAML mapping")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{path}: unknown key {k!r}; allowed: {', '.join(sorted(SECTIONS))}")
    from .cache import POLICIES, policy_params

    if "sandbox" in data and data["sandbox"] not in SANDBOX_MODES:
        raise ConfigError(f"{path}: sandbox: {data['sandbox']!r} must be one of {', '.join(SANDBOX_MODES)}")
    for section in ("decode", "cache"):
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"{path}: '{section}' must be a mapping")
    policy = (data.get("cache") or {}).get("policy", "entropy")
    if policy not in POLICIES:
        raise ConfigError(f"{path}: cache.policy {policy!r} is not a cache policy; use one of {', '.join(POLICIES)}")
    # cache keys: the ones the profile's own policy reads (a key of another policy would be ignored)
    for section, allowed in (("decode", DECODE_KEYS), ("cache", {"policy"} | policy_params(policy))):
        for k in data.get(section) or {}:
            if k not in allowed:
                whose = ""
                if section == "cache" and k in CACHE_KEYS.union(*(policy_params(n) for n in POLICIES)):
                    whose = f" of policy {policy} (cache.policy{'' if 'policy' in data['cache'] else ' unset: entropy'})"
                raise ConfigError(f"{path}: unknown key {section}.{k}{whose}; allowed: {', '.join(sorted(allowed))}")
    if not (data.get("decode") or data.get("cache") or "sandbox" in data):
        raise ConfigError(f"{path}: the profile holds no settings; write them under decode: and cache: (e.g. "
                          "cache: {policy: entropy, tau: 0.5})")
    _check_types(data, path, policy)


def _check_types(data: dict, path, policy: str | None = None) -> None:
    """A wrongly typed or out-of-range value (``tau: abc``, ``gen_length: -1``, ``gamma: 2``) is a
    ConfigError naming the key and the value, not a TypeError deep in the engine. ``policy``: the
    profile's, whose parameters' types and ranges apply to the cache section."""
    kinds = value_kinds()
    if policy is not None:
        from .cache import POLICIES

        kinds["cache"].update(field_types(POLICIES[policy]))
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
    if path.exists() and path.stat().st_size > 0:  # an empty file: made by this run's output lock
        try:
            old = read_yaml(path) or {}
        except ConfigError:
            old = {}
        old = old if isinstance(old, dict) else {}
        if old.get("model") != data.get("model") or old.get("task") != data.get("task") or not overwrite_same:
            raise ConfigError(f"{path} already holds a profile for model {old.get('model')!r} task {old.get('task')!r}; "
                              "move it away or choose another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if not k.startswith("_")}, sort_keys=False))


def dataclass_defaults(cls) -> dict:
    """Field defaults of a dataclass as a dict."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def field_types(cls) -> dict:
    """``{field name: type}`` of a dataclass (annotations resolved, e.g. ``int | None``); a field with a
    declared :class:`Range` (:func:`range_of`) comes as ``Annotated[type, Range]``, which
    :func:`check_value` enforces."""
    import typing

    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind, rng = hints.get(f.name), range_of(f.name, getattr(cls, "name", None))
        out[f.name] = typing.Annotated[kind, rng] if rng is not None and kind is not None else kind
    return out


def check_value(kind, value):
    """``value`` as a field of type ``kind`` wants it (an int is a valid float), or ValueError saying
    what it must be. Booleans are not numbers here, and NaN is no number: both would be silently
    meaningless as a threshold or a count. Types other than bool/int/float/str pass unchecked.
    ``Annotated[type, Range]`` (:func:`field_types`) also checks the value's range."""
    import math
    import types
    import typing

    rng = None
    if typing.get_origin(kind) is typing.Annotated:  # field_types' declared range
        kind, *meta = typing.get_args(kind)
        rng = next((m for m in meta if isinstance(m, Range)), None)
    value = _check_type(kind, value)
    if rng is not None and value is not None:
        rng.check(value)
    return value


def _check_type(kind, value):
    """:func:`check_value` without the range: the type alone."""
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
