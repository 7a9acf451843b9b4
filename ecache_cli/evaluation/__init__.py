"""Evaluation with lm-evaluation-harness: the ``ecache`` model (``lm_eval_adapter``) and the Monte Carlo
log-likelihood of masked diffusion LMs (``likelihood``). Needs the ``eval`` extra
(``pip install "ecache[eval]"``); nothing here is imported by the ``ecache`` command itself."""
