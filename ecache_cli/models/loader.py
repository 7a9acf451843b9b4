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
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError, UsageError
from .base import DiffusionLM
from .registry import ALIASES, FAMILIES, config_path, read_spec
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


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and float32 on CPU unless asked otherwise; raises UsageError for unknown names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not known; use one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """CUDA when available, else CPU; raises UsageError for an unusable device string."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
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
    if path.is_dir():
        return path, name
    if "/" in name and not path.exists() and name.count("/") == 1 and not name.startswith((".", "/")):
        return _from_hub(name, name), name
    valid = ", ".join([*EMBEDDED, *ALIASES])
    raise ModelLoadError(f"--model {name!r} is neither a known model ({valid}) nor a checkpoint directory")


def _download_command() -> str:
    """The hub's download command: ``hf download`` since huggingface_hub 0.34 (``huggingface-cli``
    before; huggingface_hub 1.0 removed it)."""
    try:
        from huggingface_hub import __version__ as version

        major, minor = (int(x) for x in version.split(".")[:2])
    except (ImportError, ValueError):
        return "hf download"
    return "hf download" if (major, minor) >= (0, 34) else "huggingface-cli download"


def _from_hub(repo: str, name: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.py", "*.jinja"]
    try:
        return Path(snapshot_download(repo, local_files_only=True, allow_patterns=patterns))
    except Exception:  # noqa: BLE001 - any miss falls through to the download attempt
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            return Path(snapshot_download(repo, allow_patterns=patterns))
        except Exception as e:  # noqa: BLE001 - network errors come in many types
            reason = f"the hub cannot be reached ({type(e).__name__})"
    raise ModelLoadError(
        f"model {name!r} needs {repo}, which is not in the Hugging Face cache and {reason}: "
        f"run `{_download_command()} {repo}` on a connected machine (or copy the folder) and pass --model DIR"
    )


def _weight_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (sharded index or single file)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from None
        files = {k: path / f for k, f in wm.items()}
        for f in set(files.values()):
            if not f.exists():
                raise ModelLoadError(f"{path}: shard {f.name} listed in model.safetensors.index.json is missing")
        return files
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
        warnings.warn(f"{path}: ignoring {len(extra)} unexpected tensors, e.g. {extra[0]}", stacklevel=2)
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


#: The files one of which a checkpoint folder needs for its tokenizer (Hugging Face's fast, BPE,
#: SentencePiece and WordPiece formats; tokenizer_config.json names the class).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


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
    from .fast_tokenizer import FastTokenizer, usable

    if usable(path):
        try:
            return FastTokenizer(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions for a bad file
            raise ModelLoadError(f"{path}: cannot load tokenizer.json "
                                 f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the "
                             "tokenizer files of the checkpoint into it")
    import transformers

    transformers.utils.logging.set_verbosity_error()  # config.json's model_type is unknown to transformers
    try:
        if _tokenizer_class(path) == "PreTrainedTokenizerFast" and (path / "tokenizer.json").is_file():
            return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as first:  # noqa: BLE001
        if (path / "vocab.json").exists() and (path / "merges.txt").exists():
            try:
                return transformers.Qwen2TokenizerFast.from_pretrained(str(path))
            except Exception:  # noqa: BLE001
                pass
        missing = "" if (path / "tokenizer.json").is_file() else \
            "; it has no tokenizer.json: copy the checkpoint's tokenizer files into it"
        raise ModelLoadError(f"{path}: cannot load the tokenizer "
                             f"({type(first).__name__}: {str(first).splitlines()[0]}){missing}") from None


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


def _checked(path: Path) -> Path:
    """``path`` once it has a config.json (ModelLoadError otherwise: the folder is no checkpoint)."""
    config_path(path)
    return path


def read_checkpoint_spec(path: Path, tokenizer) -> ModelSpec:
    """The checked :class:`ModelSpec` of the checkpoint folder ``path`` (its config.json, the eps of its
    generation_config.json), with the ids its family reads from ``tokenizer`` (end of turn, stop ids and,
    where config.json lacks them, mask and EOS). Raises ModelLoadError."""
    spec, _ = read_spec(path, tokenizer.get_vocab())
    return spec


def load_model(
    name_or_path: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Load a model by alias (``llada-8b``, ``dream-7b``, ...), the embedded ``tiny``, or a directory.

    Args:
        device: "auto" / None (CUDA when available, else CPU), "cpu", "cuda", "cuda:N".
        dtype: "auto" / None (bfloat16 on CUDA, float32 on CPU), or a dtype name.
        quantize: None / "none", "int8", "int4" (``"int4:64"``: group size 64) or "fp8": the blocks'
            projection weights quantized with torchao as each layer loads (``models/quantize.py``).
    Raises:
        ModelLoadError: missing model, config, shard or tensor, or an unsupported architecture.
        UsageError: a bad device, dtype or quantize value, or a format this device and dtype cannot run.
        EcacheError: ``quantize`` without torchao installed (the ``quant`` extra).
    """
    from . import quantize as qz

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    quant = qz.parse_quantize(quantize)
    if quant is not None:
        qz.check_supported(quant, dev, dt)
    path, name = resolve_path(name_or_path)
    spec = read_checkpoint_spec(path, tok := load_tokenizer(_checked(path)))
    if spec.mask_id == spec.pad_id:
        raise ModelLoadError(f"{path}: mask_token_id equals pad_token_id ({spec.mask_id}); "
                             "the canvas needs distinct ids")
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
