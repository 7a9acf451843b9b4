"""The model families, one module each under ``models/families/``, and what picks one for a checkpoint.

``FAMILIES`` maps a family's name to its :class:`~ecache_cli.models.family.Family` class, found by
walking the folder (``families/x_y.py`` holds the family ``x-y``), so adding a family is adding its
file. ``family_of(cfg)`` is the one family that claims a ``config.json``; ``spec_from_config`` and
``read_spec`` turn a config into a checked :class:`ModelSpec`; ``ALIASES`` maps every short name to its
Hugging Face repository and ``alias(name)`` gives its family and facts.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from pathlib import Path

from ..errors import ModelLoadError
from .family import Alias, Family
from .spec import ConfigReader, ModelSpec, check_spec, check_token_ids, read_json_object

ORDER = ("llada", "dream")  # listed first (the families of the first checkpoints); the rest by name


def _discover() -> dict[str, type[Family]]:
    """Every family module of ``models/families/``, by family name: module ``x_y.py`` holds the family
    ``x-y`` (its one ``Family`` subclass whose ``name`` is that), in ``ORDER`` then by name."""
    folder = Path(__file__).resolve().parent / "families"
    found = {}
    for mod in sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_")):
        module = importlib.import_module(f".families.{mod}", __package__)
        classes = [c for c in vars(module).values()
                   if isinstance(c, type) and issubclass(c, Family) and c.__module__ == module.__name__]
        name = mod.replace("_", "-")
        assert len(classes) == 1 and classes[0].name == name, \
            f"models/families/{mod}.py must define one Family subclass named {name!r}"
        found[name] = classes[0]
    first = [n for n in ORDER if n in found]
    return {n: found[n] for n in first + sorted(set(found) - set(first))}


FAMILIES: dict[str, type[Family]] = _discover()
#: Every alias of every family -> its Hugging Face repository id.
ALIASES: dict[str, str] = {a: info.repo for fam in FAMILIES.values() for a, info in fam.aliases.items()}


def repo_id_form(name: str) -> bool:
    """Whether ``name`` is written as a Hugging Face repo id (``org/name``: one ``/``, not a path that starts
    with ``.``, ``/`` or ``~``); the caller checks that no local path of that name exists."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def alias_of_repo(repo: str) -> str | None:
    """The first alias (in registry order) whose repository is ``repo``, compared without case as the hub
    does, or None."""
    return next((a for a, r in ALIASES.items() if r.lower() == repo.lower()), None)


def alias(name: str) -> tuple[type[Family], Alias] | None:
    """The family and facts of alias ``name``, or None when it is not one."""
    for fam in FAMILIES.values():
        if name in fam.aliases:
            return fam, fam.aliases[name]
    return None


def family_of(cfg: dict, path: Path | str = "config.json") -> type[Family]:
    """The family that claims a parsed config.json. Raises ModelLoadError (one line naming the
    ``model_type`` and the supported families) when none does."""
    claimed = [f for f in FAMILIES.values() if f.claims(cfg)]
    if len(claimed) != 1:
        kinds = ", ".join(f"{f.short_title()} ({f.name})" for f in FAMILIES.values())
        raise ModelLoadError(f"{path}: model_type {cfg.get('model_type')!r} is not supported; ecache runs {kinds} "
                             "checkpoints")
    return claimed[0]


def spec_from_config(cfg: dict, path: Path | str = "config.json", vocab: dict[str, int] | None = None) -> ModelSpec:
    """Build a checked :class:`ModelSpec` from a parsed ``config.json`` (``vocab``: the tokenizer's token ->
    id map, for the ids a family reads from it; see ``Family.complete``).

    Raises :class:`ModelLoadError` for an unsupported ``model_type``, a missing or wrongly typed field, a
    special token id outside the vocabulary (``spec.check_token_ids``), or a value no model can have
    (``spec.check_spec``).
    """
    fam = family_of(cfg, path)
    try:
        spec = fam.complete(fam.read(ConfigReader(cfg, path, fam.short_title())), vocab or {})
    except (TypeError, ValueError) as e:  # e.g. "d_model": "abc" or null
        raise ModelLoadError(f"{path}: a config.json field has a wrong type ({e}); fix config.json or use the "
                             "checkpoint's original one") from None
    check_token_ids(spec, path, cfg)
    check_spec(spec, path)
    return spec


def no_checkpoint(folder, flag: str = "") -> str:
    """The one wording of a folder without config.json given as a model: ``load_model``'s, every command's
    ``--model`` (``flag``) and ``ecache models show``'s."""
    return (f"{flag + ' ' if flag else ''}{folder}: no config.json, so it is not a checkpoint folder; pass a folder "
            "with config.json, an alias or a Hugging Face repo id (`ecache models` lists them)")


def config_path(model_dir: Path | str) -> Path:
    """``model_dir/config.json``; ModelLoadError when the folder has none."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ModelLoadError(no_checkpoint(model_dir, "--model"))
    return path


def read_spec(model_dir: Path, vocab: dict[str, int] | None = None) -> tuple[ModelSpec, dict]:
    """Read ``model_dir/config.json`` and return (spec, raw config dict). Raises ModelLoadError.

    ``spec.eps`` comes from ``generation_config.json`` beside it when that file has an ``eps`` (Dream's
    diffusion_generate reads its timesteps' end from there); a missing file keeps 1e-3.
    """
    path = config_path(model_dir)
    cfg = read_json_object(path)
    spec = spec_from_config(cfg, path, vocab)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        eps = read_json_object(gen_path).get("eps")
        if eps is not None:
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
                raise ModelLoadError(f"{gen_path}: eps {eps!r} must be a number in [0, 1) (Dream ships 1e-3)")
            spec = replace(spec, eps=float(eps))
    return spec, cfg
