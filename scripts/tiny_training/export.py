"""Writing a trained model as a model directory in the official LLaDA format (``ecache_cli/data/tiny``).

The directory holds ``config.json`` (GSAI-ML/LLaDA-8B-Instruct's field names, from
``loop.model_config``), ``model.safetensors`` (the official tensor names, ``model.transformer.*``) and
the tokenizer files, so ``ecache_cli.models.loader.load_model`` reads it exactly like the 8B checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_sha256(tok_dir: Path) -> str:
    """Hex SHA-256 over the tokenizer files present in ``tok_dir`` (names and bytes). A state records
    it: the token ids it was trained with must not change under it."""
    h = hashlib.sha256()
    for f in TOKENIZER_FILES:
        if (tok_dir / f).exists():
            h.update(f.encode() + b"\0" + (tok_dir / f).read_bytes())
    return h.hexdigest()


def export(state_dict: dict, mcfg: dict, tok_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """Write ``out/config.json`` (``mcfg`` plus ``torch_dtype``), ``out/model.safetensors`` (every tensor
    of ``state_dict`` cast to ``dtype``: torch.float32 or torch.bfloat16) and the tokenizer files of
    ``tok_dir`` (copied unless ``out`` is ``tok_dir``). Creates ``out``; overwrites those files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(mcfg, torch_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in state_dict.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # package data: readable by everyone
    for f in TOKENIZER_FILES:
        src = tok_dir / f
        if src.exists() and src.resolve() != (out / f).resolve():
            shutil.copyfile(src, out / f)
