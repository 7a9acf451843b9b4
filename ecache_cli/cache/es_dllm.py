"""``es-dllm``: ES-dLLM, early skipping (Zhu et al., "ES-dLLM: Efficient Inference for Diffusion Large
Language Models by Early-Skipping", ICLR 2026, arXiv 2603.10088; code zhuzj19/ES-dLLM).

Schedule (zhuzj19/ES-dLLM ``generate.py batch_generate``), per row, with g = block * block_length +
step in block (the official ``step_cnt``: it is a multiple of the block length at every block start,
also when a block finishes early) and the window in logit coordinates (a logit shift s moves it s to
the left, as the official Dream window):

- g == 0: a full forward (the only time the suffix after the current block is computed);
- g % PUF == 0 (``prompt_update_freq``, 0 = the block length): compute [0, block end), all layers;
- g % BUF == 0 (``block_update_freq``, 0 = never): compute the block, all layers;
- otherwise compute the block, skipping positions at the skip layers (below).

Defaults: alpha 0.5 and the proportions/positions of every paper script; PUF = the block length and BUF
16, the paper's LLaDA-Instruct GSM8K setting (block 64, PUF 64, BUF 16: ``scripts/eval_*_singlegpu.sh``),
which with our default block of 32 gives a prompt update at each block start, a block update at step 16
and skipping at the other 30 steps of a block.

At a block's first step the window starts at the leftmost position committed at the previous step
(so the last commits of the previous block get their K/V recomputed). Everything outside the window
is read from the KV store; the suffix keeps the K/V of the first forward.

Skipping (zhuzj19/ES-dLLM ``early_skipping.py skip_in_hidden_state``, ``get_importance_score``; mode
"HiddenState"): ``proportions`` p_k at depth fractions ``positions`` s_k give layer i the share p of the
last pair with i ≥ s·n_layers; after each layer i whose share differs from the layer before (the first
layer compares with 1) only the top ``max(int(p_i · W), min(c + 2, block_length))`` positions go on (W
the row's window length, c the tokens the row committed at the previous step), i.e. a
``contract.hooks.Shrink`` at the input of layer i + 1. Defaults [1, 0.5, 0.25] at [0, 0.125, 0.25]:
LLaDA-8B (32 layers) skips after layers 4 and 8, Dream-7B (28) after 4 and 7, the 4-layer embedded model
once, after layer 1 (to 25 %). The score of a position still computed, from the layer's input h and the
same layer's input as last stored h_c (``store.hidden``: written only for the positions computed there,
so the variation accumulates over the steps the position was skipped):

    v = mean_d |h − h_c| / (rms(h_c) + 1e-6),   v ← v / max(max v, 1)   (per row)
    score = α · conf + (1 − α) · v  (+2 to the two highest conf if α > 0)
            + 5 at the leftmost masked position of the block (its logit source)
            + 3 at the positions committed at the previous step (if α < 1)

conf is the position's last confidence: the probability of the token the decoder drew there the last
time it got logits (its maximum probability at temperature 0), 0 once committed. A skipped position
gets no logits at that step and cannot be committed then (``Shrink.keep_logits = False``).

Adaptations (our choices): scores in float32 (the official code computes in bf16); the kept set is the
top count by score with ties broken by the lower position, and deeper layers compute it in position
order (the official ``torch.topk(sorted=False)`` leaves tie order and row order to the CUDA kernel; a
position's computation does not depend on the order of the others). A skip after the last layer (it
would only drop logits) is not applied. With a schedule that commits k > 1 tokens at a step, the +5
bonus goes to the k leftmost masked positions and the count is at least min(max(c, k) + 2,
block_length), so every scheduled commit has a candidate (with one token per step, the paper's setting,
this is the official rule). The window also holds the block's masked positions themselves (with Dream's
shift the official window leaves out the block's last position). The eos-delay rule of the official
sampler belongs to the decoding settings, not to this policy. ``refresh_every`` (0 = never, the paper)
is our option, used to check that a forced refresh reproduces ``none``. Decisions and counts are per row
(the official count is one for the batch), so a prompt decodes the same alone or in any batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..contract.fields import Range, count
from ..contract.hooks import ForwardHooks, LayerView, Shrink
from ..contract.rows import ROW
from ..contract.state import DecodeState, StepRecord
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan

TOP_CONF_BONUS = 2.0  # zhuzj19/ES-dLLM early_skipping.py get_importance_score (top-2 confidence)
LEFTMOST_MASK_BONUS = 5.0  # zhuzj19/ES-dLLM generate.py batch_generate (constant_coefficient)
LAST_COMMIT_BONUS = 3.0  # zhuzj19/ES-dLLM generate.py batch_generate (constant_coefficient)
RMS_EPS = 1e-6  # zhuzj19/ES-dLLM early_skipping.py skip_in_hidden_state


def parse_shares(text: str, what: str) -> list[float]:
    """Numbers from ``text`` separated by commas, slashes or spaces ("1,0.5,0.25", "1/0.5/0.25" in a
    ``--policies`` variant). Raises UsageError naming ``what`` and the bad text."""
    try:
        return [float(t) for t in re.split(r"[,/\s]+", text.strip()) if t]
    except ValueError:
        raise UsageError(f"es-dllm {what}={text!r} must be numbers separated by ',' or '/', e.g. 1/0.5/0.25") from None


def skip_layers(proportions: list[float], positions: list[float], n_layers: int) -> list[tuple[int, float]]:
    """(layer, share) per skip: after layer ``layer - 1`` the share ``share`` of the window goes on.

    Layer i's share is the p of the last (p, s) pair with i ≥ s · n_layers (1 when none), as in
    zhuzj19/ES-dLLM ``generate.py batch_generate``; a skip follows every layer whose share differs
    from the previous layer's (1 before layer 0). Skips after the last layer are dropped.
    """
    out, prev = [], 1.0
    for i in range(n_layers):
        p = 1.0
        for share, depth in zip(proportions, positions):
            if i >= depth * n_layers:
                p = share
        if p != prev and i + 1 < n_layers:
            out.append((i + 1, p))
        prev = p
    return out


def variation(x: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Relative change of hidden states, (B, S) float32: mean_d |x − c| / (rms_d(c) + 1e-6).

    ``x``, ``cached`` (B, S, d) (zhuzj19/ES-dLLM ``early_skipping.py skip_in_hidden_state``).
    """
    x, c = x.float(), cached.float()
    return (x - c).abs().mean(-1) / (c.pow(2).mean(-1).sqrt() + RMS_EPS)


@dataclass
class ESDLLM(CachePolicy):
    """ES-dLLM; see the module docstring. alpha in [0, 1]; proportions and positions in [0, 1];
    update frequencies in denoising steps."""

    alpha: float = 0.5
    proportions: str | float = "1,0.5,0.25"  # a single number (one stage) may come typed from YAML or --policies
    positions: str | float = "0,0.125,0.25"
    prompt_update_freq: int = 0
    block_update_freq: int = 16
    refresh_every: int = 0
    name = "es-dllm"
    row_state = {"conf": ROW}
    keeps_hidden = True
    forced_refresh = {"refresh_every": 1}  # our option (the paper refreshes in full only at its first step)
    test_params = {"proportions": "1,0.5", "positions": "0,0", "block_update_freq": 4}  # skips after layer 0
    ranges = {"alpha": Range(0, 1, example="0.5", why="the confidence's weight"),
              "proportions": Range(0, 1, lo_open=True, example="1/0.5/0.25", why="kept shares, one per stage"),
              "positions": Range(0, 1, example="0/0.125/0.25", why="depth fractions, one per stage"),
              "prompt_update_freq": count(0, "64", "0 = the block length"),
              "block_update_freq": count(0, "16", "0 = never"), "refresh_every": count(0, "8", "0 = never")}

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise UsageError(f"es-dllm alpha {self.alpha} must be within [0, 1] (0.5: the paper's)")
        for name in ("proportions", "positions"):  # a YAML list in a profile: the same numbers as "1,0.5,0.25"
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                setattr(self, name, ",".join(str(v) for v in value))
        self.shares = parse_shares(str(self.proportions), "proportions")
        self.depths = parse_shares(str(self.positions), "positions")
        if len(self.shares) != len(self.depths) or not self.shares:
            raise UsageError(f"es-dllm proportions {self.proportions!r} and positions {self.positions!r} must "
                             "list as many numbers (e.g. 1/0.5/0.25 and 0/0.125/0.25: slashes, which a --policies "
                             "list also takes)")
        if not all(0.0 < p <= 1.0 for p in self.shares) or not all(0.0 <= s <= 1.0 for s in self.depths):
            raise UsageError(f"es-dllm proportions {self.proportions!r} must lie in (0, 1] and positions "
                             f"{self.positions!r} in [0, 1]")
        if self.depths != sorted(self.depths):
            raise UsageError(f"es-dllm positions {self.positions!r} must not decrease "
                             "(depth fractions, e.g. 0/0.125/0.25)")
        for key in ("prompt_update_freq", "block_update_freq", "refresh_every"):
            if getattr(self, key) < 0:
                raise UsageError(f"es-dllm {key} {getattr(self, key)} must be ≥ 0 steps (0 = "
                                 f"{'the block length' if key == 'prompt_update_freq' else 'never'})")
        self.conf: torch.Tensor | None = None  # (B, T) float32 last confidence, by logit position

    def reset(self, state: DecodeState) -> None:
        self.conf = torch.zeros(state.tokens.shape, device=state.tokens.device)

    def plan(self, state: DecodeState) -> ForwardPlan:
        """Per row: the full forward, the prompt or block update, or the skipping step (module docstring)."""
        BL, sh, T = state.block_length, state.logit_shift, state.length
        t = state.step_in_block
        g = state.block * BL + t  # (B,) zhuzj19/ES-dLLM generate.py batch_generate step_cnt
        refresh = state.row_step == 0
        if self.refresh_every > 0:
            refresh = refresh | (state.row_step % self.refresh_every == 0)
        prompt = g % (self.prompt_update_freq or BL) == 0
        block = g % self.block_update_freq == 0 if self.block_update_freq > 0 else torch.zeros_like(prompt)
        skip = ~(refresh | prompt | block)  # (B,)
        last = state.sources(state.commit_step == (state.row_step - 1)[:, None])  # (B, T) logit coordinates
        pos = torch.arange(T, device=t.device)
        start = state.block_start - sh
        first_last = torch.where(last, pos, T).amin(1)  # (B,) leftmost_decode_pos
        lo = torch.where(t > 0, start, torch.minimum(first_last, start))
        lo = torch.where(prompt, 0, lo)
        masked = state.sources(state.block_masked())  # (B, T) sources of the block's masks
        window = (state.span(lo, state.block_end - sh) & state.key_mask) | self.targets_and_sources(state)
        hooks = None
        if bool(skip.any()):  # one host sync: steps where no row skips run without shrinks
            hooks = ForwardHooks(shrink=self.shrinks(state, window, last, masked, skip))
        return ForwardPlan(refresh=refresh, compute=window, hooks=hooks)

    def shrinks(self, state: DecodeState, window, last, masked, skip) -> tuple[Shrink, ...]:
        """The skipping step's shrinks, one per skip layer; rows not in ``skip`` (B,) bool keep everything."""
        BL = state.block_length
        k = torch.ones_like(skip, dtype=torch.long)
        if state.schedule is not None:  # tokens the schedule commits at this step (≥ 1)
            sib = state.step_in_block.clamp(0, state.schedule.shape[1] - 1)
            k = state.schedule.gather(1, sib[:, None]).squeeze(1).clamp_min(1)
        first_k = masked & (masked.long().cumsum(1) <= k[:, None])
        bonus = LEFTMOST_MASK_BONUS * first_k.float()
        if self.alpha < 1:
            bonus = bonus + LAST_COMMIT_BONUS * last.float()
        width = window.sum(1).double()  # (B,) W
        floor = (torch.maximum(last.sum(1), k) + 2).clamp_max(BL)  # (B,) min(max(c, k) + 2, block_length)
        everything = torch.full_like(floor, state.length)
        out = []
        for layer, share in skip_layers(self.shares, self.depths, state.n_layers):
            count = torch.maximum((width * share).floor().long(), floor)  # (B,)
            out.append(Shrink(layer=layer, keep=self._keeper(self.conf, bonus, torch.where(skip, count, everything)),
                              keep_logits=False))
        return tuple(out)

    def _keeper(self, conf: torch.Tensor, bonus: torch.Tensor, count: torch.Tensor):
        """The keep function of one skip layer over the policy's (B, T) ``conf``, ``bonus`` and (B,) ``count``."""
        alpha = self.alpha

        def keep(view: LayerView, rows: torch.Tensor) -> torch.Tensor:
            if view.cached is None:
                raise ValueError("es-dllm needs a store that keeps hidden states (keeps_hidden)")
            posn = view.positions  # (B, S)
            S = posn.shape[1]
            col = torch.arange(S, device=posn.device)
            real = (col == 0) | (posn != posn[:, :1])  # padding repeats the row's first position
            v = variation(view.x, view.cached).masked_fill(~real, 0.0)
            v = v / v.amax(1, keepdim=True).clamp_min(1.0)
            c = conf[rows].gather(1, posn)  # (B, S)
            score = alpha * c + (1 - alpha) * v
            if alpha > 0:  # the two highest confidences among the positions still computed
                top = torch.where(real, c, float("-inf")).argsort(dim=1, descending=True, stable=True)[:, :2]
                score = score.scatter_add(1, top, torch.full(top.shape, TOP_CONF_BONUS, device=score.device))
            score = (score + bonus[rows].gather(1, posn)).masked_fill(~real, float("-inf"))
            order = score.argsort(dim=1, descending=True, stable=True)  # ties: the lower position first
            ranked = col[None, :] < count[rows][:, None]  # (B, S) the top count, in rank order
            return torch.zeros_like(real).scatter(1, order, ranked) & real

        return keep

    def observe(self, state: DecodeState, record: StepRecord) -> None:
        """conf at each target's logit position: the probability of its drawn token where it got logits,
        0 where it was committed (zhuzj19/ES-dLLM generate.py sample_tokens_LLaDA: last_confidence)."""
        src = record.targets - state.logit_shift  # (B, R)
        got = torch.zeros_like(state.tokens).scatter_add_(1, src, record.valid.long()) > 0  # (B, T)
        prob = torch.where(record.valid, record.prob.float(), 0.0)  # padding repeats carry 0
        new = torch.zeros_like(self.conf).scatter_reduce(1, src, prob, "amax")
        done = torch.zeros_like(state.tokens).scatter_add_(1, src, (record.committed & record.valid).long()) > 0
        self.conf = torch.where(got & ~done, new, torch.where(done, 0.0, self.conf))
