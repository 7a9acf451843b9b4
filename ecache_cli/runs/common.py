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
from ..config import dataclass_defaults, find_profile, load_profile, resolve
from ..decoding.config import DecodeConfig
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
    sandbox: str | None = None  # the profile's ``sandbox`` mode, if it has one (``--sandbox`` overrides)
    tau_source: str = "default"  # where τ came from: "flag" (--tau), "profile" (the file ``profile``), "default",
    # or "search" (ecache calibrate: τ is what it searches)
    profile_note: str | None = None  # e.g. "calibrated on 20 examples": the profile's ``measured.n``

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

    @property
    def tau(self) -> float | None:
        """EntropyCache's τ (nats) this run uses: the resolved one (defaults < profile < flags)."""
        return self.all_cache_params.get("tau", self.cache_params.get("tau", DEFAULT_TAU))

    def as_dict(self) -> dict:
        """JSON-ready: decode settings, cache policy and parameters, the profile file read (None when
        none), τ and where it came from (``tau_source``: flag, profile or default)."""
        return {"decode": self.decode.as_dict(), "cache": self.cache, "cache_params": self.cache_params,
                "profile": self.profile, "tau": None if self.tau_source == "search" else self.tau,
                "tau_source": self.tau_source}

    def tau_origin(self) -> str:
        """Where τ came from, for people: ``--tau``, ``profile PATH (shipped with ecache; calibrated on N
        examples)``, or ``built-in default``."""
        if self.tau_source == "flag":
            return "--tau"
        if self.tau_source == "profile" and self.profile:
            from ..config import packaged_profiles_dir

            notes = []
            try:
                if Path(self.profile).resolve().is_relative_to(packaged_profiles_dir()):
                    notes.append("shipped with ecache")
            except (OSError, ValueError):
                pass
            if self.profile_note:
                notes.append(self.profile_note)
            return f"profile {self.profile}" + (f" ({'; '.join(notes)})" if notes else "")
        return "built-in default"

    def describe(self, model: str, policies: list[str] | None = None, tau: str | None = None) -> str:
        """The one stderr line naming what a run uses: model, cache policy (or ``policies``), τ and its
        source (``tau``: another text for τ, e.g. calibrate's search). τ is named only when an
        entropy policy runs."""
        pols = policies or [self.cache]
        text = f"using model {model}, " + (f"cache {pols[0]}" if len(pols) == 1 else f"policies {','.join(pols)}")
        if tau is not None:
            return f"{text}, τ {tau}"
        if any(p.split(":")[0] == "entropy" for p in pols):
            return f"{text}, τ {self.tau:g} from {self.tau_origin()}"
        return f"{text} (no τ: only the entropy policy takes one)"


def resolve_settings(model: str, decode_flags: dict, cache_flags: dict, profile: str | None = None,
                     task: str | None = None) -> Settings:
    """defaults < profile (``--profile``, or ``<model>/<task>.yaml`` for ``--task``, or the model's
    ``default.yaml``, each the first found in ./profiles, the user's config folder, the package:
    ``config.profile_dirs``) < flags. Raises ConfigError/UsageError for bad profiles or values.

    Warns once on stderr for a profile calibrated for another model and for ``top_k`` / ``top_p`` in
    ``decode_flags`` at temperature 0 (:func:`warn_sampling_flags`), so every caller warns alike."""
    prof = None
    if profile:
        prof = load_profile(profile, model)
    elif task and (found := find_profile(model, task)) is not None:
        prof = load_profile(found)
    elif (found := find_profile(model, "default")) is not None:
        prof = load_profile(found)
    if prof and prof.get("model") is not None and _model_key(prof["model"]) != _model_key(model):
        from ..console import warn

        warn(f"profile {prof['_path']} was calibrated for model {prof['model']!r}, not {model!r}; its settings "
             "are used anyway (run `ecache calibrate` for this model)")
    p_dec = (prof or {}).get("decode") or {}
    p_cache = dict((prof or {}).get("cache") or {})
    decode = resolve(dataclass_defaults(DecodeConfig), p_dec, decode_flags)
    cache = resolve({"policy": "entropy", "tau": DEFAULT_TAU}, p_cache, cache_flags)
    name = cache.pop("policy")
    params = {k: v for k, v in cache.items() if v is not None and k in policy_params_or_all(name)}
    validate_decode(decode)
    make_policy(name, **params)  # validates name and values early
    decode_cfg = DecodeConfig(**decode)
    warn_sampling_flags(decode_cfg, decode_flags.get("top_k"), decode_flags.get("top_p"))
    if cache_flags.get("tau") is not None:
        tau_source = "flag"
    elif p_cache.get("tau") is not None:
        tau_source = "profile"
    else:
        tau_source = "default"
    n = ((prof or {}).get("measured") or {}).get("n") if isinstance((prof or {}).get("measured"), dict) else None
    return Settings(decode=decode_cfg, cache=name, cache_params=params,
                    profile=(prof or {}).get("_path"), all_cache_params={k: v for k, v in cache.items() if v is not None},
                    sandbox=(prof or {}).get("sandbox"),
                    tau_source=tau_source, profile_note=f"calibrated on {n} examples" if n else None)


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

        warn(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} {used_by}; ignored")


def warn_sampling_flags(decode: DecodeConfig, top_k, top_p) -> None:
    """One warning on stderr for ``--top-k`` / ``--top-p`` given at temperature 0 (greedy decoding
    never samples, so they change nothing)."""
    given = [f for f, v in (("--top-k", top_k), ("--top-p", top_p)) if v is not None]
    if given and not decode.temperature:
        from ..console import warn

        warn(f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} nothing at temperature 0 (greedy "
             "decoding); ignored; pass --temperature > 0 to sample")


def policy_params_or_all(name: str) -> set[str]:
    try:
        return policy_params(name)
    except KeyError:
        from ..cache import POLICIES

        raise UsageError(f"--cache {name!r} is not a cache policy; use one of {', '.join(POLICIES)}") from None


def validate_decode(d: dict) -> None:
    """Range checks for decode settings that the schedule does not check (one-line UsageErrors)."""
    import math

    for key in ("temperature", "top_p", "threshold", "factor"):  # inf or NaN would pass the range checks
        v = d.get(key)
        if v is not None and not math.isfinite(v):
            raise UsageError(f"--{key.replace('_', '-')} {v} must be a finite number")
    if d.get("temperature") is not None and d["temperature"] < 0:
        raise UsageError(f"--temperature {d['temperature']} must be ≥ 0 (0 = greedy)")
    if d.get("threshold") is not None and not 0 < d["threshold"] <= 1:  # a probability; 1.0 is reachable in float32
        raise UsageError(f"--threshold {d['threshold']} must be in (0, 1], a confidence (Fast-dLLM uses 0.9)")
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


def read_prompts(args: list[str] | None, input_file: Path | None, stdin: IO | None,
                 lines: bool = False, check_ids=None) -> Iterator[tuple]:
    """Yield (prompt, record) pairs: arguments first, else ``--input`` JSONL (``prompt``, ``messages``
    or ``prompt_ids`` field: a list of ints, yielded as that list), else stdin (one prompt per line,
    blank lines skipped). Raises DataError naming the file and line of a malformed record, after every
    earlier prompt has been yielded. ``check_ids``: None, or a function of a ``prompt_ids`` list that
    returns why the model cannot take it (``Engine.check_prompt_ids``), raised as that record's error.

    With ``lines`` the tuples are (prompt, record, line): ``line`` is the 1-based line number in the
    ``--input`` file or on stdin (blank lines are skipped but still counted, so it always points at
    the line the prompt came from), or the 1-based position of a prompt argument."""
    if args:
        for n, a in enumerate(args, 1):  # every argument checked before the first is yielded
            _check_utf8(a, f"prompt argument {n}", UsageError, "pass UTF-8 text (check the shell's encoding)")
            if not a.strip():  # the chat template would otherwise turn it into a non-empty prompt
                raise UsageError(f"prompt argument {n} {a!r}: a prompt is empty; give at least one token of text")
        for n, a in enumerate(args, 1):
            yield (a, {"prompt": a}, n) if lines else (a, {"prompt": a})
        return
    if input_file is not None:
        name = "stdin" if is_stdin(input_file) else input_file  # where a bad record is: file:line
        for n, line in _jsonl_lines(input_file):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{name}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            prompt = _prompt_of(rec, f"{name}:{n}")
            why = check_ids(prompt) if check_ids is not None and isinstance(rec.get("prompt_ids"), list) else None
            if why:
                raise DataError(f"{name}:{n}: {why}; give ids of the model's tokenizer")
            yield (prompt, rec, n) if lines else (prompt, rec)
        return
    if stdin is not None:
        warned = False
        try:
            for n, line in enumerate(stdin, 1):
                line = line.rstrip("\n").removesuffix("\r")  # CRLF files piped in
                _check_utf8(line, f"stdin line {n}", DataError, "pipe UTF-8 prompts, one per line")
                if not warned and line.lstrip().startswith("{") and _looks_like_record(line):
                    warned = True  # once per input
                    _warn_jsonl_stdin(n)
                if line.strip():
                    yield (line, {"prompt": line}, n) if lines else (line, {"prompt": line})
        except UnicodeDecodeError:
            raise DataError("stdin: not UTF-8 text; pipe UTF-8 prompts, one per line") from None
        return
    raise UsageError("no prompt given: pass it as an argument, pipe prompts on stdin (one per line) or use --input FILE.jsonl")


def _looks_like_record(line: str) -> bool:
    """A stdin line that parses as a JSON object with a prompt field (``prompt``, ``messages`` or
    ``prompt_ids``): a JSONL record, piped without ``--input -``."""
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and any(k in rec for k in ("prompt", "messages", "prompt_ids"))


def _warn_jsonl_stdin(n: int) -> None:
    """Warn that stdin line ``n`` looks like a JSONL record but is decoded as a plain prompt."""
    from ..console import warn

    warn(f"stdin line {n} looks like a JSONL record, but without --input - each stdin line is a plain prompt "
         "(the braces and quotes included); pass --input - to read JSONL records from stdin")


def is_stdin(input_file: Path | str | None) -> bool:
    """``--input -``: JSONL records read from stdin."""
    return input_file is not None and str(input_file) == "-"


def check_input_file(input_file: Path | None) -> None:
    """Before the model loads: ``--input`` must be ``-`` (stdin) or an existing file (DataError, exit 1).
    Anything readable that is not a folder counts: a named pipe, ``/dev/stdin``, a shell's ``<(...)``
    (the records are read once, as a stream)."""
    if input_file is None or is_stdin(input_file) or (input_file.exists() and not input_file.is_dir()):
        return
    if input_file.is_dir():
        raise DataError(f"--input {input_file} is a folder; give a JSONL file (one JSON object with a 'prompt' "
                        "field per line), or - for stdin")
    raise DataError(f"--input {input_file}: no such file; pass a JSONL file with a 'prompt' field per line")


def _jsonl_lines(input_file: Path, lenient: bool = False) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) of each line of an ``--input`` file (``-``: stdin), decoded line by
    line so a bad byte fails at its line, after earlier ones; a UTF-8 BOM at the start is accepted
    (``utf-8-sig``) and a CRLF line end is dropped. ``lenient``: a line that is not UTF-8 is yielded
    as (n, None) instead of raising DataError."""
    if is_stdin(input_file):
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream without bytes underneath (e.g. a test runner's)
            for n, line in enumerate(sys.stdin, 1):
                yield n, (line.removeprefix("\ufeff") if n == 1 else line).rstrip("\r\n")
            return
        fh = stream
    else:
        try:
            fh = open(input_file, "rb")
        except OSError as e:
            raise DataError(f"--input {input_file}: cannot read ({e.strerror})") from None
    try:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                if lenient:
                    yield n, None
                    continue
                where = "stdin" if is_stdin(input_file) else input_file
                raise DataError(f"{where}:{n}: not UTF-8 text; save the file as UTF-8 JSONL") from None
            yield n, line.rstrip("\r\n")
    finally:
        if fh is not getattr(sys.stdin, "buffer", None):
            fh.close()


def no_prompts(input_file: Path | None):
    """The error for a prompt source that gave nothing: an empty ``--input`` file (DataError, naming
    it) or empty stdin (UsageError)."""
    if input_file is not None:
        return DataError(f"--input {input_file} holds no record (the file is empty or blank); write one JSON "
                         "object with a 'prompt' field per line")
    return UsageError("no prompt given: stdin was empty; pipe prompts one per line, pass them as arguments or use "
                      "--input FILE.jsonl")


def _check_utf8(text: str, where: str, error: type, fix: str) -> None:
    """Python hands undecodable argv bytes (and stdin bytes under a C locale) over as lone surrogates,
    which the tokenizer rejects with a TypeError; name the culprit instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if 0xDC80 <= ord(bad) <= 0xDCFF else ""
        raise error(f"{where}: not UTF-8 text{byte} at character {e.start + 1}; {fix}") from None


def _prompt_of(rec, where: str) -> str | list:
    given = [k for k in ("prompt", "messages", "prompt_ids") if isinstance(rec, dict) and k in rec]
    if len(given) > 1:
        raise DataError(f"{where}: the record has {' and '.join(repr(k) for k in given)}; give one of prompt, "
                        "messages, prompt_ids")
    if isinstance(rec, dict) and "prompt_ids" in rec:
        ids = rec["prompt_ids"]
        if not isinstance(ids, list) or not ids:
            raise DataError(f"{where}: 'prompt_ids' must be a non-empty list of int token ids")
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise DataError(f"{where}: prompt_ids[{bad}] = {json.dumps(ids[bad])} is not an int token id")
        return list(ids)
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        if not rec["prompt"].strip():
            raise DataError(f"{where}: 'prompt' is empty; give at least one token of text")
        return rec["prompt"]
    if isinstance(rec, dict) and rec.get("messages") == []:
        raise DataError(f"{where}: 'messages' is empty; give at least one {{role, content}} message")
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in rec["messages"]):
        return rec["messages"]
    raise DataError(f"{where}: a record needs a string 'prompt', a 'messages' list of {{role, content}} "
                    "or a 'prompt_ids' list of token ids")


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
    """Reproducibility manifest: versions, git commit, device, dtype, threads, seed, settings, model, and
    how model-written code was isolated (``sandbox``: mode and programs per isolation; None if none ran)."""
    import transformers

    from ..tasks.sandbox import manifest_entry as sandbox_manifest

    dev = lm.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    return {
        "ecache_version": __version__, "git_commit": _git_commit(), "python": sys.version.split()[0],
        "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform(),
        "device": str(dev), "device_name": device_name, "dtype": str(lm.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "seed": seed, "model": lm.name, "model_path": str(lm.path),
        "model_family": lm.spec.family, "config_sha256": lm.config_hash,
        "settings": settings.as_dict() if settings else None, "sandbox": sandbox_manifest(), **(extra or {}),
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
