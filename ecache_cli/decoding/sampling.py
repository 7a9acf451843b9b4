"""Turn one step's logits into a proposed token per candidate position, plus its confidence signals.

Everything is computed in float64 from the logits less their row maximum (log-probabilities up to a
constant per row, one exponential for every signal), batched over (B, N), with no device sync:
- selection: argmax at temperature 0, else Gumbel-max in float64 (LLaDA's add_gumbel_noise; low
  precision Gumbel noise hurts generation quality, arXiv 2409.02908);
- filtering: banned ids, then Dream's nucleus (top_p) and top_k rules (Dream generation_utils
  sample_tokens);
- signals: probability of the chosen token under the filtered distribution at temperature 1 (the
  Fast-dLLM / LLaDA app.py confidence), top-1 minus top-2 probability (Dream topk_margin), and the
  entropy of softmax(raw logits) in nats (the EntropyCache signal, docs/METHOD.md §2.2); on request
  (``dream_alg``), Dream's own confidence of an alg, taken from the temperature-scaled, top-p/top-k
  filtered distribution (Dream generation_utils.py sample_tokens), for the Dream rules.

Memory: at most two float64 (B, N, V) buffers are alive at once (three with top_p, whose sort also
returns int64 indices, one more when the caller passes pre-drawn ``uniform`` noise, one or two more
for Dream's confidence at T ≠ 1 or with a filter); for V = 126464 one buffer is ~1 MB per row. The
returned :class:`Sampled` keeps the filtered, shifted log-probabilities (one buffer) until it is dropped,
for its ``margin``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ecache_cli.errors import UsageError

_F64_MIN = torch.finfo(torch.float64).min
_LOG2_E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Sampled:
    """One step's proposals for N candidate rows per batch row; every field is (B, N) on the logits' device.

    x0: long, the chosen token id.
    prob: float64, softmax probability of x0 under the filtered logits at temperature 1.
    entropy: float64 nats, entropy of softmax(raw logits) (before banned ids, top_k/top_p, temperature).
    margin: float64, top-1 minus top-2 probability under the same distribution as prob; computed when
        first read (only the topk_margin rules read it), from the filtered log-probabilities kept here.
    neg_entropy: float64, −entropy (higher = more certain; the 'entropy' score of the LLaDA rules).
    dream_conf: float64, or None unless ``sample(..., dream_alg=...)``: Dream's own confidence of that alg
        (Dream generation_utils.py ``sample_tokens``), see :func:`sample`.
    """

    x0: torch.Tensor
    prob: torch.Tensor
    entropy: torch.Tensor
    dream_conf: torch.Tensor | None = None
    filtered: torch.Tensor | None = field(default=None, repr=False)  # (B, N, V) f64 filtered log-probs + c
    lse: torch.Tensor | None = field(default=None, repr=False)  # (B, N, 1) f64 their logsumexp
    layout: torch.Tensor | None = field(default=None, repr=False)  # (B, N) bool: filtered/lse hold these only

    @property
    def margin(self) -> torch.Tensor:
        vocab = self.filtered.shape[-1]
        top2 = (self.filtered.topk(min(2, vocab), dim=-1).values - self.lse).exp_()  # (B, N, ≤2)
        margin = top2[..., 0] - top2[..., 1] if vocab > 1 else top2[..., 0]  # (B, N) or (1, K) packed
        return margin if self.layout is None else _spread(margin[0], self.layout)

    @property
    def neg_entropy(self) -> torch.Tensor:
        return -self.entropy

    def spread(self, layout: torch.Tensor) -> "Sampled":
        """This (1, K) result of the K True entries of ``layout`` (B, N) bool, laid out as (B, N): each
        False entry takes its row's first entry (a padding repeat of the row's first target; 0 for a row
        with none)."""
        return Sampled(x0=_spread(self.x0[0], layout), prob=_spread(self.prob[0], layout),
                       entropy=_spread(self.entropy[0], layout),
                       dream_conf=None if self.dream_conf is None else _spread(self.dream_conf[0], layout),
                       filtered=self.filtered, lse=self.lse, layout=layout)


def _spread(packed: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """(K,) values of the True entries of ``layout`` (B, N) bool → (B, N); False entries repeat column 0."""
    out = packed.new_zeros(layout.shape)
    out[layout] = packed
    return torch.where(layout, out, out[:, :1])

    @property
    def neg_entropy(self) -> torch.Tensor:
        return -self.entropy


DREAM_ALGS = ("maskgit_plus", "topk_margin", "entropy")  # the confidences of Dream's sample_tokens
_DREAM_EPS = 1e-10  # Dream sample_tokens: neg entropy = sum(p * log(p + 1e-10))


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    banned_ids: torch.Tensor | None,
    uniform: torch.Tensor | None = None,
    dream_alg: str | None = None,
) -> Sampled:
    """Choose a token for every candidate row and compute its confidence signals.

    Args:
        logits: (B, N, V), any float dtype (bf16 from the model is fine); not modified. Every row must
            keep at least one finite logit outside banned_ids, or the outputs are NaN.
        temperature: ≥ 0. 0 → argmax (first index on ties). > 0 → argmax(log p + T·g) with g standard
            Gumbel noise drawn in float64, which is argmax(logits/T + g), i.e. a draw from
            softmax(logits/T); it is the log of LLaDA's exp(logits) / (−log U)^T (generate.py
            add_gumbel_noise), kept in log space so large logits or temperatures cannot overflow.
            float64 because low-precision Gumbel noise degrades generation (arXiv 2409.02908).
        top_k: None, or ≥ 1: keep the logits ≥ the k-th largest (ties at the k-th kept; Dream
            top_k_logits). Applied after top_p, as in Dream.
        top_p: None, or in (0, 1]; < 1 applies Dream's nucleus rule: sort by probability under
            softmax(logits/T) (T = 1 when temperature is 0), keep every token before the cumulative
            probability first exceeds top_p and that first exceeding token. Ties with the last kept
            token are also kept (Dream's tie order is backend-defined).
        generator: torch.Generator on the logits' device, for the Gumbel noise (None = global RNG).
        uniform: None, or pre-drawn U[0, 1) noise, float64 (B, N, V) on the logits' device, used instead
            of drawing from ``generator`` (the engine draws it row by row from per-row generators, so a
            row's noise does not depend on the batch it is in). Overwritten in place.
        banned_ids: None, or a 1-D LongTensor of ids in [0, V) set to −inf before anything else
            (e.g. the mask id and padded vocab rows ≥ the tokenizer's size): never chosen, in any mode.
        dream_alg: None, or one of DREAM_ALGS: also return Dream's confidence of that alg as
            ``dream_conf`` (Dream generation_utils.py ``sample_tokens``, which scores with the distribution
            it samples from): q = softmax(top_k(top_p(logits / T))), T = temperature (1 when 0), in float64;
            maskgit_plus → q(x0); topk_margin → top-1 minus top-2 of q; entropy → Σ q·log(q + 1e-10), the
            negative entropy with Dream's epsilon. For maskgit_plus / topk_margin, q excludes banned_ids
            (they are never chosen, so they are not scored); for entropy, q is Dream's whole distribution,
            banned ids included and filtered by top_p / top_k as Dream filters it (one more (B, N, V)
            buffer, plus top_p's sort, when T ≠ 1 or a filter is set).
    Returns:
        Sampled, all fields (B, N); see its docstring. entropy ignores every filter; prob and margin
        use the filtered distribution at temperature 1 (Fast-dLLM / LLaDA app.py float64 convention,
        LLaDA generate.py low_confidence: softmax of the un-tempered logits); dream_conf is Dream's
        temperature-scaled confidence (None without dream_alg). At temperature 0 without top_p / top_k,
        dream_conf equals prob (maskgit_plus) and margin (topk_margin).
    Raises:
        UsageError: temperature < 0, top_k < 1, or top_p outside (0, 1].
        AssertionError: dream_alg not in DREAM_ALGS.
    """
    if not temperature >= 0:  # also rejects NaN
        raise UsageError(f"--temperature {temperature} must be ≥ 0 (0 = greedy argmax)")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top-k {top_k} must be ≥ 1 (leave it unset to keep every token)")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p {top_p} must be in (0, 1] (1 or unset keeps every token)")
    assert logits.dim() == 3 and logits.is_floating_point(), (
        f"logits must be float (B, N, V), got {logits.dtype} {tuple(logits.shape)}"
    )
    vocab = logits.shape[-1]
    assert dream_alg is None or dream_alg in DREAM_ALGS, f"dream_alg {dream_alg!r} not in {DREAM_ALGS}"
    t_score = temperature if temperature > 0 else 1.0  # Dream divides the logits by T only when T > 0
    dream_conf = None

    # --- entropy of the raw distribution, from one exp over the float64 working buffer
    # z = logits − row max (≤ 0): log-probabilities up to a per-row constant, which every rule below is
    # blind to (argmax, Gumbel-max, top-k, the nucleus, the renormalised probabilities); one exp instead
    # of log_softmax's and a second one for p.
    z = logits.to(torch.float64, copy=True)  # (B, N, V) f64
    z.sub_(z.amax(dim=-1, keepdim=True))
    # −inf → most negative finite value: exp() still gives exactly 0, and 0·z stays 0 (not NaN) below.
    z.clamp_(min=_F64_MIN)
    # exp(z) as 2^(z·log2 e): float64 exp2 runs about 3× faster than exp on CPU (AVX-512, torch 2.13); the
    # relative difference grows as ~1e-16·|z| (6e-15 at z = −50, a value 2e-22 of the row's largest);
    # rows of equal logits still get equal values
    e = torch.mul(z, _LOG2_E).exp2_()  # (B, N, V) unnormalised probabilities, max 1
    total = e.sum(dim=-1, keepdim=True)  # (B, N, 1)
    # H = log Σe − Σ e·z / Σe (the entropy of e / Σe), nats; einsum runs as a batched matmul, so the
    # product e·z is never materialised
    log_total = total.log()
    entropy = (log_total.squeeze(-1) - torch.einsum("bnv,bnv->bn", e, z) / total.squeeze(-1)).clamp_(min=0.0)
    if dream_alg == "entropy":  # before the banned ids are removed: Dream scores its whole distribution
        # z and e become log p and p in place (no more buffers); every rule below is blind to the shift
        # and the scale
        dream_conf = _dream_neg_entropy(z.sub_(log_total), e.div_(total), t_score, top_k, top_p)
    filtered = (top_p is not None and top_p < 1) or (top_k is not None and top_k < vocab)
    banned = None
    if banned_ids is not None and banned_ids.numel() > 0:
        banned = banned_ids.to(device=z.device, dtype=torch.long).reshape(-1)
    kept_mass = None
    if not filtered:  # only banned ids leave: the kept ids' mass, a row-wise sum (the same for a row in
        # any batch, unlike a matrix product, whose blocking follows the shape)
        kept_mass = (e if banned is None else e.index_fill_(-1, banned, 0.0)).sum(dim=-1, keepdim=True)  # (B, N, 1)
    del e

    # --- filters: set excluded entries of z to −inf (renormalised at the end)
    if banned is not None:
        z.index_fill_(-1, banned, float("-inf"))
    if top_p is not None and top_p < 1:
        _apply_top_p(z, top_p, temperature if temperature > 0 else 1.0)
    if top_k is not None and top_k < vocab:
        kth = z.topk(top_k, dim=-1).values[..., -1:]  # (B, N, 1)
        z.masked_fill_(z < kth, float("-inf"))

    # --- selection
    if temperature == 0:
        z_x0, x0 = z.max(dim=-1, keepdim=True)  # (B, N, 1) each; the first index on ties
    else:
        if uniform is None:
            g = torch.rand(z.shape, dtype=torch.float64, device=z.device, generator=generator)  # U[0, 1)
        else:
            assert uniform.shape == z.shape and uniform.dtype == torch.float64, (
                f"uniform must be float64 {tuple(z.shape)}, got {uniform.dtype} {tuple(uniform.shape)}")
            g = uniform
        g.log_().neg_().log_().neg_()  # Gumbel(0, 1) = −log(−log U); U = 0 gives −inf (never chosen)
        g.mul_(temperature).add_(z)  # z + T·g: same argmax as log p / T + g
        x0 = g.argmax(dim=-1, keepdim=True)  # (B, N, 1)
        del g
        z_x0 = z.gather(-1, x0)

    # --- signals under the filtered distribution at temperature 1
    # log of the kept ids' mass: the renormaliser of the filtered z
    lse = kept_mass.log_() if kept_mass is not None else torch.logsumexp(z, dim=-1, keepdim=True)  # (B, N, 1)
    prob = (z_x0 - lse).exp_().squeeze(-1)  # (B, N)
    x0 = x0.squeeze(-1)  # (B, N)
    out = Sampled(x0=x0, prob=prob, entropy=entropy, filtered=z, lse=lse)
    if dream_alg in ("maskgit_plus", "topk_margin"):
        if t_score == 1.0:  # Dream's q is the distribution of prob and margin
            dream_conf = (prob if dream_alg == "maskgit_plus" else out.margin).clone()
        else:  # q = softmax(z / T) over the kept ids (z is log-softmax(logits) plus a constant per row)
            lse_t = torch.logsumexp(z / t_score, dim=-1, keepdim=True)  # (B, N, 1)
            if dream_alg == "maskgit_plus":
                dream_conf = (z_x0.squeeze(-1) / t_score - lse_t.squeeze(-1)).exp_()
            else:
                q2 = (z.topk(min(2, vocab), dim=-1).values / t_score - lse_t).exp_()  # (B, N, ≤2)
                dream_conf = q2[..., 0] - q2[..., 1] if vocab > 1 else q2[..., 0]
    return out if dream_conf is None else replace(out, dream_conf=dream_conf)


def _dream_neg_entropy(logp: torch.Tensor, p: torch.Tensor, temperature: float, top_k: int | None,
                       top_p: float | None) -> torch.Tensor:
    """Dream's 'entropy' confidence (generation_utils.py sample_tokens, neg_entropy=True), float64 (B, N).

    Σ q·log(q + 1e-10) with q = softmax(top_k(top_p(logits / T))): Dream's filters, on the whole vocabulary.
    logp: (B, N, V) float64 log-softmax of the raw logits (unbanned, −inf clamped to the float64 minimum),
    not modified; p = exp(logp), reused when T = 1 and no filter is set.
    """
    filtered = (top_p is not None and top_p < 1) or (top_k is not None and top_k < logp.shape[-1])
    if temperature == 1.0 and not filtered:
        q = p
    else:
        lq = logp / temperature if temperature != 1.0 else logp.clone()  # (B, N, V) tempered log-probs
        if top_p is not None and top_p < 1:
            _apply_top_p(lq, top_p, 1.0)  # lq is already tempered: its nucleus is that of softmax(logits / T)
        if top_k is not None and top_k < lq.shape[-1]:
            lq.masked_fill_(lq < lq.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
        lq.sub_(torch.logsumexp(lq, dim=-1, keepdim=True))
        q = lq.exp_()  # filtered ids: exp(−inf) = 0 exactly, and 0·log(1e-10) = 0 below
    log_q = (q + _DREAM_EPS).log_()  # (B, N, V)
    return torch.einsum("bnv,bnv->bn", q, log_q)


def _apply_top_p(logp: torch.Tensor, top_p: float, temperature: float) -> None:
    """Dream's nucleus filter, in place on logp (B, N, V) log-probabilities (up to a constant per row): −inf
    outside the nucleus of softmax(logp / T)."""
    sorted_lp, order = logp.sort(dim=-1, descending=True)  # (B, N, V) f64, (B, N, V) long
    # softmax(sorted / T) in place: the row max is the first column
    sorted_lp.sub_(sorted_lp[..., :1].clone()).div_(temperature).exp_()
    sorted_lp.div_(sorted_lp.sum(dim=-1, keepdim=True)).cumsum_(dim=-1)  # cumulative probability
    # rank r is kept iff r == 0 or cum[r-1] ≤ top_p (Dream: remove cum > top_p, shifted right by one), so
    # n_keep = 1 + #{r : cum[r] ≤ top_p}, capped at V. cum is non-decreasing: a binary search counts
    # without a (B, N, V) comparison mask (whose sum would materialise an int64 copy).
    p_bound = torch.full((*logp.shape[:-1], 1), top_p, dtype=torch.float64, device=logp.device)  # (B, N, 1)
    n_keep = (1 + torch.searchsorted(sorted_lp, p_bound, right=True)).clamp_(max=logp.shape[-1])  # (B, N, 1)
    del sorted_lp
    last_kept = order.gather(-1, n_keep - 1)  # (B, N, 1) token id of the last kept rank
    del order
    cutoff = logp.gather(-1, last_kept)  # (B, N, 1)
    logp.masked_fill_(logp < cutoff, float("-inf"))
