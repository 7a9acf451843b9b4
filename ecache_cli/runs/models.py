"""What ``ecache models`` computes: the list of known models, one model's facts, and fetching one.

:func:`catalogue` lists the embedded ``tiny`` and every alias of the family registry with its family,
kind, parameter count and the memory its weights need in bfloat16 and float32 (parameters × 2 or × 4
bytes), and whether it is in the local Hugging Face cache (looked up on disk alone:
``models.loader.hub_snapshot``; nothing here touches the network but :func:`pull`). :func:`describe`
gathers one model's facts (config summary, special tokens, chat template, default profile) from its
checkpoint when one is local, else what the registry knows. The tables (``ecache models``, and the
README's "Supported models", :func:`readme_table`) are built here from the same rows, so they cannot
disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelLoadError, UsageError

#: Whether a model's files are here, one vocabulary for the table, ``--json`` and ``show``: "yes" (the
#: embedded model, a complete checkpoint folder or snapshot), "part" (a weight file is missing), "no".
LOCAL = ("yes", "part", "no")


def count(n: int) -> str:
    """A parameter count for people: ``8.0B``, ``1.7B``, ``1.2M``, ``950K``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def params_text(params: int, active: int) -> str:
    """``8.0B``; for a mixture of experts also the parameters one token uses: ``7.4B (1.7B active)``."""
    return count(params) + (f" ({count(active)} active)" if active and active != params else "")


def memory(params: int) -> dict[str, int]:
    """The bytes ``params`` weights take in bfloat16 and float32."""
    return {"bf16_bytes": params * 2, "fp32_bytes": params * 4}


def _gib(n: int) -> str:
    """Bytes for people (``models.loader.gib``): ``14.9 GiB``, ``2.3 MiB``."""
    from ..models.loader import gib

    return gib(n)


def local_state(repo: str) -> tuple[str, Path | None, list[str]]:
    """Whether ``repo`` is in the local Hugging Face cache: ("yes" | "part" | "no", its snapshot folder or
    None, the weight files it lacks). "part": config.json is there but a weight file is not (an
    interrupted download)."""
    from ..models.loader import hub_snapshot, missing_weights

    snap = hub_snapshot(repo)
    if snap is None:
        return "no", None, []
    missing = missing_weights(snap)
    return ("part" if missing else "yes"), snap, missing


def _embedded_row() -> dict:
    """The row of the embedded model: its parameter count from its own config.json."""
    from ..models.loader import embedded_dir
    from ..models.registry import read_spec

    path = embedded_dir()
    spec, _ = read_spec(path)
    try:
        tasks = json.loads((path / "ecache_model.json").read_text()).get("trained_tasks") or []
    except (OSError, ValueError, AttributeError):
        tasks = []
    kind = f"demo ({', '.join(tasks)})" if tasks else "demo"
    return {"alias": "tiny", "repo": None, "family": spec.family, "kind": kind, "params": spec.n_params,
            "active_params": spec.n_active_params, **memory(spec.n_params), "local": "yes", "path": str(path)}


def catalogue(check_local: bool = True) -> list[dict]:
    """One dict per model: the embedded ``tiny``, then every alias in registry order, with ``alias``,
    ``repo`` (None for tiny), ``family``, ``kind``, ``params``, ``active_params`` (= params for a dense
    model), ``bf16_bytes``, ``fp32_bytes``, ``local`` (:data:`LOCAL`: "yes" | "part" | "no"; None
    without ``check_local``) and ``path`` (the local snapshot, or None)."""
    from ..models.registry import FAMILIES

    rows = [_embedded_row()]
    for fam in FAMILIES.values():
        for name, info in fam.aliases.items():
            state, snap = (local_state(info.repo)[:2] if check_local else (None, None))
            rows.append({"alias": name, "repo": info.repo, "family": fam.name, "kind": info.kind,
                         "params": info.params, "active_params": info.active or info.params, **memory(info.params),
                         "local": state, "path": str(snap) if snap else None})
    return rows


def gib_cell(n: int) -> str:
    """Bytes as GiB with one decimal (``14.9``), ``<0.1`` below a tenth (the embedded model's MiB)."""
    return f"{n / 2**30:.1f}" if n >= 0.1 * 2**30 else "<0.1"


def cells(row: dict) -> list[str]:
    """A row's printed cells (model, family, kind, params, bf16 GiB, fp32 GiB), as the table and the
    README show them."""
    return [row["alias"], row["family"], row["kind"], params_text(row["params"], row["active_params"]),
            gib_cell(row["bf16_bytes"]), gib_cell(row["fp32_bytes"])]


HEADERS = ["model", "family", "kind", "params", "bf16", "fp32", "local"]
SEP = 2  # spaces between two columns
KIND_MIN = 6  # the narrowest the kind column gets before the model names fold


def _widths(grid: list[list[str]], width: int) -> list[int]:
    """Column widths for ``grid`` (header row first) within ``width`` characters: every column at its
    widest cell when that fits; else kind wraps at words and the params column takes two lines
    (``7.4B`` / ``(1.7B active)``), or one word a line, while kind keeps its longest word; narrower still,
    kind folds inside words (down to :data:`KIND_MIN`), then the model names fold too."""
    natural = [max(len(r[i]) for r in grid) for i in range(len(HEADERS))]
    words = max(len(w) for r in grid for w in r[2].split())
    room = width - SEP * (len(HEADERS) - 1) - sum(n for i, n in enumerate(natural) if i not in (2, 3))
    p_two = max(len(part) for r in grid for part in r[3].replace(" (", "\n(").split("\n"))
    p_min = max(len(w) for r in grid for w in r[3].split())
    for params in (natural[3], p_two, p_min):
        kind = room - params
        if kind >= words:
            break
    out = list(natural)
    out[3] = params
    if kind >= words:
        out[2] = min(kind, natural[2])
    else:  # kind folds inside words, down to KIND_MIN; narrower still, the model names fold too
        out[2] = max(kind, KIND_MIN)
        out[0] = max(4, natural[0] - max(0, KIND_MIN - kind))
    return out


def table(rows: list[dict], width: int = 80):
    """The table of ``ecache models`` for a terminal ``width`` columns wide (:func:`_widths`): :func:`cells`
    and the local column, headers underlined, two spaces between columns. Where the model names would
    have to fold (a narrow terminal, about 60 columns), each row's kind (and a mixture of experts' active
    parameters) moves under its model name instead (:func:`_stacked`), so no name is ever cut."""
    from rich import box
    from rich.table import Table

    grid = [HEADERS] + [[*cells(r), r["local"] or "?"] for r in rows]
    widths = _widths(grid, width)
    headers = HEADERS
    if widths[0] < len(max((r[0] for r in grid), key=len)):
        grid, widths = _stacked(rows, width)
        headers = [h for i, h in enumerate(HEADERS) if i != 2]
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
              caption="bf16, fp32: GiB the weights take; local: in the Hugging Face cache (part: a weight file is "
                      "missing); ecache models show NAME: details; ecache models pull NAME: download",
              caption_justify="left")
    for header, w in zip(headers, widths):
        t.add_column(header, width=w, overflow="fold",
                     justify="right" if header in ("params", "bf16", "fp32") else "left")
    for r in grid[1:]:
        if headers is HEADERS and len(r[3]) > widths[3]:
            r[3] = r[3].replace(" (", "\n(")  # 7.4B / (1.7B active)
        t.add_row(*r)
    return t


def _stacked(rows: list[dict], width: int) -> tuple[list[list], list[int]]:
    """The narrow layout's grid (header row first) and column widths: the kind column gone, each model
    cell its name over an indented, dimmed line of its kind and, for a mixture of experts, its active
    parameters; params holds the total alone. The model column keeps its longest name (names never
    fold); the kind line wraps at words under it."""
    import textwrap

    from rich.text import Text

    header = [h for i, h in enumerate(HEADERS) if i != 2]
    rest = [[r["family"], count(r["params"]), *cells(r)[4:], r["local"] or "?"] for r in rows]
    natural = [max(len(header[i + 1]), *(len(g[i]) for g in rest)) for i in range(len(header) - 1)]
    first = max(max(len(r["alias"]) for r in rows), width - SEP * (len(header) - 1) - sum(natural))
    grid: list[list] = [header]
    for r, more in zip(rows, rest):
        active = r["active_params"]
        under = r["kind"] + (f", {count(active)} active" if active and active != r["params"] else "")
        name = Text(r["alias"])
        name.append("".join("\n  " + line for line in textwrap.wrap(under, max(first - 2, 8))), style="dim")
        grid.append([name, *more])
    return grid, [first, *natural]


def readme_table(rows: list[dict]) -> str:
    """The README's "Supported models" table (Markdown) of ``rows``: alias, Hugging Face repository and
    :func:`cells`' other columns; ``tests/test_models_cmd.py`` checks the README holds exactly this."""
    lines = ["| alias | Hugging Face repository | family | kind | params | bf16 GiB | fp32 GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        alias, family, kind, params, bf16, fp32 = cells(r)
        repo = r["repo"] or "embedded in the package (`ecache_cli/data/tiny`)"
        lines.append(f"| `{alias}` | {repo} | {family} | {kind} | {params} | {bf16} | {fp32} |")
    return "\n".join(lines) + "\n"


# --- one model: ecache models show NAME ---------------------------------------------------------------------


def resolve(name: str) -> dict:
    """What ``name`` is: ``{"name", "source": "embedded" | "alias" | "repo" | "folder", "repo", "family",
    "alias": the registry's Alias or None, "path": a local checkpoint folder or None, "local", "missing"}``.
    Raises ModelLoadError for a name that is none of them (naming ``ecache models``:
    ``models.loader.unknown_model``)."""
    from ..models.loader import EMBEDDED, embedded_dir
    from ..models.registry import ALIASES, alias, alias_of_repo, no_checkpoint, repo_id_form

    local = Path(name).expanduser()
    known = name in EMBEDDED or name in ALIASES
    if not str(name).strip():  # '' would be the current folder
        from ..models.loader import unknown_model

        raise ModelLoadError(unknown_model(name))
    if known and not (local.is_dir() and (local / "config.json").is_file()):
        if name in EMBEDDED:
            return {"name": name, "source": "embedded", "repo": None, "family": None, "alias": None,
                    "path": embedded_dir(), "local": "yes", "missing": []}
        fam, info = alias(name)
        state, snap, missing = local_state(info.repo)
        return {"name": name, "source": "alias", "repo": info.repo, "family": fam, "alias": info, "path": snap,
                "local": state, "missing": missing}
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(no_checkpoint(name))
        from ..models.loader import missing_weights

        missing = missing_weights(local)
        return {"name": name, "source": "folder", "repo": None, "family": None, "alias": None, "path": local,
                "local": "part" if missing else "yes", "missing": missing}
    if repo_id_form(name) and not local.exists():
        state, snap, missing = local_state(name)
        of_alias = alias_of_repo(name)  # the repo of a known alias: its family and facts, as the alias shows them
        fam, info = alias(of_alias) if of_alias is not None else (None, None)
        return {"name": name, "source": "repo", "repo": name, "family": fam, "alias": info, "path": snap,
                "local": state, "missing": missing}
    from ..models.loader import unknown_model

    raise ModelLoadError(unknown_model(name))


def check_model_name(name: str) -> None:
    """Refuse, before a command prints its first line, a ``--model`` that is none of the embedded model,
    an alias, a folder or a repo id (``org/name``): ModelLoadError (exit 1, README: a missing model is a
    runtime error) in :func:`resolve`'s wording, so ``ecache generate --model X`` and ``ecache models show
    X`` say the same; so is a folder without config.json (``models.registry.no_checkpoint``) or with a
    damaged one (``models.spec.read_json_object``). A name of the right shape whose other files are
    missing is the loader's to report."""
    from ..models.loader import EMBEDDED
    from ..models.registry import ALIASES, repo_id_form

    name = str(name)
    local = Path(name).expanduser()
    if name.strip() and (name in EMBEDDED or name in ALIASES):
        return
    if name.strip() and local.is_dir():  # '' would be the current folder
        if not (local / "config.json").is_file():
            from ..models.registry import no_checkpoint

            raise ModelLoadError(no_checkpoint(name, "--model"))
        from ..models.spec import read_json_object

        read_json_object(local / "config.json")  # a damaged one in `models show`'s words
        return  # the rest of a folder's files are the load's to check
    if repo_id_form(name) and not local.exists():
        return
    from ..models.loader import unknown_model

    raise ModelLoadError(unknown_model(name, "--model"))


def check_start(model, device: str | None = None, dtype: str | None = None, prompts: list[str] | None = None,
                quantize: str | None = None) -> None:
    """What every model command refuses before its first line ("using model …", README) and its settings:
    an unknown ``--model`` (:func:`check_model_name`, exit 1), then a ``--device`` or ``--dtype`` that is
    none (``models.loader.resolve_device`` / ``resolve_dtype``) and an empty or non-UTF-8 prompt argument
    (``inputs.check_arguments``): one-line UsageErrors (exit 2), as the load and the reading would raise
    them later. A ``--quantize`` format this device and dtype cannot run is refused here too
    (``models.quantize.check_supported``: UsageError, or EcacheError exit 1 without torchao), since both
    are known before the load."""
    from ..models.loader import resolve_device, resolve_dtype

    check_model_name(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if quantize is not None:
        _check_supported(quantize, dev, dt)
    if prompts:
        from .inputs import check_arguments

        check_arguments(prompts)


def _check_supported(quantize: str, dev, dt) -> None:
    """``models.quantize.check_supported`` for a ``--quantize`` value (``none``: nothing to check)."""
    from ..models import quantize as qz

    quant = qz.parse_quantize(quantize)
    if quant is not None:
        qz.check_supported(quant, dev, dt)


def check_quantize(settings, device: str | None = None, dtype: str | None = None) -> None:
    """A weights format that the run's profile gave (its ``quantize`` key, no ``--quantize``:
    ``Settings.quantize_from_profile``) and that this ``--device`` and ``--dtype`` cannot run, refused as
    :func:`check_start` refuses the flag's (UsageError, or EcacheError exit 1 without torchao), before the
    first line, naming the file as every error about a profile's value does (``runs.settings.from_profile``):
    ``… add --dtype bfloat16; … (quantize int4 from profile p.yaml; pass the flag to override)``. Every model
    command calls it right after ``resolve_settings``; a format the flag gave was checked by check_start."""
    if not settings.quantize_from_profile:
        return
    from ..errors import EcacheError
    from ..models.loader import resolve_device, resolve_dtype
    from .settings import from_profile

    dev = resolve_device(device)
    try:
        _check_supported(settings.quantize, dev, resolve_dtype(dtype, dev))
    except EcacheError as e:
        raise type(e)(from_profile(e, f"quantize {settings.profile_quantize}", settings.profile)) from None


def prompt_lengths(model, prompts: list[str] | None, chat: bool | None) -> list[int] | None:
    """The token counts of prompt arguments as the run will encode them (through the chat template when
    the tokenizer has one, unless ``chat`` is False: ``runs/generate.py``), read before the load where the
    tokenizer is at hand without a download: the embedded model or a checkpoint folder
    (``models.loader.inspect_model``, no weight read). None otherwise, or where the tokenizer or a prompt
    fails: the load and the run say why. ``runs.settings.validate_decode`` uses them to refuse a
    ``--gen-length`` that leaves the prompts no room before the "using model" line, with a gen-length
    they fit."""
    from ..errors import EcacheError
    from ..models.loader import EMBEDDED, inspect_model
    from ..models.prompting import encode_prompts
    from ..models.registry import ALIASES

    if not prompts:
        return None
    name = str(model) if model else None
    folder = Path(name).expanduser() if name else None
    if name in EMBEDDED or name is None:
        if folder is not None and folder.is_dir():  # a folder named like the embedded model: the load says which
            return None
    elif name in ALIASES or folder is None or not (folder / "config.json").is_file():
        return None
    try:
        meta = inspect_model(name, device="cpu", force=True)
        use_chat = bool(getattr(meta.tokenizer, "chat_template", None)) and chat is not False
        return [len(ids) for ids in encode_prompts(meta.tokenizer, meta.spec, list(prompts), use_chat)]
    except (EcacheError, OSError, ValueError):
        return None


def task_prompt_lengths(model, task, limit: int, shots, seed: int, chat: bool | None,
                        data: str | None = None) -> list[int] | None:
    """:func:`prompt_lengths` of the prompts a ``--task`` run decodes, before the load: ``limit`` test
    examples of ``task`` (a name, read from ``data`` when given, or a task object: ``tasks.get_task``'s,
    or calibrate's task groups) drawn by ``seed``, each with ``shots`` solved examples (the task's
    default when None), as calibrate's sample and profile's and trace-drift's task requests build them.
    None without a task, for ``data`` that is a stream, or where they cannot be read here (the run's own
    read says why)."""
    from ..errors import EcacheError

    if task is None or (data is not None and not (Path(data).is_file() or Path(data).is_dir())):
        return None  # a stream (``-``, a pipe) is read once, by the run
    try:
        if isinstance(task, str):
            from ..tasks import get_task

            task = get_task(task, data)
        n = task.default_shots if shots is None else shots
        texts = [task.prompt(ex, n, seed) for ex in task.examples("test", limit, seed)]
    except (EcacheError, OSError, ValueError):
        return None
    return prompt_lengths(model, texts, chat)


def _token_table(spec, vocab: dict[str, int]) -> dict:
    """The special ids of ``spec`` with their token strings (None where the tokenizer is not at hand)."""
    by_id = {i: t for t, i in vocab.items()}
    ids = {"mask": spec.mask_id, "eos": spec.eos_id, "eot": spec.eot_id, "pad": spec.pad_id, "bos": spec.bos_id}
    out = {k: {"id": i, "token": by_id.get(i)} for k, i in ids.items() if i is not None}
    out["stop"] = [{"id": i, "token": by_id.get(i)} for i in spec.stop_ids]
    return out


def _template(tok) -> dict:
    """Whether the tokenizer has a chat template, and its first non-blank line."""
    tpl = getattr(tok, "chat_template", None) if tok is not None else None
    if isinstance(tpl, dict):
        tpl = tpl.get("default") or next(iter(tpl.values()), None)
    elif isinstance(tpl, list):  # [{"name": ..., "template": ...}]
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict)), None)
    if not isinstance(tpl, str) or not tpl.strip():
        return {"present": False, "first_line": None}
    return {"present": True, "first_line": next(ln.strip() for ln in tpl.splitlines() if ln.strip())}


def config_summary(spec, cfg: dict) -> dict:
    """The architecture facts ``ecache models show`` prints, from a checked spec and its raw config."""
    out = {"layers": spec.n_layers, "hidden": spec.d_model, "heads": spec.n_heads, "kv_heads": spec.n_kv_heads,
           "head_dim": spec.head_dim, "mlp_hidden": spec.mlp_hidden, "vocab_size": spec.vocab_size,
           "max_positions": spec.max_positions, "logit_shift": spec.logit_shift, "sampler": spec.sampler,
           "rope_theta": spec.rope_theta, "rotary_dim": spec.rotary_dim, "qk_norm": spec.qk_norm,
           "tie_embeddings": spec.tie_embeddings, "torch_dtype": cfg.get("torch_dtype")}
    if spec.n_experts:
        out["experts"] = {"experts": spec.n_experts, "per_token": spec.experts_per_token,
                          "expert_hidden": spec.expert_hidden, "shared_expert_hidden": spec.shared_expert_hidden,
                          "moe_layers": sum(map(bool, spec.moe_layers))}
    return out


def _read_checkpoint(path: Path, notes: list[str]) -> tuple:
    """(spec, raw config, tokenizer or None) of a local checkpoint folder. A folder without any tokenizer
    file is a note (the config still reads without it where the family allows); a tokenizer file that does
    not load is the load's error, in ``ecache generate``'s words (read with no vocabulary instead, a family
    that takes its mask id from the tokenizer, LLaDA-MoE or LLaDA2, would get its default id, outside a small
    vocabulary, and the error would blame config.json). Raises ModelLoadError."""
    from ..models.loader import has_tokenizer_files, load_tokenizer
    from ..models.registry import read_spec

    tok = None
    try:
        tok = load_tokenizer(path)
    except ModelLoadError as e:
        if has_tokenizer_files(path):
            raise
        notes.append(f"no tokenizer, so no token strings or chat template ({e})")
    spec, cfg = read_spec(path, tok.get_vocab() if tok is not None else None)
    return spec, cfg, tok


def default_profile(name: str) -> dict | None:
    """The profile ``ecache generate --model NAME`` reads without --profile or --task (``default.yaml``, first
    found in ./profiles, the user's folder, the package): path, whether ecache ships it, its decode and
    cache settings; None when there is none."""
    from ..config import canonical_model_name, find_mode_profile, load_profile, packaged_profiles_dir

    found = find_mode_profile(canonical_model_name(name), "default", False)
    if found is None:
        return None
    prof = load_profile(found)
    try:
        shipped = found.resolve().is_relative_to(packaged_profiles_dir())
    except (OSError, ValueError):
        shipped = False
    return {"path": str(found), "shipped": shipped, "decode": prof.get("decode") or {},
            "cache": prof.get("cache") or {}}


def _sizes(info: dict, spec, path: Path | None, alias_info) -> None:
    """Fill ``params``, ``active_params`` and the bf16 / fp32 bytes: from a complete local checkpoint's
    safetensors headers (:func:`models.loader.weight_bytes`), else from its config or the registry; with a
    checkpoint (or an alias whose embedding size the registry knows), ``quantized_bytes`` {int8, int4}: the
    estimate of :func:`models.loader.quantized_bytes`."""
    import torch

    from ..models.loader import quantized_bytes, weight_bytes

    if spec is not None:
        params, active = spec.n_params, spec.n_active_params
    elif alias_info is not None:
        params, active = alias_info.params, alias_info.active or alias_info.params
    else:
        params = active = None
    info.update(params=params, active_params=active, bf16_bytes=None, fp32_bytes=None)
    if params is not None:
        info.update(memory(params))
    if spec is not None and path is not None and not info["missing"]:
        info.update(bf16_bytes=weight_bytes(path, torch.bfloat16, spec),
                    fp32_bytes=weight_bytes(path, torch.float32, spec))
    info["quantized_bytes"] = None  # --quantize: the blocks quantized, the embeddings and head in bfloat16
    outer = alias_info.outer if spec is None and alias_info is not None and alias_info.outer else None
    if info["bf16_bytes"] is not None and (spec is not None or outer is not None):
        info["quantized_bytes"] = {fmt: quantized_bytes(info["bf16_bytes"], spec, torch.bfloat16, fmt, outer)
                                   for fmt in ("int8", "int4")}


def describe(name: str) -> tuple[dict, list[str]]:
    """Everything ``ecache models show NAME`` prints, as a JSON-ready dict, and the notes for stderr.

    From a local checkpoint (the embedded model, a folder, a cached alias or repo): family, sizes, the
    config summary, special tokens with their strings, the chat template; without one, what the registry
    knows (repository, family, sizes) and ``get``, the command that fetches it. ``default_profile`` in
    both cases. Raises ModelLoadError for an unknown name or a folder that is no checkpoint.
    """
    from ..models.loader import _download_command
    from ..models.registry import FAMILIES

    where = resolve(name)
    notes: list[str] = []
    path = where["path"]
    spec = cfg = tok = None
    if path is not None and (Path(path) / "config.json").is_file():
        spec, cfg, tok = _read_checkpoint(Path(path), notes)
    fam = FAMILIES[spec.family] if spec is not None else where["family"]
    info = {"name": name, "source": where["source"], "repo": where["repo"],
            "family": fam.name if fam else None, "family_title": fam.title if fam else None,
            "kind": where["alias"].kind if where["alias"] else None, "local": where["local"],
            "path": str(path) if path is not None else None, "missing": where["missing"]}
    _sizes(info, spec, path, where["alias"])
    info["config"] = config_summary(spec, cfg) if spec is not None else None
    info["tokens"] = _token_table(spec, tok.get_vocab() if tok is not None else {}) if spec is not None else None
    info["chat_template"] = _template(tok) if spec is not None else None
    info["default_profile"] = default_profile(name)
    info["get"] = None
    if where["local"] in ("no", "part") and where["source"] != "folder":
        info["get"] = {"ecache": f"ecache models pull {name}", "hub": f"{_download_command()} {where['repo']}"}
    return info, notes


def pull(name: str) -> tuple[Path, str]:
    """Fetch ``name`` (an alias or a Hugging Face repo id) into the local hub cache; return its snapshot
    folder and what happened: "embedded" (nothing to fetch), "cached" (already complete: no network) or
    "downloaded". Raises UsageError for a folder, ModelLoadError for an unknown name or (one line with the
    command for a connected machine) when offline, unreachable or left incomplete."""
    from ..models.loader import EMBEDDED, download, embedded_dir, missing_weights_text

    if name in EMBEDDED:
        return embedded_dir(), "embedded"
    where = resolve(name)
    if where["source"] == "folder":
        raise UsageError(f"{name} is a local folder, nothing to fetch; `ecache models pull` takes an alias or a "
                         "Hugging Face repo id (`ecache models` lists the aliases)")
    if where["local"] == "yes":
        return Path(where["path"]), "cached"
    path = download(where["repo"], name)
    missing = missing_weights_text(path)
    if missing:
        raise ModelLoadError(f"{where['repo']}: the download is incomplete: {missing}; "
                             f"run `ecache models pull {name}` again")
    return path, "downloaded"


# --- rendering one model ----------------------------------------------------------------------------------------


def _tokens_line(tokens: dict) -> str:
    """``mask 126336 '<|mdm_mask|>' · eos 126081 '<|eot_id|>' · ...``."""
    def one(k, t):
        return f"{k} {t['id']}" + (f" {t['token']!r}" if t.get("token") is not None else "")

    parts = [one(k, t) for k, t in tokens.items() if k != "stop"]
    parts += [one("stop", t) for t in tokens.get("stop", [])]
    return " · ".join(parts)


def _architecture(c: dict) -> list[tuple[str, str]]:
    """The config summary as (key, text) rows."""
    rows = [("architecture", f"{c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads / {c['kv_heads']} "
                             f"kv heads of {c['head_dim']}, MLP {c['mlp_hidden']}")]
    if c.get("experts"):
        e = c["experts"]
        shared = f", shared expert {e['shared_expert_hidden']}" if e["shared_expert_hidden"] else ""
        rows.append(("experts", f"{e['experts']} in {e['moe_layers']} of {c['layers']} layers, {e['per_token']} per "
                                f"token, hidden {e['expert_hidden']}{shared}"))
    rope = f"theta {c['rope_theta']:g}" + (f", rotates {c['rotary_dim']} of {c['head_dim']} dims"
                                           if c["rotary_dim"] not in (None, c["head_dim"]) else "")
    rows += [("vocabulary", str(c["vocab_size"])), ("max positions", str(c["max_positions"])),
             ("logit shift", f"{c['logit_shift']} (logits[i] predict token i{' + 1' if c['logit_shift'] else ''})"),
             ("sampler", c["sampler"]),
             ("rope", rope + (", q/k norm" if c["qk_norm"] else "")),
             ("embeddings", "tied" if c["tie_embeddings"] else "separate LM head")]
    return rows


def _profile_rows(p: dict | None, family: str | None = None) -> list[tuple[str, str]]:
    """The default profile: its path (and whether ecache ships it), then its decode and cache settings; without
    one, the model family's own defaults where it has them (``Family.decode_defaults``, ``cache_default``)."""
    if p is None:
        from ..models.registry import FAMILIES

        fam = FAMILIES.get(family) if family else None
        own = {**(fam.decode_defaults if fam else {}), **({"cache": fam.cache_default} if fam and fam.cache_default
                                                          else {})}
        text = "none: ecache's built-in settings"
        if own:
            text += f" with the {family} family's {', '.join(f'{k} {v}' for k, v in own.items())}"
        return [("default profile", text + " (`ecache calibrate` writes one)")]

    def flat(d: dict) -> str:
        return ", ".join(f"{k} {'null' if v is None else v}" for k, v in d.items()) or "-"

    rows = [("default profile", p["path"] + (" (shipped with ecache)" if p["shipped"] else ""))]
    rows.append(("  decode", flat(p["decode"])))
    rows.append(("  cache", flat(p["cache"]) if p["cache"] else "ecache's default (entropy)"))
    return rows


def _local_text(info: dict) -> str:
    """The local row: where the checkpoint is, or that it is (partly) missing and how to get it. A folder or
    snapshot that lacks weight files: the load's error (``models.loader.missing_weights_error``: every
    missing shard, then the fix, ``ecache models pull NAME`` for an alias or repo id)."""
    from ..models.loader import missing_weights_error, pull_fix

    if info["local"] == "no":
        return f"not downloaded: {pull_fix(info['name'], info['repo'])}"
    if info["local"] == "part":
        error = missing_weights_error(Path(info["path"]), info["name"])
        return f"{'incomplete' if info['source'] == 'folder' else 'partly downloaded'}: {error}"
    what = {"embedded": "embedded in the package", "folder": "checkpoint folder"}.get(info["source"],
                                                                                      "in the Hugging Face cache")
    return f"{what}: {info['path']}"


#: How much of the chat template's first line ``show`` prints (``--json`` has all of it).
TEMPLATE_SHOWN = 72


def show_rows(info: dict) -> list[tuple[str, str]]:
    """``ecache models show``'s (key, text) rows of :func:`describe`'s dict."""
    rows = [("model", f"{info['name']} ({info['source']})")]
    if info["family"]:
        rows.append(("family", f"{info['family']}: {info['family_title']}"))
    if info["repo"]:
        rows.append(("repository", info["repo"]))
    if info["kind"]:
        rows.append(("kind", info["kind"]))
    if info["params"] is not None:
        rows.append(("parameters", params_text(info["params"], info["active_params"])))
        rows.append(("weights", f"{_gib(info['bf16_bytes'])} in bfloat16, {_gib(info['fp32_bytes'])} in float32"))
        if info.get("quantized_bytes"):
            q = info["quantized_bytes"]
            rows.append(("quantized", f"about {_gib(q['int8'])} with --quantize int8, {_gib(q['int4'])} with int4 "
                                      "(bfloat16 embeddings and head)"))
    rows.append(("local", _local_text(info)))
    if info["config"]:
        rows += _architecture(info["config"])
    if info["tokens"]:
        rows.append(("tokens", _tokens_line(info["tokens"])))
    if info["chat_template"] is not None:
        t = info["chat_template"]
        line = t["first_line"] or ""
        line = line if len(line) <= TEMPLATE_SHOWN else line[:TEMPLATE_SHOWN - 3] + "..."
        rows.append(("chat template", f"yes, starting {line}" if t["present"] else "none"))
    return rows + _profile_rows(info["default_profile"], info.get("family"))


def show_table(info: dict):
    """The rich two-column grid of :func:`show_rows` (keys bold; values wrap at the terminal's width)."""
    from rich.table import Table
    from rich.text import Text

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for key, text in show_rows(info):
        t.add_row(Text(key), Text(text))
    return t
