"""Log-likelihood of a continuation under a masked diffusion LM: the Monte Carlo estimate of LLaDA.

A masked diffusion LM has no left-to-right factorisation, so log p(target | prefix) is bounded from
below by the ELBO of its training objective (LLaDA paper, arXiv 2502.09992, Eq. 6 and the conditional
form used for evaluation):

    log p(y | x) ≥ E_{t ~ U(0,1)} E_{y_t ~ q(y_t | y, t)} [ (1/t) Σ_{i: y_t^i = MASK} log p(y^i | x, y_t) ]

where each target token is masked independently with probability t. LLaDA's evaluation code
(``eval_llada.py``, ``get_loglikelihood`` / ``_forward_process``) estimates it with ``mc_num`` samples
in mini-batches of ``batch_size``, and so do we, with the same sampler:

- the number of masked target tokens m is stratified over a mini-batch: one k ~ U{1..L} per batch,
  then m_b = round(k + b·L/B) wrapped into [1, L] for rows b = 0..B-1 (a low-variance stand-in for
  t ~ U(0,1), with t = m/L), and the m masked positions are a uniform random subset of the target;
- the estimate is the mean over samples of the masked tokens' cross-entropy weighted by 1/t, i.e.
  ll = -(1/mc_num) Σ_samples Σ_masked CE / t (nats).

The model computes the logits through its ordinary forward (a full forward with a fresh KV store);
for Dream (logit shift 1) the hidden state at i-1 predicts token i (docs/MODELS.md §2.5). Randomness
comes from a ``torch.Generator`` the caller passes in, so a request's estimate does not depend on
which process or batch evaluates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contract.rows import padded_index
from ..errors import UsageError


def check_mc(mc_num: int, batch_size: int) -> None:
    """Validate the Monte Carlo knobs (one-line UsageErrors): mc_num ≥ 1, batch_size ≥ 1 and dividing
    mc_num (LLaDA's eval asserts ``mc_num % batch_size == 0``)."""
    if mc_num < 1:
        raise UsageError(f"mc_num={mc_num} must be ≥ 1 (LLaDA evaluates with 128)")
    if batch_size < 1 or mc_num % batch_size:
        raise UsageError(f"mc_batch_size={batch_size} must be ≥ 1 and divide mc_num={mc_num} "
                         f"(e.g. mc_batch_size={default_mc_batch(mc_num)})")


def default_mc_batch(mc_num: int) -> int:
    """The Monte Carlo batch when none is given: the largest divisor of ``mc_num`` up to 32 samples
    (LLaDA's eval default batch 32 at mc_num 128)."""
    return max(d for d in range(1, min(32, mc_num) + 1) if mc_num % d == 0)


def mask_counts(length: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """(batch,) long numbers of masked tokens in [1, length], stratified as in LLaDA's
    ``_forward_process``: k ~ U{1..length}, then round(linspace(k, k + (batch-1)·length/batch)) wrapped."""
    k = int(torch.randint(1, length + 1, (), generator=generator))
    x = torch.round(torch.linspace(float(k), k + (batch - 1) * (length / batch), steps=batch,
                                   dtype=torch.float64)).long()
    return (x - 1) % length + 1


def mc_loglikelihood(model, spec, prefix: list[int], target: list[int], mc_num: int = 128, batch_size: int = 32,
                     generator: torch.Generator | None = None) -> float:
    """Monte Carlo estimate of log p(target | prefix) in nats (module docstring; LLaDA eval_llada.py).

    Args:
        model: a ``DiffusionLM`` (``model(tokens, store, logits_pos=...)`` computes logits).
        spec: its ``ModelSpec`` (mask id, logit shift).
        prefix, target: token ids; ``target`` non-empty, and ``prefix`` non-empty for Dream (its first
            token has no position before it to be predicted from).
        mc_num, batch_size: samples, and samples per forward (``batch_size`` divides ``mc_num``).
        generator: a CPU ``torch.Generator`` for the masks (None = a fresh unseeded one).
    Returns:
        the estimate (float, ≤ 0 up to Monte Carlo noise; larger is more likely).
    Raises:
        UsageError for an empty target, an empty Dream prefix, bad ``mc_num``/``batch_size``, or a
        block-diffusion model (its likelihood is not this bidirectional estimate).
    """
    check_mc(mc_num, batch_size)
    if spec.block_causal:
        raise UsageError(f"loglikelihood: the {spec.family} model family is a block-diffusion model, whose likelihood "
                         "is not LLaDA's bidirectional Monte Carlo estimate; ecache scores it with generate_until "
                         "tasks only")
    if not target:
        raise UsageError("a loglikelihood request has an empty continuation; give at least one token to score")
    if spec.logit_shift and not prefix:
        raise UsageError("Dream scores a continuation from the token before it; give a non-empty context")
    gen = generator if generator is not None else torch.Generator()
    dev = next(model.parameters()).device
    P, L = len(prefix), len(target)
    seq = torch.tensor(prefix + target, dtype=torch.long)  # (T,)
    total = 0.0
    with torch.inference_mode():
        for _ in range(mc_num // batch_size):
            m = mask_counts(L, batch_size, gen)  # (B,)
            order = torch.argsort(torch.rand(batch_size, L, generator=gen), dim=1)  # (B, L) random permutations
            ranks = torch.argsort(order, dim=1)  # (B, L) rank of each target position in its permutation
            masked_t = ranks < m[:, None]  # (B, L): a uniform random subset of size m per row
            masked = torch.cat([torch.zeros(batch_size, P, dtype=torch.bool), masked_t], dim=1)  # (B, T)
            noisy = torch.where(masked, spec.mask_id, seq[None, :])  # (B, T)
            pos, valid = padded_index(masked)  # (B, R) masked positions, padded with repeats
            store = model.new_store(torch.ones_like(noisy, dtype=torch.bool).to(dev))
            logits = model(noisy.to(dev), store, logits_pos=(pos - spec.logit_shift).to(dev))  # (B, R, V)
            ce = F.cross_entropy(logits.float().flatten(0, 1), seq[pos].to(dev).flatten(), reduction="none")
            ce = ce.view(batch_size, -1).cpu().double() * valid  # (B, R) nats, padding zeroed
            t = m.double() / L  # (B,) masking ratio
            total += float((ce.sum(1) / t).sum())
    return -total / mc_num
