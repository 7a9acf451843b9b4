"""A run's settings: defaults < profile < flags resolved into a :class:`Settings`, the decode
settings range-checked before the model loads, and one warning for flags the run does not use."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import make_policy, policy_params
from ..cache.entropy import DEFAULT_TAU
from ..config import (  # noqa: F401 (GivenFloat, given_float: re-exported for the server's JSON numbers)
    GivenFloat,
    check_setting,
    dataclass_defaults,
    find_mode_profile,
    fitting_example,  # noqa: F401 (re-exported: the server's examples fit a request's other fields)
    given_float,
    load_profile,
    model_family,
    model_spec,
    option_ranges,  # noqa: F401 (re-exported: the server checks a request's seed by it)
    resolve,
)
from ..decoding.config import DecodeConfig
from ..errors import UsageError
from ..models.quantize import check_group_size, parse_quantize, profile_source


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
    sandbox: str | None = None  # the profile's ``sandbox`` mode, if it has one (``--sandbox`` overrides)
    tau_source: str = "default"  # where τ came from: "flag" (--tau), "profile" (the file ``profile``), "default",
    # or "search" (ecache calibrate: τ is what it searches)
    profile_note: str | None = None  # e.g. "calibrated on 20 examples": the profile's ``measured.n``
    compile: bool = False  # the static-shape compiled step (--compile, profile key ``compile``)
    policy_from_profile: bool = False  # the cache policy is the profile's (cache.policy), not --cache's
    sampling_flags: tuple[str, ...] = ()  # --top-k / --top-p given with no --schedule: warned once the model is known
    # the weights' format (--quantize / --group-size, else the profile's key ``quantize``): a
    # ``models.quantize.Quantization`` naming where it was written (what the load takes), None: unquantized
    quantization: object = None
    profile_quantize: str = "none"  # the format the profile read was calibrated on (its ``quantize`` key)
    policies: list[str] | None = None  # the --policies entries a run compares (ecache profile); None: ``cache``
    decode_given: frozenset = frozenset()  # the decode flags given (--schedule, --steps: warn_ignored_schedule)
    parallel_source: str | None = None  # where a threshold / factor no flag gave came from (a family, a profile)

    @property
    def quantize(self) -> str | None:
        """The weights' format as the records and profiles name it (``int8``, ``int4:64``), None: unquantized."""
        return None if self.quantization is None else str(self.quantization)

    @property
    def quantize_from_profile(self) -> bool:
        """Whether the format is the profile's ``quantize`` key (no ``--quantize``): its errors name the file."""
        return self.quantization is not None and self.quantization.source.kind == "profile"

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
        return make_policy(name, strict=False, **params)  # the flags of other policies are warned about, not used

    @property
    def tau(self) -> float | None:
        """EntropyCache's τ (nats) this run uses: the resolved one (defaults < profile < flags)."""
        return self.all_cache_params.get("tau", self.cache_params.get("tau", DEFAULT_TAU))

    def takes_tau(self) -> bool:
        """Whether a policy this run decodes with has a τ (``policies``, else ``cache``; a policy takes
        one when ``tau`` is among its parameters: ``cache.policy_params``). The one rule for reporting τ:
        the start line (:meth:`describe`), the records' and documents' ``settings`` (:meth:`as_dict`)."""
        names = [p.split(":")[0] for p in (self.policies or [self.cache])]
        return any("tau" in _params_or_none(n) for n in names)

    def as_dict(self) -> dict:
        """JSON-ready: decode settings, cache policy and parameters, the profile file read (None when
        none), τ and where it came from (``tau_source``: flag, profile or default); ``tau`` and
        ``tau_source`` are None when no policy of the run has a τ (:meth:`takes_tau`), as the start line
        says (no τ), and ``tau`` is None while calibrate searches it."""
        takes = self.takes_tau()
        return {"decode": self.decode.as_dict(), "cache": self.cache, "cache_params": self.cache_params,
                "profile": self.profile, "tau": None if self.tau_source == "search" or not takes else self.tau,
                "tau_source": self.tau_source if takes else None}

    def tau_origin(self) -> str:
        """Where τ came from, for people: ``--tau``, ``profile PATH (shipped with ecache; calibrated on N
        examples)``, or ``built-in default``."""
        if self.tau_source == "flag":
            return "--tau"
        if self.tau_source == "profile" and self.profile:
            return self.profile_origin()
        return "built-in default"

    def profile_origin(self) -> str:
        """``profile PATH (shipped with ecache; calibrated on N examples)``: the profile read, for people."""
        from ..config import packaged_profiles_dir

        notes = []
        try:
            if Path(self.profile).resolve().is_relative_to(packaged_profiles_dir()):
                notes.append("shipped with ecache")
        except (OSError, ValueError):
            pass
        if self.profile_note:
            notes.append(self.profile_note)
        if self.tau_source == "profile" and (self.quantize or self.profile_quantize != "none"):  # τ's weights
            notes.append(f"τ from {self.profile_quantize} weights" if self.profile_quantize != "none"
                         else "τ from unquantized weights")
        return f"profile {self.profile}" + (f" ({'; '.join(notes)})" if notes else "")

    def describe(self, model: str, policies: list[str] | None = None, tau: str | None = None,
                 searched: str = "τ") -> str:
        """The one stderr line naming what a run uses: model, cache policy (or ``policies``), τ and its
        source (``tau``: another text for τ, e.g. calibrate's search, after the name ``searched``: what
        calibrate searches, a block-diffusion decoder's ``threshold``), and the profile read when it gives
        settings other than τ. τ is named only when an entropy policy runs."""
        pols = policies or [self.cache]
        text = f"using model {model}" + (f" ({self.quantize} weights)" if self.quantize else "") + ", "
        text += f"cache {pols[0]}" if len(pols) == 1 else f"policies {','.join(pols)}"
        if tau is not None:
            return f"{text}, {searched} {tau}"
        entropy = [p.split(":") for p in pols if "tau" in _params_or_none(p.split(":")[0])]  # as takes_tau
        if entropy:
            own = policies is not None and all(any(kv.startswith("tau=") for kv in p[1:]) for p in entropy)
            text += ", τ of each --policies entry" if own else f", τ {self.tau:g} from {self.tau_origin()}"
            if self.profile and (own or self.tau_source != "profile"):  # the profile still gives the rest
                text += f"; other settings from {self.profile_origin()}"
            return text
        if policies is None and self.policy_from_profile and self.profile:  # e.g. a profile that says: no cache
            text += f" from {self.profile_origin()}"
        return f"{text} (no τ: only the entropy policy takes one)"


def resolve_settings(model: str, decode_flags: dict, cache_flags: dict, profile: str | None = None,
                     task: str | None = None, compile: bool | None = None, quantize: str | None = None,
                     group_size: int | None = None, tau_searched: bool = False, prompt_tokens=None) -> Settings:
    """defaults < profile (``--profile``, or ``<model>/<task>.yaml`` for ``--task``, or the model's
    ``default.yaml``, each the first found in ./profiles, the user's config folder, the package:
    ``config.profile_dirs``; with ``--threshold`` or ``--factor`` in ``decode_flags`` the
    ``<task>-parallel.yaml`` / ``default-parallel.yaml`` calibrated under parallel decoding come first,
    ``config.find_mode_profile``) < flags. Raises ConfigError/UsageError for bad profiles or values.
    ``compile``: ``--compile`` / ``--no-compile`` (None: the profile's ``compile`` key, default off).
    ``quantize`` / ``group_size``: ``--quantize`` / ``--group-size`` (None: the profile's ``quantize``, default
    none); a quantized run reads its format's profiles first and warns once on a τ from another format
    (not when ``tau_searched``: calibrate). ``prompt_tokens`` (a list of ints): as :func:`validate_decode`'s.

    Warns once on stderr for a profile calibrated for another model and for ``top_k`` / ``top_p`` in
    ``decode_flags`` at temperature 0 under ``--schedule llada`` (:func:`warn_sampling_flags`; without
    ``--schedule`` the model's sampler decides, :func:`warn_model_rules`), so every caller warns alike."""
    _check_flag_values(decode_flags, cache_flags)
    parallel = decode_flags.get("threshold") is not None or decode_flags.get("factor") is not None
    asked = parse_quantize(quantize, group_size) if quantize is not None else None  # fails before any profile
    prof = _find_profile(model, profile, task, parallel, None if asked is None else str(asked))
    prof_q, quant = _quantize_of(prof, asked, quantize is not None, group_size)
    run_q = None if quant is None else str(quant)
    _warn_other_model(model, prof, run_q)
    p_dec, path = (prof or {}).get("decode") or {}, (prof or {}).get("_path")
    p_cache = dict((prof or {}).get("cache") or {})
    fam = model_family(model)
    decode = resolve({**dataclass_defaults(DecodeConfig), **(fam.decode_defaults if fam else {})}, p_dec, decode_flags)
    notes = _flag_picks_parallel_rule(decode, decode_flags, p_dec, path, fam)
    cache = resolve({"policy": (fam and fam.cache_default) or "entropy", "tau": DEFAULT_TAU}, p_cache, cache_flags)
    name = cache.pop("policy")
    params = {k: v for k, v in cache.items() if v is not None and k in policy_params_or_all(name, fam)}
    _block_follows_gen_length(decode, p_dec, decode_flags)
    _steps_follow_gen_length(decode, p_dec, decode_flags)
    _validate_naming_profile(decode, p_dec, decode_flags, path, fam, model_spec(model), prompt_tokens)
    _validate_policy(name, params, p_cache, cache_flags, path, fam, notes)
    decode_cfg = DecodeConfig(**decode)
    tau_source = _tau_source(cache_flags, p_cache)
    _warn_quantize_mismatch(model, prof, (prof_q, run_q or "none"), "search" if tau_searched else tau_source, name)
    return Settings(quantization=quant, profile_quantize=prof_q, decode=decode_cfg, cache=name, cache_params=params,
                    sampling_flags=_sampling_flags(decode_cfg, decode_flags),
                    decode_given=frozenset(k for k, v in decode_flags.items() if v is not None),
                    parallel_source=_parallel_source(decode, decode_flags, p_dec, path, fam),
                    profile=path, sandbox=(prof or {}).get("sandbox"),
                    policy_from_profile=cache_flags.get("policy") is None and p_cache.get("policy") is not None,
                    all_cache_params={k: v for k, v in cache.items() if v is not None},
                    compile=bool((prof or {}).get("compile", False) if compile is None else compile),
                    tau_source=tau_source, profile_note=_measured_note(prof))


def _measured_note(prof: dict | None) -> str | None:
    """``calibrated on N examples``: the profile's ``measured.n``, for the start line; None without it."""
    n = ((prof or {}).get("measured") or {}).get("n") if isinstance((prof or {}).get("measured"), dict) else None
    return f"calibrated on {n} examples" if n else None


def quantize_flag(quantize: str | None, group_size: int | None) -> str | None:
    """``--quantize`` / ``--group-size`` as the records and profiles name the format (``int8``, ``int4:64``),
    None for none; raises UsageError for a bad value (``models/quantize.parse_quantize``)."""
    q = parse_quantize(quantize, group_size)
    return None if q is None else str(q)


def _find_profile(model: str, profile: str | None, task: str | None, parallel: bool, quantize: str | None):
    """The profile a run reads: ``--profile``, else the task's, else the model's default one (see
    :func:`resolve_settings`), or None."""
    if profile:
        return load_profile(profile, model)
    for name in ([task] if task else []) + ["default"]:
        if (found := find_mode_profile(model, name, parallel, quantize)) is not None:
            return load_profile(found)
    return None


def _quantize_of(prof: dict | None, asked, flag_given: bool, group_size: int | None) -> tuple[str, object]:
    """(the profile's format, ``none`` without a ``quantize`` key; the run's ``Quantization`` or None): the
    flag's (``asked``, parsed) when ``--quantize`` is given, else the profile's (``config.validate_profile``
    parsed it, naming the file), whose int4 group ``--group-size`` may set. A ``--group-size`` the profile's
    format does not take is refused in the flag's words, naming the profile (``from_profile``)."""
    prof_q = str((prof or {}).get("quantize") or "none")
    if flag_given:
        return prof_q, asked
    own = (prof or {}).get("_quantization")
    if own is None and prof_q != "none":  # a profile dict not read by config.load_profile
        own = parse_quantize(prof_q, source=profile_source((prof or {}).get("_path") or "profile"))
    if group_size is not None and own is not None:  # a size no int4 kernel takes: the flag's fault alone
        check_group_size(group_size)
    try:
        return prof_q, parse_quantize(own, group_size)
    except UsageError as e:
        if own is None or prof is None or prof.get("_path") is None:
            raise
        raise UsageError(from_profile(e, f"quantize {own}", prof["_path"])) from None


def _warn_other_model(model: str, prof: dict | None, run_q: str | None) -> None:
    """Warn once when the profile read was calibrated for another model than ``model`` (its ``model:`` key,
    aliases and case aside: :func:`_model_key`), with the command that calibrates this one."""
    if prof and prof.get("model") is not None and _model_key(prof["model"]) != _model_key(model):
        from ..console import warn

        warn(f"profile {prof['_path']} was calibrated for model {prof['model']!r}, not {model!r}; its settings "
             f"are used anyway (run `{recalibrate_command(model, prof, run_q or 'none')}` for this model)")


def _check_flag_values(decode_flags: dict, cache_flags: dict) -> None:
    """Every numeric setting :func:`resolve_settings` is given, checked by its declared range in its flag's
    words (``config.check_setting``: ``--gen-length 0 must be ≥ 1 (e.g. 256)``, ``--tau abc must be a
    finite number …``), as the command line checks its flags before it calls it, so a library caller gets
    the same one-line UsageError; a number written as text (``"32"``) is refused as one, as a profile's
    and a request's are. A setting whose type keeps text (es-dllm's ``proportions`` ``"1/0.5"``:
    ``config.value_kinds``) is its policy's to check."""
    from ..config import value_kinds
    from ..contract.fields import takes_text, text_number

    kinds = value_kinds()
    given = {k: v for flags in (decode_flags, cache_flags) for k, v in flags.items() if k != "policy" and v is not None}
    for key, value in given.items():
        kind = kinds["decode"].get(key, kinds["cache"].get(key))
        if kind is None or (isinstance(value, str) and takes_text(kind)):
            continue
        label = f"--{key.replace('_', '-')}"
        if text_number(value) is not None:
            raise UsageError(f"{label} {value!r} must be a number, not a string")
        check_setting(key, value, label, fit=given)


def _warn_quantize_mismatch(model: str, prof: dict | None, formats: tuple[str, str], tau_source: str,
                            policy: str) -> None:
    """Warn once when the run's τ comes from a profile calibrated on other weights than the run's
    (``formats``: the profile's ``quantize`` key, the run's; a profile without it was calibrated on
    unquantized weights), with the command that calibrates ``model`` (as the run was given it) anew."""
    prof_q, run_q = formats
    if prof is None or prof_q == run_q or tau_source != "profile" or policy != "entropy":
        return
    from ..console import warn

    def what(q: str) -> str:
        return "unquantized" if q == "none" else q

    warn(f"profile {prof['_path']}'s τ was calibrated on {what(prof_q)} weights, this run uses {what(run_q)}: "
         f"quantization changes the entropy signal, so τ may not hold; run "
         f"`{recalibrate_command(model, prof, run_q)}` or pass --tau")


def _tau_source(cache_flags: dict, p_cache: dict) -> str:
    """Where the run's τ comes from: ``flag`` (``--tau``), ``profile`` (its cache section) or ``default``."""
    if cache_flags.get("tau") is not None:
        return "flag"
    return "profile" if p_cache.get("tau") is not None else "default"


def recalibrate_command(model: str | None, prof: dict, quantize: str) -> str:
    """The ``ecache calibrate`` command that writes the profile ``prof`` (a loaded profile: its ``task``, else
    its file's name; ``quantize``, ``decode.threshold`` and ``measured.shots``) again for ``model`` on weights
    in format ``quantize`` (``none``: unquantized), with the flags this machine needs to accept it: ``--task`` (the
    profile's task without its ``-parallel`` and format suffixes; for ``default`` or a name that is no task
    (a hand-written ``my-settings.yaml``), the domains the model was trained on, from its model card, else a
    ``<tasks>`` placeholder), ``--model`` unless the embedded
    model, ``--allow-code-execution`` for the code domain, ``--threshold`` for a profile calibrated under
    parallel decoding, ``--shots`` when it was calibrated at several, ``--quantize`` and the ``--dtype`` the
    format needs on this machine (``models.quantize.check_supported``: int4 runs in bfloat16 on a CPU)."""
    from ..config import PARALLEL_SUFFIX, quantize_task
    from ..models.loader import EMBEDDED
    from ..tasks import TASKS
    from .calib_groups import DEFAULT_PROFILE_TASK

    stem = Path(prof["_path"]).stem if prof.get("_path") else DEFAULT_PROFILE_TASK
    task, own = str(prof.get("task") or stem), str(prof.get("quantize") or "none")
    suffix = quantize_task("", own)
    task = task[: -len(suffix)] if suffix and task.endswith(suffix) else task
    parallel = task.endswith(PARALLEL_SUFFIX)
    task = task[: -len(PARALLEL_SUFFIX)] if parallel else task
    if task == DEFAULT_PROFILE_TASK or not set(task.split(",")) <= set(TASKS):  # a file's own name is no task
        task = ",".join(_trained_tasks(model) or ["<tasks>"])
    parts = ["ecache calibrate", f"--task {task}"]
    if model is not None and str(model) not in EMBEDDED:
        parts.append(f"--model {shlex.quote(str(model))}")
    if "code" in task.split(","):
        parts.append("--allow-code-execution")
    threshold = (prof.get("decode") or {}).get("threshold")
    if parallel and threshold is not None:
        parts.append(f"--threshold {threshold:g}")
    shots = (prof.get("measured") or {}).get("shots")
    if isinstance(shots, list) and len(shots) > 1:
        parts.append(f"--shots {','.join(map(str, shots))}")
    if quantize != "none":
        parts += [f"--quantize {quantize}", *_dtype_for(quantize)]
    return " ".join(parts)


def _trained_tasks(model: str | None) -> list[str] | None:
    """The task domains ``model``'s card lists (the embedded model's, or a local checkpoint's), else None."""
    from ..models.loader import local_folder
    from .confidence import trained_tasks

    local = local_folder(model)
    return trained_tasks(local) if local is not None else None


def _dtype_for(quantize: str) -> list[str]:
    """``["--dtype bfloat16"]`` when weights in format ``quantize`` do not run in the default dtype on this
    machine's default device but do in bfloat16 (torchao's int4 on a CPU), else []."""
    import torch

    from ..models import quantize as qz
    from ..models.loader import resolve_device, resolve_dtype

    quant, dev = qz.parse_quantize(quantize), resolve_device(None)
    try:
        qz.check_supported(quant, dev, resolve_dtype(None, dev))
        return []
    except UsageError:
        pass
    try:
        qz.check_supported(quant, dev, torch.bfloat16)
        return ["--dtype bfloat16"]
    except UsageError:
        return []


def _sampling_flags(decode: DecodeConfig, decode_flags: dict) -> tuple[str, ...]:
    """The ``--top-k`` / ``--top-p`` flags given, for :func:`warn_model_rules` once the model (hence its
    sampler) is known; with ``--schedule`` the rules are known now: warned here, and () returned."""
    given = tuple(f for f, k in (("--top-k", "top_k"), ("--top-p", "top_p")) if decode_flags.get(k) is not None)
    if decode.schedule is None:
        return given
    warn_sampling_flags(decode, given)
    return ()


def _fits_family(name: str, fam, cache_flags: dict, notes: list[str], profile_path: str | None = None) -> None:
    """The last checks of :func:`resolve_settings`, before the first line: a cache policy that does not
    apply to the model family ``fam`` (when known before loading) is refused as the engine would refuse it
    (``CachePolicy.check_model``), naming the profile at ``profile_path`` when no ``--cache`` overrode the
    policy it set (:func:`from_profile`); then the ``notes`` of a dropped threshold are printed, for
    settings that are valid only."""
    flagged = cache_flags.get("policy") is not None
    if fam is not None and (flagged or profile_path is not None):
        from types import SimpleNamespace

        try:
            make_policy(name, strict=False).check_model(SimpleNamespace(block_causal=fam.block_causal,
                                                                        family=fam.name))
        except UsageError as e:
            if flagged:
                raise
            raise UsageError(from_profile(e, f"cache {name}", profile_path)) from None
    from ..console import note

    for text in notes:
        note(text)


def _flag_picks_parallel_rule(decode: dict, decode_flags: dict, p_dec: dict, path: str | None, fam) -> list[str]:
    """``--threshold`` or ``--factor`` picks the parallel-decoding rule: the profile's other rule gives
    way, since Fast-dLLM's threshold and factor rules exclude each other (``decoding/step.py``); a flag that
    needs fixed steps drops a lower layer's rule (:func:`_flag_drops_parallel_default`). Edits ``decode``
    in place; returns the notes to print once the settings are checked."""
    for flag, other in (("threshold", "factor"), ("factor", "threshold")):
        if decode_flags.get(flag) is not None and decode_flags.get(other) is None:
            decode[other] = None
    return _flag_drops_parallel_default(decode, decode_flags, p_dec, path, fam)


def _parallel_source(decode: dict, decode_flags: dict, p_dec: dict, path: str | None, fam) -> str | None:
    """Where the run's threshold (or factor) came from when no flag gave it: ``profile PATH`` or ``the F
    family's default``; None when a flag gave it or there is none."""
    for key in ("threshold", "factor"):
        if decode.get(key) is None or decode_flags.get(key) is not None:
            continue
        if p_dec.get(key) is not None and path is not None:
            return f"profile {path}"
        if fam is not None and (fam.decode_defaults or {}).get(key) is not None:
            return f"the {fam.name} family's default"
    return None


def _flag_drops_parallel_default(decode: dict, decode_flags: dict, p_dec: dict, path: str | None, fam) -> list[str]:
    """A flag that needs fixed-step decoding (``--remasking`` other than low_confidence / maskgit_plus,
    whose scores are no probability; ``--alg-temp`` > 0) wins over a ``threshold`` or ``factor`` that no flag
    gave (the model family's ``decode_defaults``, e.g. SDAR's and LLaDA2's threshold, or the profile's):
    defaults < profile < flags, so the lower layer's value is dropped with a note naming it and where it
    came from; a ``--threshold`` / ``--factor`` flag beside it still conflicts (``validate_decode``).
    Edits ``decode`` in place; returns the notes, whose hint undoes the flag that caused the drop."""
    from ..decoding.remasking import PROB_KINDS, REMASKING

    remasking, alg_temp = decode_flags.get("remasking"), decode_flags.get("alg_temp")
    if remasking is not None and remasking in REMASKING and remasking not in PROB_KINDS:
        why, undo = f"--remasking {remasking}", "pass --remasking low_confidence"
    elif alg_temp:
        why, undo = f"--alg-temp {alg_temp:g}", "drop --alg-temp"
    else:
        return []
    notes = []
    for key in ("threshold", "factor"):
        if decode_flags.get(key) is not None or decode.get(key) is None:
            continue
        source = _parallel_source({key: decode[key]}, decode_flags, p_dec, path, fam) or "the defaults"
        notes.append(f"{why} needs fixed-step decoding: --{key.replace('_', '-')} {decode[key]:g} ({source}) is "
                     f"dropped; each block decodes in its steps ({undo} to keep the {key} rule)")
        decode[key] = None
    return notes


def _validate_naming_profile(decode: dict, p_dec: dict, decode_flags: dict, path: str | None,
                             fam=None, spec=None, prompt_tokens: list[int] | None = None) -> None:
    """:func:`validate_decode`, and an error about a value the user never typed names where it came from:
    the profile at ``path`` (and the flag that overrides it), or the model family ``fam``'s
    ``decode_defaults`` (``--block-length 32 (the llada2 family's default)``); ``--edit-threshold`` on a
    family that attends bidirectionally is refused here too, as the decoder's build would refuse it."""
    try:
        validate_decode(decode, getattr(fam, "sampler", None), spec, prompt_tokens)
        if fam is not None:
            from ..decoding.step import check_edit_threshold

            check_edit_threshold(decode.get("edit_threshold"), fam.block_causal, fam.name)
    except UsageError as e:
        _blame_profile(e, decode, p_dec, decode_flags, path)
        _blame_family(e, decode, p_dec, decode_flags, fam)
        raise


def _blame_family(e: UsageError, values: dict, p_dec: dict, flags: dict, fam) -> None:
    """Raise ``e`` again saying which of its ``--flag value`` came from the defaults of the model family
    ``fam`` (``Family.decode_defaults``: neither a flag nor the profile set it). Returns when none did."""
    import re

    msg = str(e)
    for k, v in (getattr(fam, "decode_defaults", None) or {}).items():
        if flags.get(k) is not None or p_dec.get(k) is not None or values.get(k) != v:
            continue
        msg = re.sub(rf"--{re.escape(k.replace('_', '-'))} {re.escape(str(v))}(?![\w.])",
                     lambda m: f"{m.group(0)} (the {fam.name} family's default)", msg, count=1)
    if msg != str(e):
        raise UsageError(msg) from None


def _validate_policy(name: str, params: dict, p_cache: dict, cache_flags: dict, path: str | None, fam=None,
                     notes: list[str] = ()) -> None:
    """Build the policy once, so a bad name or value fails before the model loads (UsageError; one about a
    value the profile at ``path`` set names it, one about a flag's value names the flag: ``--refresh-every
    0 must be ≥ 1 (dkv refreshes …)``, not the parameter's Python name); then :func:`_fits_family`."""
    try:
        make_policy(name, strict=False, **params)
    except UsageError as e:
        msg = str(e)
        for k, v in cache_flags.items():
            head = f"{name} parameter {k}={v!r} "
            if k != "policy" and v is not None and msg.startswith(head):
                raise UsageError(f"--{k.replace('_', '-')} {v} {msg.removeprefix(head)}") from None
        _blame_profile(e, params, p_cache, cache_flags, path)
        raise
    _fits_family(name, fam, cache_flags, list(notes), path if p_cache.get("policy") is not None else None)


def _blame_profile(e: UsageError, values: dict, from_file: dict, flags: dict, path: str | None) -> None:
    """Raise ``e`` again naming the profile at ``path`` when the value it is about came from there: a key
    of ``from_file`` that no flag overrode, whose name (as a flag) and value both appear in the message.
    Returns when no such key is found."""
    msg = str(e)
    blamed = [k for k in from_file if flags.get(k) is None and values.get(k) is not None
              and (k.replace("_", "-") in msg or k in msg) and str(values[k]) in msg]
    if blamed and path is not None:
        raise UsageError(from_profile(e, ", ".join(f"{k} {values[k]}" for k in blamed), path)) from None


def from_profile(error, names: str, path: str) -> str:
    """The message of ``error`` about values a profile file gave, naming them and the file: ``<error>
    (<names> from profile <path>; pass the flag to override)``, e.g. ``names`` ``steps 3``: one wording for
    every error whose value came from a profile (:func:`_blame_profile`, ``runs.models.check_quantize``)."""
    return f"{error} ({names} from profile {path}; pass the flag to override)"


def _block_follows_gen_length(decode: dict, p_dec: dict, decode_flags: dict) -> None:
    """A profile whose one block is its whole canvas (``block_length`` = ``gen_length``: Dream's
    ``diffusion_generate``, the Dream-based coders' shipped profiles) keeps it whole at another length:
    with ``--gen-length`` and no ``--block-length`` the block takes the new length. Edits ``decode`` in place."""
    given = decode_flags.get("gen_length")
    if given is None or decode_flags.get("block_length") is not None:
        return
    if p_dec.get("block_length") is not None and p_dec.get("block_length") == p_dec.get("gen_length"):
        decode["block_length"] = given


def _steps_follow_gen_length(decode: dict, p_dec: dict, decode_flags: dict) -> None:
    """A profile's ``steps`` belong to its own ``gen_length``: when ``--gen-length`` is given and
    ``--steps`` is not, the steps keep the profile's tokens-per-step ratio for the new length
    (``steps = gen_length × profile steps / profile gen_length``, rounded to a whole number of steps per
    block, at least one a block), so ``--gen-length 512`` over a profile of 256 tokens in 256 steps
    decodes 512 steps, one token a step. Edits ``decode`` in place. Documented in ``ecache help decoding``."""
    given = decode_flags.get("gen_length")
    if given is None or decode_flags.get("steps") is not None or p_dec.get("steps") is None:
        return
    p_gen = p_dec.get("gen_length") or dataclass_defaults(DecodeConfig).get("gen_length")
    if not p_gen or p_gen == given:
        return
    steps = given * p_dec["steps"] / p_gen
    block = decode.get("block_length")
    if block and given % block == 0:  # a whole number of steps per block (plan_blocks checks the rest)
        n_blocks = given // block
        steps = max(1, round(steps / n_blocks)) * n_blocks
    decode["steps"] = max(1, round(steps))


def _model_key(name) -> str:
    """A profile's ``model:`` (``canonical_model_name`` of the loaded model, as calibrate writes it) and
    a ``--model`` name compared: aliases of one repository are one model, case does not matter."""
    from ..config import canonical_model_name
    from ..models.loader import ALIASES, EMBEDDED

    name = str(name)
    name = "tiny" if name in EMBEDDED else ALIASES.get(name, name)
    return canonical_model_name(name).lower()


def unused_cache_flags(policies: list[str], cache_flags: dict) -> list[str]:
    """The cache flags given (not None) that none of ``policies`` takes, as ``--flag`` names, e.g.
    ``--tau`` for ``--cache dual --tau 3`` (the caller warns once; the flag is ignored)."""
    used = set().union(*(policy_params_or_all(p) for p in policies))
    return [f"--{k.replace('_', '-')}" for k, v in cache_flags.items()
            if k != "policy" and v is not None and k not in used]


def warn_unused_cache_flags(policies: list[str], cache_flags: dict, used_by: str) -> None:
    """One warning on stderr naming the cache flags that none of ``policies`` takes
    (:func:`unused_cache_flags`), as ``<flags> is|are <used_by>; ignored``; ``used_by`` says by what,
    e.g. ``not used by --cache dual``. Nothing when every given flag is used."""
    unused = unused_cache_flags(policies, cache_flags)
    if unused:
        from ..console import warn

        warn(unused_flags_message(unused, used_by))


def unused_flags_message(unused: list[str], used_by: str) -> str:
    """``--tau is not used by --cache dual (…); ignored``: the one sentence for settings a policy does not
    take, with ``unused`` the settings as named where they were given (``--tau``, chat's ``/tau``)."""
    return f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} {used_by}; ignored"


def not_used_by(settings: "Settings") -> str:
    """The ``used_by`` of :func:`warn_unused_cache_flags` for one resolved policy: ``not used by --cache
    NAME``, naming the profile that chose it and the flag that overrides it (a profile's ``none`` under
    ``--threshold`` drops ``--tau`` silently otherwise) and the parameters it does take, one wording for
    every command."""
    notes = []
    if settings.policy_from_profile:
        notes.append(f"the policy of profile {settings.profile}; pass --cache to choose another")
    notes.append(policy_takes(settings.cache))
    return f"not used by --cache {settings.cache}" + (f" ({'; '.join(notes)})" if notes else "")


def policy_takes(name: str) -> str:
    """``it takes refresh_every``: the parameters of policy ``name``, as every place that ignores a cache
    setting the policy does not take says it (a flag, chat's ``/tau``, a request's ``tau``)."""
    return f"it takes {', '.join(sorted(policy_params(name))) or 'no parameter'}"


def warn_sampling_flags(decode: DecodeConfig, given: tuple[str, ...], sampler: str | None = None) -> None:
    """One warning on stderr for ``--top-k`` / ``--top-p`` (``given``: the flags named) at temperature 0 under
    LLaDA's rules (greedy decoding never samples, and LLaDA's confidence is the unfiltered probability, so
    the decoder drops them); Dream's rules keep them: they filter Dream's confidence. The rules are
    ``decode.schedule``, else those of the model's official sampler (``sampler``, once it is loaded)."""
    from ..decoding.commit import ignored_sampling

    why = ignored_sampling(decode, sampler, given) if given else None  # Engine.start warns the same rule
    if why:
        from ..console import warn

        warn(why)


def warn_model_rules(settings: "Settings", sampler: str) -> None:
    """The warnings that need the loaded model's official sampler (``ModelSpec.sampler``): ``--steps``
    beyond a block's masks under LLaDA's schedule (:func:`warn_idle_steps`) and ``--top-k`` / ``--top-p``
    that greedy decoding drops under LLaDA's rules (:func:`warn_sampling_flags`; a Dream model keeps them),
    ``--schedule`` that the threshold or factor rule ignores, or ``block`` on a model with LLaDA's schedule
    (:func:`warn_ignored_schedule`). Every command
    (serve too) calls it right after the model loads."""
    warn_idle_steps(settings.decode, sampler)
    warn_sampling_flags(settings.decode, settings.sampling_flags, sampler)
    warn_ignored_schedule(settings, sampler)


def warn_ignored_schedule(settings: "Settings", sampler: str) -> None:
    """One warning on stderr for each of the ``--schedule`` and ``--steps`` flags that does nothing under the
    run's threshold or factor rule (``--schedule block`` at fixed steps too, on a model with LLaDA's schedule)
    on a model whose official sampler is ``sampler``
    (``decoding.commit.ignored_schedule``, ``ignored_steps``: the rules ``Engine.start`` warns with too),
    naming where a threshold no flag gave came from (the model family's default, a profile)."""
    from ..decoding.commit import ignored_schedule_and_steps

    given = tuple(f for f in ("schedule", "steps") if f in settings.decode_given)
    for why in ignored_schedule_and_steps(settings.decode, sampler, given):
        if why:
            import re

            from ..console import warn

            if settings.parallel_source:
                why = re.sub(r"with (--(?:threshold|factor) [^:]+):", rf"with \1 ({settings.parallel_source}):",
                             why, count=1)
            warn(why)


def warn_idle_steps(decode: DecodeConfig, sampler: str) -> None:
    """One warning on stderr when ``--steps`` gives a block more steps than it has masks under LLaDA's
    schedule (``decoding.commit.idle_steps``, the rule ``Engine.start`` and the server warn by too)."""
    from ..decoding.commit import idle_steps

    why = idle_steps(decode, sampler)
    if why:
        from ..console import warn

        warn(why)


def _params_or_none(name: str) -> set[str]:
    """The parameters of policy ``name``; none for a name that is no policy (checked elsewhere)."""
    try:
        return policy_params(name)
    except KeyError:
        return set()


def policy_params_or_all(name: str, family=None) -> set[str]:
    """The parameters of policy ``name``; UsageError for a name that is none, listing the policies (those that
    apply to ``family``'s attention when the model's family is known: ``model_family``)."""
    try:
        return policy_params(name)
    except KeyError:
        from ..cache import policies_for, unknown_policy

        raise unknown_policy(name, names=policies_for(family is not None and family.block_causal)) from None


def no_room(spec, gen_length: int, block_length: int) -> str:
    """The one wording of a ``--gen-length`` that leaves no position for a prompt in ``spec.max_positions``,
    with the longest that leaves one (``engine.checks.room_fix``: whole blocks; a smaller block where no
    whole block of ``block_length`` fits)."""
    from ..engine.checks import gen_length_fit, room_fix

    most = gen_length_fit(spec, 1, block_length)
    fix = f"use at most {most} (whole blocks of {block_length})" if most > 0 else room_fix(spec, 1, block_length)
    return f"--gen-length {gen_length} leaves no room for a prompt in the model's {spec.max_positions} positions; " \
           f"{fix or 'the model has no room for a canvas'}"


def _check_room(gen_length: int, block_length: int, steps, parallel: bool, spec, prompt_tokens) -> None:
    """:func:`validate_decode`'s block plan (``decoding.schedule.plan_blocks``, its hints within the room the
    longest prompt leaves) and its refusal of a gen-length that leaves the prompts no room."""
    from ..decoding.schedule import plan_blocks
    from ..engine.checks import gen_length_fit, prompt_too_long

    known = spec is not None and block_length >= 1
    longest = max(prompt_tokens) if known and prompt_tokens else 1
    most = gen_length_fit(spec, longest, block_length) if known else None
    plan_blocks(gen_length, block_length, steps, parallel, most)
    if known and prompt_tokens and gen_length > most:  # the engine's check on the longest prompt, done early
        which = f"prompt {prompt_tokens.index(longest) + 1}" if len(prompt_tokens) > 1 else "prompt"
        raise UsageError(prompt_too_long(spec, longest, gen_length, block_length, which))
    if known and gen_length > gen_length_fit(spec, 1, block_length):  # too long for any prompt
        raise UsageError(no_room(spec, gen_length, block_length))


def validate_decode(d: dict, sampler: str | None = None, spec=None, prompt_tokens: list[int] | None = None) -> None:
    """Range checks for decode settings that the schedule does not check (one-line UsageErrors); with the
    model's ``sampler`` (its family's, when known before loading) also the sampler's own rules
    (``decoding.commit.check_sampler_options``: Dream's alg_temp / origin on the dream schedule only,
    ``--compat fastdllm`` on Dream only), so they fail before the model loads as the engine would.
    With the model's ``spec``, a ``gen_length`` that leaves no room beside the prompts is refused too:
    beside ``prompt_tokens`` (the token counts of prompts decoded as one batch, whose longest sets the
    canvas: :func:`runs.models.prompt_lengths`) when they are known before the load, in the engine's words
    (``engine.checks.prompt_too_long``), else beside a one-token prompt (:func:`no_room`)."""
    for key in ("temperature", "top_p", "threshold", "factor"):  # the flag's own range check and message
        check_setting(key, d.get(key), f"--{key.replace('_', '-')}")
    # the block schedule and remasking rule, checked here so that a bad flag fails before the model loads
    # (the engine checks them again for library callers)
    from ..decoding.remasking import validate_remasking
    from ..decoding.schedule import default_steps

    parallel = d.get("threshold") is not None or d.get("factor") is not None
    if d.get("threshold") is not None and d.get("factor") is not None:  # the engine's words (decoding/step.py)
        raise UsageError("--threshold and --factor are two parallel-decoding rules; pass only one")
    if d.get("gen_length") is not None and d.get("block_length") is not None:
        steps = default_steps(d["gen_length"], d.get("steps"), parallel)
        _check_room(d["gen_length"], d["block_length"], steps, parallel, spec, prompt_tokens)
    if d.get("remasking") is not None:
        validate_remasking(d["remasking"], parallel=parallel)
    from ..decoding.commit import validate_compat, validate_eps
    from ..decoding.schedule import validate_schedule

    if d.get("schedule") is not None:
        validate_schedule(d["schedule"])
    validate_compat(d.get("compat"))
    if d.get("eps") is not None:
        validate_eps(d["eps"])
    from ..decoding.commit import check_dream_options

    # alg_temp / origin; the family's default schedule is known only once the model is loaded (engine)
    check_dream_options(remasking=d.get("remasking") or "low_confidence", alg_temp=d.get("alg_temp"),
                        schedule=d.get("schedule"), parallel=parallel, compat=d.get("compat"),
                        low_eos_confidence=bool(d.get("low_eos_confidence")))
    if sampler is not None:
        from ..decoding.commit import check_sampler_options

        check_sampler_options(sampler, schedule=d.get("schedule"), compat=d.get("compat"),
                              remasking=d.get("remasking") or "low_confidence", alg_temp=d.get("alg_temp"),
                              parallel=parallel, low_eos_confidence=bool(d.get("low_eos_confidence")))


def check_settings_fit(settings: "Settings", spec) -> None:
    """The checks a run of ``settings`` meets on a loaded model with ``spec`` (a ``ModelSpec``) before its
    first step, made before a long-lived command (``ecache serve``, ``ecache chat``) takes requests: the
    cache policy's ``check_model`` (a block-diffusion model takes only ``none`` and ``block``, the
    bidirectional ones every policy but ``block``: docs/METHOD.md §5) and the decoder's build
    (``StepDecoder.build``: ``--edit-threshold`` only on block-diffusion models, the commit rule of the
    model's sampler). Raises the one-line UsageError the engine would raise at the first run."""
    import torch

    from ..decoding.step import StepDecoder

    policy = settings.policy()
    if hasattr(policy, "check_model"):
        policy.check_model(spec)
    none = torch.zeros(0, dtype=torch.long)
    StepDecoder.build(settings.decode, spec, none, none)


def policies_for(spec) -> list[str]:
    """The cache policies that apply to a model with ``spec`` (``ModelSpec.block_causal``): those whose
    ``attention`` is ``any`` or the model's kind (``CachePolicy.check_model``'s rule)."""
    from ..cache import policies_for as applying

    return applying(spec.block_causal)
