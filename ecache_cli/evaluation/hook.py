"""Startup hook that makes ``lm_eval --model ecache`` work on lm-eval releases without plugin discovery.

lm-eval up to 0.4.13 (the newest release) resolves ``--model <name>`` only against its own registry,
which is filled by importing ``lm_eval.models`` (its ``MODEL_MAPPING`` of lazy placeholders); the
entry-point discovery that reads ecache's ``lm_eval.models`` entry point was merged upstream after
that release (EleutherAI/lm-evaluation-harness PR #4013). Until a release carries it, the installed
``ecache_lm_eval.pth`` (this folder; setup.py installs it in site-packages) calls :func:`install` at interpreter
start-up, the mechanism setuptools' own ``distutils-precedence.pth`` uses.

:func:`install` adds one meta-path finder and imports only ``ecache_cli.evaluation.hook`` itself (the
``.pth`` line also imports ``importlib.util`` to check that ecache is still installed; ~3 ms per
interpreter start in all); the finder answers ``None`` for every module except ``lm_eval.models``;
when that one is imported, it runs lm-eval's own loader and then registers ``ecache`` as a lazy
placeholder (``ecache_cli.evaluation.lm_eval_adapter:EcacheLM``) unless the name is already taken,
then removes itself. Nothing of ecache or torch is imported until
lm-eval is asked for the ``ecache`` model. In lm-eval's own command line (``lm_eval``, ``lm-eval``,
``python -m lm_eval``) an uncaught ecache error (a bad ``--model_args`` value, a model that cannot be
loaded) prints one ``error:`` line and exits with its code (2 usage, 1 data), as ``ecache-lm-eval``
does, and Ctrl-C prints one line and exits 130; any other exception keeps lm-eval's traceback.
``ECACHE_LM_EVAL_HOOK=0`` (or ``false``, ``off``, ``no``) turns the hook off (the ``ecache-lm-eval``
wrapper works either way).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

TARGET = "ecache_cli.evaluation.lm_eval_adapter:EcacheLM"
WATCHED = "lm_eval.models"


def register(registry=None) -> bool:
    """Register ``ecache`` in lm-eval's model registry as a lazy placeholder for :data:`TARGET`.

    Returns True when registered now, False when the name was already there (a newer lm-eval found
    the entry point, or the adapter module was imported). On lm-eval releases whose registry takes no
    placeholders (before 0.4.10, a plain dict filled by decorators) it imports the adapter instead,
    whose ``@register_model("ecache")`` registers the class.
    """
    if registry is None:
        from lm_eval.api.registry import model_registry as registry
    if _in_lm_eval_cli():
        _one_line_errors()
    if "ecache" in registry:
        return False
    try:
        registry.register("ecache", target=TARGET)
    except TypeError:  # older registries: register(*names) decorator only
        __import__(TARGET.split(":")[0])
    return True


def _in_lm_eval_cli() -> bool:
    """True in a process started as lm-eval's command line (console script or ``-m lm_eval``)."""
    argv0 = getattr(sys, "argv", [""])[0] if getattr(sys, "argv", None) else ""
    base = os.path.basename(argv0)
    return base in ("lm_eval", "lm-eval") or argv0.replace(os.sep, "/").endswith("lm_eval/__main__.py")


def _one_line_errors() -> None:
    """Chain ``sys.excepthook`` so an uncaught :class:`~ecache_cli.errors.EcacheError` or Ctrl-C ends as one line."""
    previous = sys.excepthook
    if getattr(previous, "_ecache", False):
        return

    def hook(kind, value, tb):
        from ..errors import EcacheError

        if isinstance(value, (EcacheError, KeyboardInterrupt)):
            from ..console import error
            from .__main__ import INTERRUPTED

            error(INTERRUPTED if isinstance(value, KeyboardInterrupt) else str(value))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130 if isinstance(value, KeyboardInterrupt) else value.exit_code)  # else the interpreter exits 1
        previous(kind, value, tb)

    hook._ecache = True
    sys.excepthook = hook


class _LoaderAfter:
    """Runs the real loader of ``lm_eval.models``, then :func:`register`."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            register()
        except Exception:  # never break lm-eval itself; `ecache-lm-eval` still registers the model
            pass


class _Finder:
    """Meta-path finder that watches for ``lm_eval.models`` only (module docstring)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderAfter(spec.loader)
        return spec


def install() -> None:
    """Put the watching finder first on ``sys.meta_path`` (idempotent; no-op if lm_eval.models is loaded).

    When ``lm_eval.models`` is already imported (the hook came late), register directly.
    """
    if WATCHED in sys.modules:
        try:
            register()
        except Exception:
            pass
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
