"""Resolve a model name or directory and load it: config.json, safetensors (single or sharded), tokenizer.

An official Hugging Face checkpoint directory loads with no conversion. Weights are read tensor by
tensor from memory-mapped safetensors into a model built on the ``meta`` device and assigned in place
(``load_state_dict(assign=True)``), so an 8B checkpoint is never materialised twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError, UsageError
from .base import DiffusionLM
from .registry import ALIASES, FAMILIES, config_path, read_spec, repo_id_form
from .spec import ModelSpec

#: Names of the embedded default model shipped inside the package.
EMBEDDED = ("tiny", "llada-tiny")
DEFAULT_MODEL = "tiny"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A loaded checkpoint: the model, its tokenizer and the facts the engine needs.

    ``config_hash`` is the SHA-256 of config.json (for reproducibility manifests); ``chat`` tells
    whether the tokenizer carries a chat template (instruct checkpoints).
    """

    model: DiffusionLM
    tokenizer: object
    spec: ModelSpec
    path: Path
    name: str
    config_hash: str
    device: torch.device
    dtype: torch.dtype

    @property
    def chat(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def embedded_dir() -> Path:
    """Directory of the embedded default model (package data)."""
    return Path(__file__).resolve().parent.parent / "data" / "tiny"


def local_folder(model: str | None) -> Path | None:
    """The folder ``--model`` names on this machine without a download: the embedded model's (None, or one
    of its names), else the folder it names; None for an alias or repo id (a hub model)."""
    if model is None or str(model) in EMBEDDED:
        return embedded_dir()
    path = Path(str(model)).expanduser()
    return path if path.is_dir() else None


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and float32 on CPU unless asked otherwise; raises UsageError for unknown names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not a dtype; use one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """CUDA when available, else CPU; raises UsageError for an unusable device string."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {device!r} is not a device; use one of auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device} asked for CUDA but torch sees no GPU; use --device cpu")
    return dev


def resolve_path(name_or_path: str | os.PathLike | None) -> tuple[Path, str]:
    """Map an alias, the embedded name or a directory to a local checkpoint directory.

    Aliases are looked up in the Hugging Face hub cache (``huggingface_hub.snapshot_download`` with
    ``local_files_only``), then, unless ``HF_HUB_OFFLINE`` is set, downloaded. Raises
    :class:`ModelLoadError` (one line naming the repository and how to get it) when neither works.
    """
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    local = Path(name).expanduser()
    if (name in EMBEDDED or name in ALIASES) and local.is_dir():  # a folder named like a known model
        from ..console import err

        if (local / "config.json").is_file():
            err.print(f"note: --model {name}: using the checkpoint folder {local.resolve()} (a folder of that name "
                      f"is here); for the {'embedded' if name in EMBEDDED else 'hub'} model run from another folder",
                      markup=False, highlight=False)
            return local, name
        err.print(f"note: --model {name}: the folder {local.resolve()} has no config.json, so it is not a checkpoint; "
                  f"using the {'embedded' if name in EMBEDDED else 'hub'} model {name}", markup=False, highlight=False)
    if name in EMBEDDED:
        path = embedded_dir()
        if not (path / "config.json").exists():
            raise ModelLoadError(f"the embedded model is missing from {path}; reinstall ecache or pass --model DIR")
        return path, name
    if name in ALIASES:
        return _from_hub(ALIASES[name], name), name
    path = Path(name).expanduser()
    if path.is_dir() and name.strip():  # '' would be the current folder
        return path, name
    if not path.exists() and repo_id_form(name):
        return _from_hub(name, name), name
    raise ModelLoadError(unknown_model(name, "--model"))


def unknown_model(name: str, flag: str = "") -> str:
    """The one wording of an unknown model name: ``load_model``'s, ``ecache models show NAME``'s and every
    command's ``--model``. A name that is a file, or written as a path (``/``, ``./``, ``~`` first, or more
    than one ``/``: no repo id) that does not exist, is named as such; any other name gets the three kinds
    of model it is none of."""
    head = f"{flag + ' ' if flag else ''}{name!r}"
    path = Path(name).expanduser()
    if name.strip() and path.is_file():
        return (f"{head} is a file, not a checkpoint folder (a folder with config.json and the weights); pass "
                "its folder, or run `ecache models` for the known models")
    if ("/" in name or name.startswith("~")) and not repo_id_form(name):
        return (f"{head}: no such folder; pass a checkpoint folder that exists, or run `ecache models` for the "
                "known models")
    return (f"{head} is neither a model ecache knows, a checkpoint folder nor a Hugging Face repo id (org/name); "
            "run `ecache models` for the known models")


def _download_command() -> str:
    """The hub's download command: ``hf download`` since huggingface_hub 0.34 (``huggingface-cli``
    before; huggingface_hub 1.0 removed it)."""
    try:
        from huggingface_hub import __version__ as version

        major, minor = (int(x) for x in version.split(".")[:2])
    except (ImportError, ValueError):
        return "hf download"
    return "hf download" if (major, minor) >= (0, 34) else "huggingface-cli download"


#: The files an alias's snapshot needs (``hf download`` of the rest is skipped): config, weights, tokenizer,
#: the official modeling code and chat templates.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.py", "*.jinja"]


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, read from the environment at each call (huggingface_hub reads it
    once, at its import): ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (by default ``~/.cache/huggingface/hub``)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(os.path.expandvars(env)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether downloads are off: ``$HF_HUB_OFFLINE`` (or ``$TRANSFORMERS_OFFLINE``) set to a true value."""
    return any(os.environ.get(k, "0").strip() not in ("0", "", "false", "False", "FALSE", "no", "off")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_snapshot(repo: str) -> Path | None:
    """The local snapshot folder of ``repo`` (its ``main`` revision) in :func:`hub_cache_dir`, found by its
    ``config.json`` (``huggingface_hub.try_to_load_from_cache``: no network), or None when it is not
    there."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, "config.json", cache_dir=hub_cache_dir())
    except Exception:  # noqa: BLE001 - an invalid repo id, an unreadable cache: not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


INDEX = "model.safetensors.index.json"
#: How many missing shards :func:`missing_weights_text` names before "and N more".
SHARDS_SHOWN = 3


def _index_shards(path: Path) -> list[str] | None:
    """The shard files ``path``'s :data:`INDEX` lists, each once, in the index's order (that of its
    ``weight_map``); None when the index cannot be read."""
    try:
        return list(dict.fromkeys(json.loads((path / INDEX).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def missing_weights(path: Path) -> list[str]:
    """The weight files a checkpoint folder lacks: the shards its ``model.safetensors.index.json`` lists
    that are not there (an interrupted download), in the index's order; ``model.safetensors`` when it has
    neither; [] when complete. An unreadable index counts as missing."""
    return _missing_and_listed(path)[0]


def _missing_and_listed(path: Path) -> tuple[list[str], list[str] | None]:
    """:func:`missing_weights` and the shards the index lists (None without a readable index), from one read."""
    if (path / INDEX).is_file():
        shards = _index_shards(path)
        if shards is None:
            return [INDEX], None
        return [f for f in shards if not (path / f).is_file()], shards
    return ([] if (path / "model.safetensors").is_file() else ["model.safetensors"]), None


def missing_weights_text(path: Path) -> str | None:
    """The one wording of what :func:`missing_weights` finds, None when nothing is missing. Missing shards:
    ``2 of 2 shards listed in model.safetensors.index.json are missing (model-00001-of-00002.safetensors,
    model-00002-of-00002.safetensors)``, every missing shard in the index's order, or past
    :data:`SHARDS_SHOWN` the first ones and ``and N more``. ``ecache generate`` (the load:
    :func:`missing_weights_error`) and ``ecache models show`` (its local row) both say it."""
    missing, shards = _missing_and_listed(path)
    if not missing:
        return None
    if missing == [INDEX]:
        return f"{INDEX} is unreadable"
    if shards is None:
        return f"neither model.safetensors nor {INDEX} is there"
    shown = ", ".join(missing[:SHARDS_SHOWN])
    if len(missing) > SHARDS_SHOWN:
        shown += f" and {len(missing) - SHARDS_SHOWN} more"
    return (f"{len(missing)} of {len(shards)} shard{'s' if len(shards) > 1 else ''} listed in {INDEX} "
            f"{'is' if len(missing) == 1 else 'are'} missing ({shown})")


def pull_fix(name: str, repo: str) -> str:
    """The fix for a model of the hub cache (an alias or repo id) that is missing or partly there, as
    ``ecache models show`` and the load give it."""
    return f"run `ecache models pull {name}` (or `{_download_command()} {repo}` on a connected machine)"


def missing_weights_error(path: Path, name: str | None = None) -> str | None:
    """The error of a checkpoint folder that lacks weight files, None when it lacks none: ``PATH:`` then
    :func:`missing_weights_text` then the fix. For ``name`` an alias or repo id (the folder is its snapshot
    in the hub cache): :func:`pull_fix`; for a folder: copy or download the missing files into it."""
    text = missing_weights_text(path)
    if text is None:
        return None
    if name is not None and local_folder(name) is None:  # an alias or repo id
        fix = pull_fix(name, ALIASES.get(name, name))
    else:
        what = "the missing shards" if "shard" in text else "the checkpoint's weight files"
        fix = f"copy or download {what} into {path}"
    return f"{path}: {text}; {fix}"


def _from_hub(repo: str, name: str) -> Path:
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo, local_files_only=True, allow_patterns=HUB_PATTERNS, cache_dir=cache))
    except Exception:  # noqa: BLE001 - any miss falls through to the download attempt
        pass
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, cache_dir=cache))
        except Exception as e:  # noqa: BLE001 - network errors come in many types
            reason = f"the hub cannot be reached ({type(e).__name__})"
    raise ModelLoadError(
        f"model {name!r} needs {repo}, which is not in the Hugging Face cache and {reason}: "
        f"run `{_download_command()} {repo}` on a connected machine (or copy the folder) and pass --model DIR"
    )


def download(repo: str, name: str) -> Path:
    """Fetch ``repo`` into the hub cache (``snapshot_download`` with :data:`HUB_PATTERNS`; progress bars on
    stderr) and return its snapshot folder. Raises ModelLoadError (one line: why, and the command to run
    on a connected machine) when ``HF_HUB_OFFLINE`` is set or the hub cannot be reached."""
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
    else:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, cache_dir=hub_cache_dir()))
        except Exception as e:  # noqa: BLE001 - network, authorisation and disk errors come in many types
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            reason = f"the download failed ({type(e).__name__}{': ' + first if first else ''})"
    raise ModelLoadError(f"cannot download {name!r} ({repo}): {reason}; run `{_download_command()} {repo}` on a "
                         f"connected machine and copy its cache ({hub_cache_dir()}) or the folder here")


def _weight_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (sharded index or single file)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from None
        error = missing_weights_error(path)  # inspect_model said it first, with the name's fix
        if error:
            raise ModelLoadError(error)
        return {k: path / f for k, f in wm.items()}
    single = path / "model.safetensors"
    if single.exists():
        from safetensors import safe_open

        with _readable(single):
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
    raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json "
                         "(only safetensors checkpoints load)")


@contextlib.contextmanager
def _readable(file: Path):
    """A truncated or corrupt safetensors file (an interrupted download, a bad copy) raises
    SafetensorError deep in the reader; turn it into one line naming the file and the fix."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as e:
        size = file.stat().st_size if file.exists() else 0
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{file}: not a readable safetensors file ({size:,} bytes; {reason}); it is truncated "
                             "or corrupt: download or copy it again") from None


def load_weights(model: DiffusionLM, path: Path, device: torch.device, dtype: torch.dtype, quantize=None) -> None:
    """Read every expected tensor, check its shape, convert and assign it into the meta-built model.

    ``quantize`` (a ``quantize.Quantization``): read and assign one layer at a time, quantizing each
    right after (``quantize.layer_groups``), so only one layer is ever in full precision.
    Raises ModelLoadError naming a missing or mis-shaped tensor. Unexpected extra tensors are ignored
    with a warning (official checkpoints carry none).
    """

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    files = _weight_files(path)
    missing = [k for k in expected if k not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{path}: tensor {missing[0]} is missing from the checkpoint{more}")
    extra = sorted(set(files) - set(expected))
    if extra:
        from ..console import warn

        warn(f"{path}: ignoring {len(extra)} tensor(s) the config.json does not use, e.g. {extra[0]} (a tied "
             "config with a separate head, or a variant ecache does not run)")
    from . import quantize as qz

    for layer, group in enumerate(qz.layer_groups(model) if quantize else [list(expected)]):
        _load_group(model, path, files, expected, group, device, dtype, own=bool(quantize))
        if quantize and layer:
            qz.quantize_layer(model, layer - 1, quantize)
            qz.release_freed_memory()


def _load_group(model, path, files, expected, group, device, dtype, own: bool = False) -> None:
    """Read the tensors named ``group`` and assign them (see :func:`load_weights`). ``own``: copy a tensor
    the conversion left as it was, since it is a view of the memory-mapped file, and one such view kept
    (the embedding) would keep every page read so far of the file resident."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for k in group:
        by_file.setdefault(files[k], []).append(k)
    state: dict[str, torch.Tensor] = {}
    for f, keys in by_file.items():
        with _readable(f), safe_open(f, framework="pt", device="cpu") as sf:
            for k in keys:
                t = sf.get_tensor(k)
                if tuple(t.shape) != expected[k]:
                    raise ModelLoadError(
                        f"{path}: tensor {k} has shape {tuple(t.shape)} but config.json implies {expected[k]}"
                    )
                if not t.is_floating_point():  # cast to floats, its integers would decode garbage with exit 0
                    raise ModelLoadError(
                        f"{path}: tensor {k} is stored as {str(t.dtype).replace('torch.', '')}, not as floating-point "
                        "weights; ecache loads float32, bfloat16 or float16 checkpoints and quantizes them itself "
                        "(--quantize): use the checkpoint's original weights")
                state[k] = t.to(device=device, dtype=dtype)
                if own and state[k].data_ptr() == t.data_ptr():
                    state[k] = state[k].clone()
                _check_finite(state[k], t, k, path, dtype)
                del t
    model.load_state_dict(state, strict=len(state) == len(expected), assign=True)


def _check_finite(loaded: torch.Tensor, stored: torch.Tensor, name: str, path: Path, dtype: torch.dtype) -> None:
    """Refuse a weight with NaN or infinite values: decoding with it gives garbage (often empty answers)
    with exit 0. One check per tensor at load (``torch.isfinite``); the stored tensor is examined only
    to say whether the checkpoint holds them or the conversion to ``dtype`` overflowed.
    Raises ModelLoadError (one line)."""
    if not loaded.is_floating_point() or bool(torch.isfinite(loaded).all()):
        return
    if bool(torch.isfinite(stored).all()):
        raise ModelLoadError(f"{path}: tensor {name} overflows {str(dtype).replace('torch.', '')} (values beyond its "
                             "range become inf); load it with --dtype float32 or bfloat16")
    bad = int((~torch.isfinite(stored)).sum())
    raise ModelLoadError(f"{path}: tensor {name} holds {bad} non-finite value(s) (NaN or inf) of {stored.numel()}; the "
                         "checkpoint is broken (a diverged training run or a bad conversion): use another checkpoint")


def _header_numel(file: Path) -> int | None:
    """The element count of every tensor of one safetensors file, from its JSON header alone (8 bytes of
    length, then the header: no tensor is read), or None when the header is unreadable."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 * 2**20:
                return None
            header = json.loads(f.read(size))
        total = 0
        for key, info in header.items():
            if key != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= int(d)
                total += n
        return total
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def weight_bytes(path: Path, dtype: torch.dtype, spec: ModelSpec | None = None) -> int:
    """The bytes the checkpoint folder's weights take once loaded in ``dtype``: the element count of every
    tensor in its safetensors headers (cheap: no weight is read) times the dtype's size; where a header
    cannot be read, ``spec.n_params`` times it (0 without a spec)."""
    size = torch.empty((), dtype=dtype).element_size()
    files = [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            files = []
    counts = [_header_numel(f) for f in files]
    if files and all(c is not None for c in counts):
        return sum(counts) * size
    return (spec.n_params if spec is not None else 0) * size


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` for the weights: CUDA ``torch.cuda.mem_get_info`` (free), CPU
    ``psutil.virtual_memory().available``; None for other devices or when it cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            import psutil

            return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no driver, no psutil: no check rather than no load
        return None
    return None


def gib(n: int, digits: int = 1) -> str:
    """Bytes for people: ``14.9 GiB``, ``2.3 MiB`` below one GiB (``digits`` after the point)."""
    return f"{n / 2**30:.{digits}f} GiB" if n >= 2**30 else f"{n / 2**20:.{digits}f} MiB"


def _apart(need: int, free: int) -> tuple[str, str]:
    """``need`` and ``free`` for people, with as many digits as tell them apart (bytes when 3 do not)."""
    for digits in (1, 2, 3):
        a, b = gib(need, digits), gib(free, digits)
        if a != b:
            return a, b
    return f"{need:,} bytes", f"{free:,} bytes"


#: Bytes a quantized projection weight takes per parameter (scales included, about): int8 and fp8 one,
#: int4 half plus a bfloat16 scale and zero point per group of 128.
QUANT_BYTES = {"int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / 128}


def quantized_bytes(total: int, spec: ModelSpec | None, dtype: torch.dtype, fmt: str, outer: int | None = None) -> int:
    """The bytes of weights that take ``total`` bytes in ``dtype`` once the blocks are quantized to ``fmt``
    (``int8``, ``int4``, ``fp8``): the embeddings and head (``outer`` parameters; from ``spec`` when None)
    stay in ``dtype``, every other parameter takes :data:`QUANT_BYTES` (an estimate: norms and routers, a
    small share, are counted as quantized too)."""
    size = torch.empty((), dtype=dtype).element_size()
    if outer is None:
        outer = spec.vocab_size * spec.d_model * (1 if spec.tie_embeddings else 2)
    return int(outer * size + max(total // size - outer, 0) * QUANT_BYTES[fmt])


def check_fits(path: Path, name: str, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
               quant=None) -> None:
    """Refuse, before any weight is read, a checkpoint whose weights in ``dtype`` (:func:`weight_bytes`) need
    more than ``device``'s free memory (:func:`free_memory`); with ``quant`` (a ``quantize.Quantization``:
    the load quantizes layer by layer) the blocks' weights count at their quantized size
    (:data:`QUANT_BYTES`), the embeddings and head at ``dtype``'s. Raises ModelLoadError: one line naming
    the need, the free memory, a smaller dtype when one would fit, and ``--force`` (``force=True``)."""
    free = free_memory(device)
    need = weight_bytes(path, dtype, spec)
    if quant is not None:
        need = quantized_bytes(need, spec, dtype, quant.fmt)
    if free is None or need <= free:
        return
    dt = str(dtype).replace("torch.", "") + (f", {quant.fmt} blocks" if quant is not None else "")
    where = "this machine's RAM" if device.type == "cpu" else str(device)
    smaller = ""
    if dtype == torch.float32 and (half := weight_bytes(path, torch.bfloat16, spec)) <= free:
        smaller = f"use --dtype bfloat16 ({gib(half)}), "
    shown_need, shown_free = _apart(need, free)
    raise ModelLoadError(f"model {name!r} needs {shown_need} for its weights in {dt} but {where} has {shown_free} "
                         f"free; {smaller}free memory, or load anyway with --force "
                         "(Python: load_model(..., force=True))")


#: The files one of which a checkpoint folder needs for its tokenizer (Hugging Face's fast, BPE,
#: SentencePiece and WordPiece formats; tokenizer_config.json names the class).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def has_tokenizer_files(path: Path) -> bool:
    """Whether the checkpoint folder holds any of :data:`TOKENIZER_FILES`: a folder without one has no
    tokenizer at all (``ecache models show`` notes it and reads the config alone); one with a file that does
    not load has a broken tokenizer (:func:`load_tokenizer`'s error, for every command alike)."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: Path):
    """The checkpoint directory's tokenizer, without trust_remote_code.

    A directory whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (the embedded model,
    LLaDA) loads that class directly from ``tokenizer.json`` + its config (special tokens, chat
    template), skipping AutoTokenizer's class resolution (~0.3 s of a cold start); the result is the
    same object AutoTokenizer builds. Anything else goes through AutoTokenizer. Dream's official
    tokenizer is a remote-code Qwen2 BPE (vocab.json + merges.txt); when AutoTokenizer cannot build it,
    the same files load as ``Qwen2TokenizerFast``. Raises ModelLoadError (one line) when nothing loads.

    Where :func:`fast_tokenizer.usable` says so (the embedded model), the tokenizer is a
    :class:`~ecache_cli.models.fast_tokenizer.FastTokenizer`: the same ids and texts straight from the
    ``tokenizers`` library, without importing transformers (0.4-1.3 s of a cold start).
    """
    from .fast_tokenizer import FastTokenizer, quiet_transformers, usable

    if usable(path):
        try:
            return FastTokenizer(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions for a bad file
            raise ModelLoadError(f"{path}: cannot load tokenizer.json "
                                 f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if path.is_dir() and not has_tokenizer_files(path):
        raise ModelLoadError(f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the "
                             "tokenizer files of the checkpoint into it")
    import transformers

    transformers.utils.logging.set_verbosity_error()  # config.json's model_type is unknown to transformers
    try:
        with quiet_transformers():  # AutoTokenizer reads config.json too: rope_scaling's FutureWarning
            if _tokenizer_class(path) == "PreTrainedTokenizerFast" and (path / "tokenizer.json").is_file():
                return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
            return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as first:  # noqa: BLE001
        if (path / "vocab.json").exists() and (path / "merges.txt").exists():
            try:
                with quiet_transformers():
                    return transformers.Qwen2TokenizerFast.from_pretrained(str(path))
            except Exception:  # noqa: BLE001
                pass
        missing = "" if (path / "tokenizer.json").is_file() else \
            "; it has no tokenizer.json: copy the checkpoint's tokenizer files into it"
        raise ModelLoadError(f"{path}: cannot load the tokenizer "
                             f"({type(first).__name__}: {str(first).splitlines()[0]}){missing}") from None


def no_chat_template_note(loaded) -> str | None:
    """The note ``runtime.load_for_command`` prints (for generate, profile, trace-drift and calibrate: the
    commands with ``--chat/--no-chat``) for a checkpoint folder without tokenizer_config.json, where the
    chat template lives, of a family whose checkpoints have a chat format (an end-of-turn token): prompts go
    in as plain text, not through the template they would get with the checkpoint's file. None when the
    tokenizer has a chat template, the folder has the file, or the family has no chat format."""
    path = getattr(loaded, "path", None)
    if path is None or loaded.chat or (Path(path) / "tokenizer_config.json").is_file():
        return None
    if not FAMILIES[loaded.spec.family].eot_token:
        return None
    return (f"{path} has no tokenizer_config.json, so prompts go in without the chat template; copy the "
            "checkpoint's tokenizer_config.json into it, or pass --no-chat for plain prompts")


def _tokenizer_class(path: Path) -> str | None:
    """``tokenizer_class`` of the directory's tokenizer_config.json (None when absent or unreadable)."""
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def _skip_init():
    """Build modules without their random initialisers (``torch.nn.init``): the weights are assigned
    from the checkpoint right after, and on the meta device there is nothing to fill anyway. It also
    keeps a cold start fast: torch routes ``normal_`` on meta tensors (nn.Embedding's init) through
    ``torch._refs``, whose first call imports torch._dynamo (1-2 s). The same trick as transformers'
    ``no_init_weights``; the original functions are restored on exit."""
    from torch.nn import init

    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
             "xavier_normal_", "zeros_", "ones_")
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


@dataclass
class ModelMeta:
    """What :func:`inspect_model` finds before any weight is read: the checkpoint's ``path`` and
    ``name``, its ``tokenizer`` and ``spec`` (a ``ModelSpec``), the ``device`` and ``dtype`` it would load
    on, and ``quant`` (a ``quantize.Quantization``, or None)."""

    path: Path
    name: str
    tokenizer: object
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    quant: object = None


def inspect_model(name_or_path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                  dtype: str | torch.dtype | None = None, force: bool = False,
                  quantize=None) -> ModelMeta:
    """The checks of :func:`load_model` that read no weight (the device, dtype and quantize values, the
    folder, config.json, the tokenizer, the spec, and without ``force`` whether the weights fit the free
    memory, from the safetensors headers), and what they find (:class:`ModelMeta`). For a check made before
    the model loads elsewhere (``ecache serve --ray``: the replicas load it). Arguments and errors as
    :func:`load_model`'s, less the faults only reading the weights finds (a missing tensor, a shard that
    cannot be read); shards the index lists that are not there are reported here
    (:func:`missing_weights_error`: every one, and the fix)."""
    from . import quantize as qz

    if not isinstance(force, bool):
        raise UsageError(f"load_model(force={force!r}): force is True or False")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    quant = qz.parse_quantize(quantize, source=qz.API)
    if quant is not None:
        qz.check_supported(quant, dev, dt)
    path, name = resolve_path(name_or_path)
    config_path(path)  # a folder without config.json is no checkpoint: say so before its tokenizer
    if _index_shards(path) is not None and (error := missing_weights_error(path, name)):  # shards not there
        raise ModelLoadError(error)
    tok = load_tokenizer(path)
    spec, _ = read_spec(path, tok.get_vocab())  # ids only the tokenizer knows: end of turn, stops, LLaDA-MoE's
    if spec.mask_id == spec.pad_id:
        raise ModelLoadError(f"{path}: mask_token_id equals pad_token_id ({spec.mask_id}); "
                             "the canvas needs distinct ids")
    if not force:
        check_fits(path, name, spec, dev, dt, quant)
    return ModelMeta(path, name, tok, spec, dev, dt, quant)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    quantize=None,
) -> LoadedModel:
    """Load a model by alias (``llada-8b``, ``dream-7b``, ...), the embedded ``tiny``, or a directory.

    Args:
        device: "auto" / None (CUDA when available, else CPU), "cpu", "cuda", "cuda:N".
        dtype: "auto" / None (bfloat16 on CUDA, float32 on CPU), or a dtype name.
        force: load even when the weights need more than the device's free memory (otherwise refused
            before any weight is read: :func:`check_fits`).
        quantize: None / "none", "int8", "int4" (``"int4:64"``: group size 64) or "fp8", any case: the
            blocks' projection weights quantized with torchao as each layer loads (``models/quantize.py``);
            or a ``quantize.Quantization`` already parsed (``quantize.parse_quantize``: the CLI's, naming
            the flag or profile that wrote it).
    Raises:
        ModelLoadError: missing model, config, shard or tensor, an unsupported architecture, or weights
            that do not fit the device's free memory (without ``force``).
        UsageError: a bad device, dtype or quantize value (named as the argument, e.g.
            ``load_model(quantize='int4:16') names a group size int4's kernels do not take; use one of 32,
            64, 128, 256``), a format this device and dtype cannot run, or an int4 group size that does not
            divide a layer's input columns.
        EcacheError: ``quantize`` without torchao installed (the ``quant`` extra).
    """
    from . import quantize as qz

    meta = inspect_model(name_or_path, device, dtype, force, quantize)
    path, name, tok, spec, dev, dt, quant = (meta.path, meta.name, meta.tokenizer, meta.spec, meta.device, meta.dtype,
                                             meta.quant)
    with torch.device("meta"), _skip_init():
        model = FAMILIES[spec.family].model_class(spec)
    if quant is not None:
        qz.check_shapes(model, quant)
    load_weights(model, path, dev, dt, quant)
    model.eval()
    model.quantization = quant
    model.fuse_projections()  # skips the quantized layers
    config_hash = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return LoadedModel(model=model, tokenizer=tok, spec=spec, path=path, name=name,
                       config_hash=config_hash, device=dev, dtype=dt)
