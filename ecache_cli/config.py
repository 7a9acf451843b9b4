"""Profiles: YAML files of settings, and the one precedence rule (defaults < profile < flags).

A profile is ``profiles/<model>/<task>.yaml`` (written by ``ecache calibrate``) or any YAML file::

    model: tiny
    task: arith
    decode: {gen_length: 256, block_length: 32, steps: 256, threshold: null}
    cache: {policy: entropy, tau: 0.8, recent_k: 64, signal: max-entropy}
    measured: {score: 0.95, speedup: 9.1, date: 2026-11-30, n: 50}   # informational
    sandbox: strict   # optional: how model-written code is isolated (tasks/sandbox.py; --sandbox overrides)
    compile: true     # optional: the static-shape compiled step (models/compiled.py; --compile/--no-compile override)
    quantize: int8    # optional: the weights' format the τ was calibrated on (models/quantize.py; --quantize overrides)

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

import os
import re
from pathlib import Path

import yaml

from .contract.fields import (  # noqa: F401 (re-exported)
    INT_MAX,
    SEED,
    GivenFloat,
    Range,
    check_value,
    dataclass_defaults,
    field_types,
    fitting_example,
    given_float,
    takes_text,
    text_number,
)
from .contract.text import yaml_text
from .errors import ConfigError

DECODE_KEYS = {"gen_length", "block_length", "steps", "temperature", "top_k", "top_p", "remasking", "threshold",
               "factor", "ban_eos", "low_eos_confidence", "early_exit", "schedule", "compat", "eps", "alg_temp",
               "edit_threshold", "max_post_steps"}  # DecodeConfig's fields (tests/test_block_diffusion.py checks)
CACHE_KEYS = {"policy", "tau", "recent_k", "signal", "block_refresh", "refresh_every"}
SECTIONS = {"model", "task", "decode", "cache", "measured", "note", "sandbox", "compile", "quantize"}
SANDBOX_MODES = ("strict", "auto", "guard")  # tasks/sandbox.py MODES: how model-written code is isolated
#: The largest ``serve --max-body-bytes`` (1 GiB: a body is read into memory whole) and ``--prefix-cache-mb`` (1 TiB).
MAX_BODY_LIMIT = 1 << 30
MAX_PREFIX_MB = 1 << 20


def setting_ranges(policies=None) -> dict:
    """The range of every numeric decode setting and cache-policy parameter by name, as the flags and
    profile keys of that name take them: ``DecodeConfig.ranges``, then the policies' ``ranges``.

    ``policies``: the policy names a command runs (``--cache``, ``--policies``); a parameter they declare
    gets the strictest of their ranges (the highest lower bound), so ``--cache dkv --refresh-every 0`` is
    refused in dkv's words (≥ 1), as dkv itself refuses it. Without them (or for a parameter none of them
    declares) a parameter gets the range of the first policy in the registry declaring it, its ``why``
    naming each policy that is stricter (``0 = block starts only; dkv ≥ 1``), so that no message invites
    a value one policy then refuses."""
    import dataclasses

    from .cache import POLICIES
    from .decoding.config import DecodeConfig

    declared: dict[str, list[tuple[str, Range]]] = {}
    for name, cls in POLICIES.items():
        for k, v in cls.ranges.items():
            declared.setdefault(k, []).append((name, v))
    chosen = {n for n in policies or () if n in POLICIES}
    out = dict(DecodeConfig.ranges)
    for k, pairs in declared.items():
        mine = [v for n, v in pairs if n in chosen]
        if mine:
            out[k] = max(mine, key=lambda v: (v.lo is not None, v.lo or 0, v.lo_open))
            continue
        first = pairs[0][1]
        stricter = [f"{n} {'>' if v.lo_open else '≥'} {v.lo:g}" for n, v in pairs[1:] if (v.lo or 0) > (first.lo or 0)]
        out[k] = dataclasses.replace(first, why="; ".join([first.why, *stricter]).strip("; ")) if stricter else first
    return out


def run_policies(values: dict) -> list[str]:
    """The policy names a command's options name (``values``: parameter name → value): ``cache``'s, and
    each entry of ``policies`` (``entropy:tau=1,dkv``: entropy, dkv); none when neither is given."""
    names = [str(values["cache"])] if values.get("cache") is not None else []
    if values.get("policies") is not None:
        names += [spec.split(":")[0].strip() for spec in str(values["policies"]).split(",")]
    return names


def check_setting(name: str, value, label: str, fit: dict | None = None) -> None:
    """``value`` in the declared range of setting ``name`` (:func:`setting_ranges`): the one check and
    message of a flag, a chat command, a server field and a profile key, which differ only in ``label``
    (``--threshold``, ``/threshold``, ``threshold``). UsageError ``--threshold 1.5 must be in (0, 1] (a
    confidence; e.g. 0.9)``. NaN, ±inf and a text that is no number (``"nan"``, ``"abc"``, as typed after
    a flag or a chat command, or sent as a request's string) get one message in every place,
    ``contract.fields.Range.not_finite``: ``--tau abc must be a finite number ≥ 0 (an entropy in nats;
    e.g. 0.5)``. ``fit``: the other settings given (name → value), whose example a refused value gets
    (:func:`fitting_example`: ``steps 0 … (e.g. 32)`` beside a gen-length of 32). A name without a range, or
    a value of another type, passes."""
    from .errors import UsageError

    rng = setting_ranges().get(name)
    if rng is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return
    if fit:
        import dataclasses

        rng = dataclasses.replace(rng, example=fitting_example(name, fit, rng.example))
    try:
        rng.check_given(value)
    except ValueError as e:
        shown = value if not isinstance(value, str) or (value and value.strip() == value) else repr(value)
        raise UsageError(f"{label} {shown} {e}") from None


def option_ranges(policies=None) -> dict:
    """The range of every numeric option, by parameter name: the decode and cache settings' own
    (:func:`setting_ranges`, with the ``policies`` the command runs, so a flag and a profile key are checked
    alike) and the command options' (``options.py`` re-exports it beside the flags' declarations)."""

    def count(lo, example="", why=""):
        return Range(lo, INT_MAX, example=example, why=why, integer=True)

    own = {
        "threads": Range(1, integer=True, example="2", why="$ECACHE_THREADS sets it too"),
        "batch_size": count(1, "8"), "limit": count(1, "8"), "shots": count(0, "4"),
        "seed": SEED,
        "warmup": count(0, "1"), "repeats": count(1, "3"), "trace_steps": count(1, "32"),
        "rows": count(0, "24", "0 = every step"), "grid": count(1, "8"), "refine": count(0, "3"),
        "volatility_level": Range(0, lo_open=True, example="1e-3"),
        "watch_delay": Range(0, example="0.1", why="seconds after each step"),
        "max_drop": Range(0, 100, example="1", why="points of a 0–100 score"),
        "min_fidelity": Range(0, 100, example="95", why="percent"),
        "port": Range(0, 65535, integer=True, example="8000", why="0 = any free one"),
        "group_size": Range(32, 256, integer=True, example="128", why="int4: 32, 64, 128 or 256 columns per scale"),
        "ray": count(1, "2", "Ray actors, each loading the model"),
        "cores_per_replica": count(1, "1", "CPU cores each Ray replica reserves"),
        "speed_check_limit": count(1, "8", "examples timed"),
        "max_batch": count(1, "32"), "max_queue": count(0, "256"),
        "prefix_cache_mb": Range(1, MAX_PREFIX_MB, integer=True, example="1024",
                                 why="MiB; --no-prefix-cache keeps no prefixes"),
        "max_body_bytes": Range(1024, MAX_BODY_LIMIT, integer=True, example=str(1 << 20), why="bytes, at most 1 GiB"),
        "max_prompt_tokens": count(1, "256", "tokens, after the chat template"),
        "request_timeout": Range(0, lo_open=True, example="60", why="seconds; leave it out for no timeout"),
        "shutdown_grace": Range(0, example="30", why="seconds"),
    }
    return {**setting_ranges(policies), **own}


def check_ranges(values: dict) -> None:
    """Check every given numeric option of a command (``values``: parameter name → parsed value, None =
    not given) against its declared range; raise UsageError ``--recent-k 99999999999999999999 must be ≤
    2147483647 (e.g. 64)``, naming the flag, the value and what it must be. ``--edit-threshold`` on a
    model family that takes no token editing and ``--alg-temp`` on a schedule other than Dream's (the
    family's, :func:`model_family`, or ``--schedule``) are refused first, as such, whatever their value, so
    that no range message suggests a value the same command then refuses."""
    import dataclasses

    from .errors import UsageError

    fam = model_family(values.get("model")) if "model" in values and (
        values.get("edit_threshold") is not None or values.get("alg_temp") not in (None, 0)) else None
    if fam is not None:
        from .decoding.commit import check_alg_temp_schedule, family_schedule
        from .decoding.schedule import validate_schedule
        from .decoding.step import check_edit_threshold

        check_edit_threshold(values.get("edit_threshold"), fam.block_causal, fam.name)
        check_alg_temp_schedule(values.get("alg_temp"), validate_schedule(family_schedule(fam.sampler,
                                                                                          values.get("schedule"))))
    ranges = option_ranges(run_policies(values))
    for name, value in values.items():
        rng = ranges.get(name)
        if rng is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name == "group_size" and isinstance(value, int):  # a choice of four: the one int4 wording
            _check_group_size(value, values.get("quantize"))
            continue
        try:
            rng.check(value)
        except ValueError:
            rng = dataclasses.replace(rng, example=fitting_example(name, values, rng.example))
            try:
                rng.check(value)
            except ValueError as e:
                raise UsageError(f"--{name.replace('_', '-')} {value} {e}") from None


def _check_group_size(group_size: int, quantize: str | None) -> None:
    """``--group-size`` beside the ``--quantize`` given (None: not given, a profile may give int4): the
    format it needs first (``--quantize int8 --group-size 64`` is refused as such, whatever the size), then
    one of int4's sizes, in the words ``--quantize int4:7`` gets (``models.quantize``)."""
    from .models.quantize import check_group_size, parse_quantize

    if quantize is not None and str(quantize).strip().lower().partition(":")[0] != "int4":
        parse_quantize(quantize, group_size)  # its refusal of a group size on another format
    check_group_size(group_size, quantize_given=quantize is not None)


def model_family(model: str | None):
    """The model family (``models.family.Family``) of ``--model`` when it is known before loading: an alias's,
    the one that claims a folder's config.json, the embedded model's (no ``model`` or ``tiny``: its packaged
    config.json); None otherwise (a repository id, a folder without a readable config: the load reports any
    problem). Its ``decode_defaults`` and ``cache_default`` sit under profiles and flags
    (``runs.settings.resolve_settings``); its ``block_causal`` and ``sampler`` let the policies and decode options
    that do not apply to it be refused before the model loads."""
    from .errors import ModelLoadError
    from .models.loader import EMBEDDED, embedded_dir
    from .models.registry import alias, family_of
    from .models.spec import read_json_object

    embedded = not model or str(model) in EMBEDDED
    found = None if embedded else alias(str(model))
    if found is not None:
        return found[0]
    path = (embedded_dir() if embedded else Path(model)) / "config.json"
    try:
        return family_of(read_json_object(path), path) if path.is_file() else None
    except (ModelLoadError, OSError):
        return None


def model_spec(model: str | None):
    """The ``ModelSpec`` of ``--model`` when its config.json is readable before loading (the embedded model, a
    checkpoint folder), so that a suggested ``--gen-length`` fits its positions; None for a repository id or
    an alias not yet downloaded, or a config the load will refuse (it says why)."""
    from .errors import ModelLoadError
    from .models.loader import EMBEDDED, embedded_dir
    from .models.registry import spec_from_config
    from .models.spec import read_json_object

    embedded = not model or str(model) in EMBEDDED
    path = (embedded_dir() if embedded else Path(model)) / "config.json"
    try:
        return spec_from_config(read_json_object(path), path) if path.is_file() else None
    except (ModelLoadError, OSError):
        return None


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
    """The folder name used for a model's profiles: the alias, ``tiny`` for the embedded model, the alias
    of a Hugging Face repo id the registry knows (``apple/DiffuCoder-7B-Instruct`` → ``diffucoder-7b``,
    its first alias in registry order, so the repo id finds the profiles the alias ships), or a
    checkpoint directory's (or another repo id's) base name."""
    if name in ("tiny", "llada-tiny", None):
        return "tiny"
    p = Path(str(name))
    from .models.registry import alias_of_repo, repo_id_form

    if not p.exists() and repo_id_form(str(name)):
        alias = alias_of_repo(str(name))
        if alias is not None:
            return alias
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


def quantize_task(task: str, quantize: str | None) -> str:
    """The profile name of ``task`` for weights in format ``quantize``: ``list-int8`` (``list-int4-64`` for
    ``int4:64``), or ``list`` itself for unquantized weights (None or ``none``)."""
    if quantize in (None, "none"):
        return task
    return f"{task}-{quantize.replace(':', '-')}"


#: the suffix of a profile calibrated under parallel decoding (``list-parallel``): τ means something else
#: there (a step commits several tokens, and E is their largest entropy), so such runs get their own
PARALLEL_SUFFIX = "-parallel"


def mode_task(task: str, parallel: bool) -> str:
    """The profile name of ``task`` for a run that decodes in parallel (``--threshold`` / ``--factor``)
    or not: ``list-parallel`` or ``list``."""
    return task + PARALLEL_SUFFIX if parallel else task


def find_mode_profile(model: str, task: str, parallel: bool, quantize: str | None = None) -> Path | None:
    """The profile of (model, task) for a run that decodes in parallel or not: under parallel decoding
    ``<task>-parallel`` first, then ``<task>`` (the only one otherwise); each the first found in lookup
    order (:func:`find_profile`), or None. With quantized weights (``quantize``, e.g. ``int8``) the
    profiles calibrated on that format (:func:`quantize_task`: ``<task>-parallel-int8``, ``<task>-int8``)
    come first."""
    return next((found for name in mode_profile_names(task, parallel, quantize)
                 if (found := find_profile(model, name)) is not None), None)


def mode_profile_names(task: str, parallel: bool, quantize: str | None = None) -> list[str]:
    """The profile names :func:`find_mode_profile` tries for ``task``, in its order (the format's own and the
    parallel ones first), so an error can list every place looked in."""
    names = [mode_task(task, True), task] if parallel else [task]
    if quantize not in (None, "none"):
        names = [quantize_task(n, quantize) for n in names] + names
    return names


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
        given = Path(name_or_path)
        if given.is_dir():
            what = "is a folder, not a profile"
        elif given.exists():  # /dev/null, a pipe, a socket: it exists, so "not found" would mislead
            what = "is not a regular file (a device, pipe or socket), not a profile"
        else:
            what = "not found"
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
    requires unique keys; PyYAML keeps the last one silently), and that a plain scalar in exponent form
    without a dot (``1e-3``) is a float, as in YAML 1.2 (§10.3.2; YAML 1.1, PyYAML's, reads it as a string).
    A quoted number stays a string."""

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


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


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
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(e)})") from None


def _yaml_problem(e: Exception) -> str:
    """A YAML error in one line of words and a line number (``expected ',' or ']' (line 2, column 9)``),
    never the parser's raw fragment (``in "<unicode string>", line 2 … ^``)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return " ".join(str(e).split())
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None and "line" not in problem else ""
    context = getattr(e, "context", None)
    return " ".join(f"{context + ': ' if context else ''}{problem}{where}".split())


def validate_profile(data: dict, path: Path | str = "profile") -> None:
    """Reject unknown sections and keys, and wrongly typed values (a quoted number too), with a
    ConfigError naming them (values written as YAML writes them: :func:`yaml_text`).

    ``quantize`` is parsed as ``--quantize`` and ``load_model``'s ``quantize`` are
    (``models.quantize.parse_quantize``: any case; null, like their None, means none), its refusals
    prefixed ``<path>: quantize: <value>``; ``data["quantize"]`` becomes the canonical name (``int8``,
    ``int4:64``, ``none``) and ``data["_quantization"]`` the parsed value (a ``Quantization`` naming this
    file, or None)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a profile must be a YAML mapping")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{path}: unknown key {k!r}; allowed: {', '.join(sorted(SECTIONS))}")
    from .cache import POLICIES, policy_params

    if "sandbox" in data and data["sandbox"] not in SANDBOX_MODES:
        raise ConfigError(f"{path}: sandbox: {yaml_text(data['sandbox'])} must be one of {', '.join(SANDBOX_MODES)}")
    if "compile" in data and not isinstance(data["compile"], bool):
        fix = _quoted_bool("compile", data["compile"])
        raise ConfigError(f"{path}: compile: {yaml_text(data['compile'])} must be true or false{fix}")
    if "quantize" in data:  # the one parse of --quantize and load_model's quantize, its errors naming the file
        from .errors import UsageError
        from .models.quantize import parse_quantize, profile_source

        try:
            q = parse_quantize(data["quantize"], source=profile_source(path))
        except UsageError as e:
            raise ConfigError(str(e)) from None
        data["quantize"] = "none" if q is None else str(q)  # null: none, as the flag's and load_model's None
        data["_quantization"] = q  # with where it was written, for the refusals once the model's shapes are known
    for section in ("decode", "cache"):
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"{path}: '{section}' must be a mapping")
    policy = (data.get("cache") or {}).get("policy", "entropy")
    if policy not in POLICIES:
        raise ConfigError(f"{path}: cache.policy {yaml_text(policy)} is not a cache policy; use one of "
                          f"{', '.join(POLICIES)}")
    # cache keys: the ones the profile's own policy reads (a key of another policy would be ignored)
    for section, allowed in (("decode", DECODE_KEYS), ("cache", {"policy"} | policy_params(policy))):
        for k in data.get(section) or {}:
            if k not in allowed:
                whose = ""
                if section == "cache" and k in CACHE_KEYS.union(*(policy_params(n) for n in POLICIES)):
                    whose = (f" of policy {policy} "
                             f"(cache.policy{'' if 'policy' in data['cache'] else ' unset: entropy'})")
                raise ConfigError(f"{path}: unknown key {section}.{k}{whose}; allowed: {', '.join(sorted(allowed))}")
    if not (data.get("decode") or data.get("cache") or "sandbox" in data or "compile" in data or "quantize" in data):
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
            kind = kinds[section].get(k)
            number = None if kind is None or takes_text(kind) else text_number(v)
            if number is not None:  # a quoted number, refused as the Python API and the server refuse it
                raise ConfigError(f"{path}: {section}.{k}: {yaml_text(v)} must be a number, not a string; write it "
                                  f"without quotes ({k}: {number})")
            if kind in (bool, bool | None) and (fix := _quoted_bool(k, v)):
                raise ConfigError(f"{path}: {section}.{k}: {yaml_text(v)} must be true or false{fix}")
            try:
                sec[k] = check_value(kind, v)
            except ValueError as e:
                raise ConfigError(f"{path}: {section}.{k}: {yaml_text(v)} {e}") from None


def _quoted_bool(key: str, value) -> str:
    """The fix for a profile's true or false written as a quoted string (``compile: "false"``): ``, not a
    string; write it without quotes (compile: false)``; else ""."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return f", not a string; write it without quotes ({key}: {value.strip().lower()})"
    return ""


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


def profile_target_error(path: Path, model, task, overwrite_same: bool = True) -> str | None:
    """Why ``path`` cannot take the profile of ``model`` and ``task`` (None: it can): the one rule of
    ``calibrate --out`` before the run (``runs.calibrate.check_profile_target``) and of :func:`write_profile`.
    A missing or empty file (this run's output lock made it) takes it; a profile of the same model and task
    is replaced (unless not ``overwrite_same``); another model's or task's profile, or a file that is no
    profile (no ``model`` and ``task`` keys), is refused."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    try:
        old = read_yaml(path) or {}
    except ConfigError:
        old = None
    fix = "move it away or choose another --out"
    if not isinstance(old, dict) or old.get("model") is None or old.get("task") is None:
        return f"{path} exists and is not a profile ecache wrote (no model: and task:); {fix}"
    if old["model"] != model or old["task"] != task or not overwrite_same:
        return f"{path} already holds a profile for model {old['model']!r} task {old['task']!r}; {fix}"
    return None


def write_profile(path: Path, data: dict, overwrite_same: bool = True) -> None:
    """Write a profile YAML; refuses to overwrite a file that is not a profile of the same model and task
    (:func:`profile_target_error`)."""
    if error := profile_target_error(path, data.get("model"), data.get("task"), overwrite_same):
        raise ConfigError(error)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if not k.startswith("_")}, sort_keys=False))
