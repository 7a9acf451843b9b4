"""Which masked positions to commit this step: confidence scores and the three commit rules.

Confidence is scored per candidate row (the engine passes −inf at non-candidates: positions that are
not masked or lie outside the current block). Then one rule picks the positions:
- select_topk: the step's scheduled count k (LLaDA / Dream fixed-step decoding);
- select_sampled: k positions drawn from softmax(conf / alg_temp) without replacement (Dream alg_temp > 0);
- select_origin: each candidate independently with a probability (Dream alg 'origin');
- select_threshold: Fast-dLLM confidence-threshold parallel decoding (docs/MODELS.md §6.1);
- select_threshold_quota: the same with a per-step quota (Fast-dLLM's Dream generation_utils.py);
- select_factor: Fast-dLLM's factor rule (docs/MODELS.md §6.2).
Each rule commits only candidates, and the two parallel rules commit at least one per row that has any,
so a block always finishes. The parallel rules are defined on the probability of x0 (Fast-dLLM
computes it as the float64 softmax probability of the chosen token); use validate_remasking(kind,
parallel=True) to reject any other kind with them.
All functions are batched over rows with one sort at most, and never sync the device.
"""

from __future__ import annotations

import torch

from ecache_cli.decoding.sampling import Sampled
from ecache_cli.errors import UsageError

REMASKING = ("low_confidence", "random", "topk_margin", "entropy", "maskgit_plus", "origin")
PROB_KINDS = ("low_confidence", "maskgit_plus")  # scores that are the probability of x0


def validate_remasking(kind: str, *, parallel: bool = False) -> str:
    """Check a remasking name; with parallel=True (threshold/factor decoding) only low_confidence is valid.

    The threshold and factor rules (Fast-dLLM) compare the probability of x0 to a probability
    threshold, so they are defined only for low_confidence scores.

    Returns:
        kind, unchanged.
    Raises:
        UsageError: an unknown kind (listing the valid ones), or parallel with a kind other than
            low_confidence.
    """
    if kind not in REMASKING:
        rules = ", ".join(r for r in REMASKING if r != "origin")
        raise UsageError(f"--remasking {kind!r} is not a remasking rule; use one of {rules}, or origin with "
                         "--schedule dream")
    if parallel and kind not in PROB_KINDS:
        raise UsageError(
            f"--remasking {kind} cannot be used with threshold or factor decoding: they compare the "
            "probability of the chosen token, use --remasking low_confidence"
        )
    return kind


def confidence_scores(kind: str, sampled: Sampled, generator: torch.Generator | None,
                      uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Score every candidate row; higher means commit sooner.

    Kinds (REMASKING):
        low_confidence: sampled.prob, probability of x0 (LLaDA default; float64 as in Fast-dLLM/app.py).
        random: U[0, 1) drawn from generator (LLaDA 'random'; float64 here, float32 in LLaDA).
        topk_margin: sampled.margin, top-1 minus top-2 probability (Dream).
        entropy: sampled.neg_entropy, −entropy in nats (Dream; higher = more certain).
        maskgit_plus: sampled.prob, Dream's name for the probability of x0 (the same score as
            low_confidence).
        origin: U[0, 1) like random: not a confidence but Dream's reveal draw, which the Dream
            schedule compares with 1 − t[i+1]/t[i] (commit.py; Dream generation_utils.py alg 'origin').
        When ``sampled.dream_conf`` is set (the engine asks ``sample`` for it under the Dream rules),
        it replaces the score of low_confidence / maskgit_plus / topk_margin / entropy: Dream's
        confidence from the temperature-scaled, filtered distribution (sampling.py ``sample``).
    Args:
        sampled: the step's Sampled, fields (B, N).
        generator: torch.Generator on the scores' device, used only by 'random' / 'origin' (None = global RNG).
        uniform: None, or pre-drawn U[0, 1) float64 (B, N) scores for 'random' / 'origin', used instead of
            drawing from ``generator`` (the engine draws them per row; returned as is).
    Returns:
        float64 (B, N), a new tensor (safe to fill −inf in place at non-candidates).
    Raises:
        UsageError: unknown kind, listing the valid ones.
    """
    validate_remasking(kind)
    if kind in ("random", "origin"):
        if uniform is not None:
            assert uniform.shape == sampled.x0.shape, f"uniform {tuple(uniform.shape)} != {tuple(sampled.x0.shape)}"
            return uniform.to(torch.float64)
        return torch.rand(sampled.x0.shape, dtype=torch.float64, device=sampled.x0.device, generator=generator)
    if sampled.dream_conf is not None:
        return sampled.dream_conf.to(torch.float64, copy=True)
    score = {"low_confidence": "prob", "maskgit_plus": "prob", "topk_margin": "margin", "entropy": "neg_entropy"}[kind]
    score = getattr(sampled, score)  # read only the score in use (margin is computed on first read)
    return score.to(torch.float64, copy=True)


def _candidates(conf: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: rows that may be committed (conf > −inf)."""
    return conf > float("-inf")


def _no_nan(conf: torch.Tensor) -> torch.Tensor:
    """NaN → −inf, so a NaN score is never a candidate (sorts put NaN first otherwise)."""
    return conf.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def _scatter_sorted(select_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Map a (B, N) bool mask over sorted ranks back to the original column order."""
    return torch.zeros_like(select_sorted).scatter_(-1, order, select_sorted)


def select_topk(conf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Commit the k[b] highest-confidence candidates of each row (LLaDA generate.py / Dream topk step).

    Never commits more than a row's candidate count. The official loops run torch.topk(confidence, k)
    over the whole row, so when k exceeds the candidates they also pick −inf (non-candidate)
    positions: Dream then writes the mask id there (re-masking committed tokens) and LLaDA may commit a
    prediction beyond the current block. Here those picks are dropped. Ties are broken by the lower
    column index (stable sort), deterministic on every backend.

    Args:
        conf: float64 (B, N), −inf (or NaN) at non-candidates.
        k: LongTensor (B,), tokens to commit per row (values < 0 count as 0; any device).
    Returns:
        BoolTensor (B, N), True = commit.
    """
    conf = _no_nan(conf)
    n_cols = conf.shape[-1]
    order = conf.argsort(dim=-1, descending=True, stable=True)  # (B, N) column ids by rank
    ranks = torch.arange(n_cols, device=conf.device)[None, :]  # (1, N)
    select_sorted = ranks < k.to(device=conf.device, dtype=torch.long)[:, None]  # (B, N)
    return _scatter_sorted(select_sorted, order) & _candidates(conf)


def select_sampled(conf: torch.Tensor, k: torch.Tensor, alg_temp: float, uniform: torch.Tensor) -> torch.Tensor:
    """Draw k[b] candidates of each row without replacement from softmax(conf / alg_temp) (Dream alg_temp > 0).

    Dream generation_utils.py ``_sample`` (and Fast-dLLM's generation_utils_block.py): with alg_temp > 0
    the positions are ``torch.multinomial(softmax(confidence / alg_temp), k)`` instead of top-k. Here the
    same distribution (successive sampling without replacement, the Plackett–Luce law, which is also how
    torch draws multinomial without replacement) by the Gumbel-top-k trick: the k largest of
    conf / alg_temp + G, G = −log(−log U) standard Gumbel, in float64 log space, so a small alg_temp
    cannot underflow the softmax to zeros (torch.multinomial then raises). Never more than a row's
    candidates (Dream's multinomial raises then).

    Args:
        conf: float64 (B, N), −inf (or NaN) at non-candidates.
        k: LongTensor (B,), positions to draw per row (values < 0 count as 0).
        alg_temp: > 0.
        uniform: float64 (B, N) U[0, 1) noise, one value per column (the engine draws it per row from the
            row's generator); a value of 0 is moved up to the smallest positive float.
    Returns:
        BoolTensor (B, N), True = commit.
    """
    assert alg_temp > 0, f"alg_temp {alg_temp} must be > 0 (0 = top-k: select_topk)"
    assert uniform.shape == conf.shape, f"uniform {tuple(uniform.shape)} != conf {tuple(conf.shape)}"
    conf = _no_nan(conf)
    tiny = torch.finfo(torch.float64).tiny
    gumbel = uniform.to(torch.float64).clamp(min=tiny).log_().neg_().log_().neg_()  # (B, N)
    keys = torch.where(_candidates(conf), conf / alg_temp + gumbel, float("-inf"))
    return select_topk(keys, k) & _candidates(conf)


def select_origin(conf: torch.Tensor, p_transfer: float) -> torch.Tensor:
    """Dream alg 'origin' (generation_utils.py ``_sample``): each candidate is revealed independently with
    probability p_transfer (1 − t[i+1]/t[i] at step i, 1 at the last step; decoding/commit.py).

    Args:
        conf: float64 (B, N), the reveal draws U[0, 1) (``confidence_scores('origin', ...)``), −inf at
            non-candidates.
        p_transfer: in [0, 1]; a candidate is committed iff its draw is < p_transfer (so 1 commits all).
    Returns:
        BoolTensor (B, N), True = commit.
    """
    conf = _no_nan(conf)
    return _candidates(conf) & (conf < p_transfer)


def select_threshold_min(conf: torch.Tensor, threshold: float, k: torch.Tensor) -> torch.Tensor:
    """The block-diffusion loops' threshold rule (SDAR generate.py ``low_confidence_dynamic``, LLaDA2.0
    ``generate``; docs/MODELS.md §10): every candidate with conf strictly above ``threshold`` when there
    are at least k[b] of them, else the k[b] most confident (:func:`select_topk`).

    Args:
        conf: float64 (B, N), −inf (or NaN) at non-candidates.
        threshold: a probability (SDAR's script 0.85, LLaDA2 0.95).
        k: LongTensor (B,), the step's scheduled count per row.
    Returns:
        BoolTensor (B, N), True = commit.
    """
    conf = _no_nan(conf)
    high = _candidates(conf) & (conf > threshold)  # (B, N)
    k = k.to(device=conf.device, dtype=torch.long)
    return torch.where((high.sum(-1) >= k)[:, None], high, select_topk(conf, k))


def select_threshold(conf: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM confidence-threshold parallel decoding (get_transfer_index with threshold, docs/MODELS.md §6.1).

    Commits every candidate with conf ≥ threshold, and always the single most confident candidate of
    each row that has any (first column on ties), so a step never commits 0 tokens; this also holds
    for threshold > 1. Rows without candidates commit nothing. conf must be the probability of x0
    (low_confidence): the threshold is a probability.

    Args:
        conf: float64 (B, N), −inf (or NaN) at non-candidates.
        threshold: a probability, typically 0.9.
    Returns:
        BoolTensor (B, N), True = commit.
    Raises:
        UsageError: threshold is NaN.
    """
    if threshold != threshold:
        raise UsageError("--threshold nan must be a number, typically 0.9")
    conf = _no_nan(conf)
    cand = _candidates(conf)  # (B, N)
    if conf.shape[-1] == 0:
        return cand
    best = torch.zeros_like(cand).scatter_(-1, conf.argmax(dim=-1, keepdim=True), True)  # (B, N) one-hot
    return cand & ((conf >= threshold) | best)


def select_factor(conf: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's factor rule (get_transfer_index_dynamic, docs/MODELS.md §6.2), in the paper's form.

    With the row's candidate confidences sorted c_1 ≥ c_2 ≥ … ≥ c_M, commit the top n for the largest
    n ≤ M such that (m+1)·(1 − c_m) < factor for every rank m ≤ n, with rank 1 always committed (so
    n ≥ 1 when M ≥ 1; rows without candidates commit nothing). Since (m+1)(1 − c_m) grows with m,
    this is the count of leading ranks that pass. conf must be the probability of x0 (low_confidence).

    Differences from the official code, which compares c_n < 1 − factor/(n+1) and stops at the first
    failing rank: (1) off-by-one, when the first failing rank is the last one (n = M) the code still
    commits all M; we commit M − 1, as the rule says. (2) at exact equality (m+1)(1 − c_m) = factor the
    code keeps rank m; the strict rule drops it (d2Cache breaks on ≥ factor too). We follow the paper rule.

    Args:
        conf: float64 (B, N), −inf (or NaN) at non-candidates.
        factor: f in the rule above (Fast-dLLM default 1.0); larger commits more per step.
    Returns:
        BoolTensor (B, N), True = commit.
    Raises:
        UsageError: factor is NaN.
    """
    if factor != factor:
        raise UsageError("--factor nan must be a number, typically 1.0")
    conf = _no_nan(conf)
    n_cols = conf.shape[-1]
    sorted_conf, order = conf.sort(dim=-1, descending=True, stable=True)  # (B, N) each
    rank = torch.arange(1, n_cols + 1, device=conf.device, dtype=torch.float64)[None, :]  # (1, N), m = 1..N
    passes = (rank + 1) * (1 - sorted_conf) < factor  # (B, N); −inf conf gives +inf, never passes
    passes[:, :1] = sorted_conf[:, :1] > float("-inf")  # rank 1 always, if the row has a candidate
    n_commit = (passes.long().cumprod(dim=-1)).sum(dim=-1, keepdim=True)  # (B, 1) leading passes
    select_sorted = rank <= n_commit  # (B, N)
    return _scatter_sorted(select_sorted, order) & _candidates(conf)


def select_threshold_quota(conf: torch.Tensor, threshold: float, cap: torch.Tensor) -> torch.Tensor:
    """Threshold decoding under a per-step quota (Fast-dLLM dream/model/generation_utils.py, alg
    'confidence_threshold'; docs/MODELS.md §6.5).

    Of each row's ``cap[b]`` most confident candidates, commit the first always and the others whose
    conf ≥ threshold; the rest are deferred. Fast-dLLM's quota is steps-per-block masks/steps plus the
    tokens deferred at earlier steps; the caller (decoding/commit.py) turns that into ``cap``.

    Args:
        conf: float64 (B, N), −inf (or NaN) at non-candidates.
        threshold: a probability, typically 0.9.
        cap: LongTensor (B,), ranks considered per row (≥ 1; a cap above the candidates is harmless).
    Returns:
        BoolTensor (B, N), True = commit.
    Raises:
        UsageError: threshold is NaN.
    """
    within = select_topk(conf, cap.clamp(min=1))  # (B, N) the cap most confident candidates
    return within & select_threshold(conf, threshold)
