"""``ecache-lm-eval`` / ``python -m ecache_cli.evaluation``: lm-eval's own command line with the ``ecache``
model registered first.

lm-eval releases up to 0.4.13 find models only in their own registry (plugin discovery through the
``lm_eval.models`` entry point, which ecache declares, came after it: EleutherAI/lm-evaluation-harness
PR #4013); this wrapper imports the adapter, whose ``@register_model("ecache")`` fills the registry,
then hands every argument to lm-eval's ``cli_evaluate`` unchanged. LLaDA's ``eval_llada.py`` does the same.
"""

from __future__ import annotations


def main() -> None:
    """Run lm-eval's CLI (same arguments as ``lm_eval``) with ``--model ecache`` available.

    ecache's own errors (a bad ``--model_args`` key or value, a model that cannot be loaded: every
    :class:`~ecache_cli.errors.EcacheError`) end as one ``error:`` line on stderr and its exit code
    (2 usage, 1 data), as in ``ecache``; inside lm-eval used as a library they propagate.
    """
    from lm_eval.__main__ import cli_evaluate

    from ..errors import EcacheError
    from . import lm_eval_adapter  # noqa: F401  (registers the model)

    try:
        cli_evaluate()
    except EcacheError as e:
        from ..console import error

        error(str(e))
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    main()
