"""``ecache-lm-eval`` / ``python -m ecache_cli.evaluation``: lm-eval's own command line with the ``ecache``
model registered first.

``lm_eval --model ecache`` works by itself through the installed start-up hook (``hook.py``); this
wrapper is for environments where site-packages ``.pth`` hooks do not run (or ``ECACHE_LM_EVAL_HOOK=0``):
it imports the adapter, whose ``@register_model("ecache")`` fills lm-eval's registry, then hands every
argument to lm-eval's ``cli_evaluate`` unchanged, as LLaDA's ``eval_llada.py`` does.
"""

from __future__ import annotations


def main() -> None:
    """Run lm-eval's CLI (same arguments as ``lm_eval``) with ``--model ecache`` available.

    ecache's own errors (a bad ``--model_args`` key or value, a model that cannot be loaded: every
    :class:`~ecache_cli.errors.EcacheError`) end as one ``error:`` line on stderr and its exit code
    (2 usage, 1 data), as in ``ecache``; Ctrl-C ends as one line and exit code 130; inside lm-eval used
    as a library they propagate.
    """
    from ..errors import EcacheError

    try:
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as e:
        if e.name != "lm_eval" and not str(e.name).startswith("lm_eval."):
            raise
        from ..console import error

        error('lm-evaluation-harness is not installed; install the eval extra: pip install "ecache[eval]" '
              '(from a checkout: pip install -e ".[eval]")')
        raise SystemExit(1) from None
    from . import lm_eval_adapter  # noqa: F401  (registers the model)

    try:
        cli_evaluate()
    except EcacheError as e:
        from ..console import error

        error(str(e))
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:
        from ..console import error

        error(INTERRUPTED)
        raise SystemExit(130) from None


#: What Ctrl-C during an evaluation leaves: lm-eval writes its results (and ecache its speed JSON) at the end.
INTERRUPTED = "interrupted; the evaluation stopped before lm-eval wrote its results"


if __name__ == "__main__":
    main()
