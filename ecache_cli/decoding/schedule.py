"""Block plan and per-step commit counts for semi-autoregressive masked-diffusion decoding.

The generated span (gen_length positions) is split into equal blocks decoded left to right; each block
gets the same number of denoising steps. Two per-step schedules: LLaDA's spreads the block's masks
evenly over those steps (LLaDA generate.py, docs/MODELS.md §5.1); Dream's follows its timesteps
linspace(1, eps, steps + 1) (generation_utils.py, docs/MODELS.md §5.2). In Fast-dLLM threshold/factor mode
(docs/MODELS.md §6.1-6.2) a block runs until it has no masks instead, so the step count may be left unset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ecache_cli.errors import UsageError


@dataclass(frozen=True)
class BlockPlan:
    """How the generated span is cut into blocks and how many steps each block gets.

    steps_per_block is None only in threshold/factor mode without --steps: each block then runs until it
    has no masks. Every threshold/factor step commits at least one token, so a block needs at most
    block_length forwards. In threshold/factor mode with --steps given, the count is checked as
    Fast-dLLM checks it and recorded here; it drives only the quota of Dream's threshold rule
    (decoding/commit.py), not a schedule.
    """

    num_blocks: int
    block_length: int
    steps_per_block: int | None

    @property
    def gen_length(self) -> int:
        return self.num_blocks * self.block_length


def default_steps(gen_length: int, steps: int | None, threshold_mode: bool) -> int | None:
    """Denoising steps when none are given: one token per step (LLaDA's steps = gen_length), except in
    threshold/factor mode, where the step count is not fixed (None)."""
    return steps if steps is not None or threshold_mode else gen_length


def plan_blocks(gen_length: int, block_length: int, steps: int | None, threshold_mode: bool,
                max_gen: int | None = None) -> BlockPlan:
    """Check the gen-length / block-length / steps combination and return the block plan.

    Rules (LLaDA generate.py, docs/MODELS.md §5.1): gen_length ≥ 1, block_length ≥ 1,
    gen_length % block_length == 0 (num_blocks = gen_length / block_length), steps ≥ num_blocks and
    steps % num_blocks == 0 (steps_per_block = steps / num_blocks ≥ 1). In threshold/factor mode
    (Fast-dLLM, docs/MODELS.md §6.1) steps may be None. steps_per_block may exceed block_length: as in LLaDA, the
    extra steps then commit 0 tokens.

    ``max_gen``: the largest gen-length the model's positions hold (``engine.checks.gen_length_fit`` beside a
    one-token prompt), when known: a suggested gen-length is never above it.

    Raises:
        UsageError: one line that names the bad value and the fix (and the resulting steps per block).
    """
    if gen_length < 1:
        raise UsageError(f"--gen-length {gen_length} must be ≥ 1: it is the number of tokens to generate")
    if block_length < 1:
        raise UsageError(
            f"--block-length {block_length} must be ≥ 1: use a divisor of --gen-length {gen_length} "
            f"(e.g. 32, or {gen_length} for a single block)"
        )
    if gen_length % block_length != 0:
        lower = gen_length // block_length * block_length
        fits = [g for g in (lower, lower + block_length) if g > 0 and (max_gen is None or g <= max_gen)]
        if not fits and max_gen is not None and max_gen >= block_length:  # both beyond the model's positions
            fits = [max_gen // block_length * block_length]
        hint = " or ".join(map(str, fits)) or f"{block_length}"
        raise UsageError(
            f"--gen-length {gen_length} is not a multiple of --block-length {block_length}: use a "
            f"gen-length that is (e.g. {hint}) or a block length that divides {gen_length}"
        )
    num_blocks = gen_length // block_length
    where = f"(gen-length {gen_length} / block-length {block_length})"

    if steps is None:
        if threshold_mode:
            return BlockPlan(num_blocks=num_blocks, block_length=block_length, steps_per_block=None)
        raise UsageError(
            f"--steps is required without threshold or factor decoding: use a multiple of the {num_blocks} "
            f"blocks {where}, e.g. --steps {gen_length} (each block then gets {block_length} steps)"
        )
    if steps < 1:
        raise UsageError(f"--steps {steps} must be ≥ 1: use a multiple of the {num_blocks} blocks {where}")
    if steps < num_blocks:
        raise UsageError(
            f"--steps {steps} is fewer than the {num_blocks} blocks {where}: use --steps ≥ {num_blocks}, "
            f"a multiple of {num_blocks} (each block then gets steps/{num_blocks} steps)"
        )
    if steps % num_blocks != 0:
        lower = steps // num_blocks * num_blocks
        raise UsageError(
            f"--steps {steps} is not a multiple of the {num_blocks} blocks {where}: use --steps {lower} or "
            f"{lower + num_blocks} (each block then gets {lower // num_blocks} or {lower // num_blocks + 1} steps)"
        )
    return BlockPlan(num_blocks=num_blocks, block_length=block_length, steps_per_block=steps // num_blocks)


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """How many masks each row commits at each step of a block (LLaDA get_num_transfer_tokens).

    Linear noise schedule: base = n // steps per step, and the remainder n % steps adds one token to
    each of the earliest steps, e.g. 10 masks over 4 steps -> [3, 3, 2, 2]. Rows sum to mask_count.

    Args:
        mask_count: LongTensor (B,), masks in the current block per row (≥ 0; not checked, to avoid a
            device sync).
        steps: steps of this block, ≥ 1.
    Returns:
        LongTensor (B, steps) on mask_count's device.
    """
    assert steps >= 1, f"steps must be ≥ 1, got {steps}"
    n = mask_count.to(torch.long)  # (B,)
    base = torch.div(n, steps, rounding_mode="floor")[:, None]  # (B, 1)
    remainder = (n % steps)[:, None]  # (B, 1)
    step_idx = torch.arange(steps, device=n.device)[None, :]  # (1, steps)
    return base + (step_idx < remainder).long()  # (B, steps)


SCHEDULES = ("llada", "dream", "block")


def validate_schedule(name: str) -> str:
    """Check a --schedule name (SCHEDULES). Returns it unchanged; raises UsageError listing the valid ones."""
    if name not in SCHEDULES:
        raise UsageError(f"--schedule {name!r} is not a schedule; use one of llada (LLaDA's linear split), dream "
                         "(Dream's timesteps), block (the block-diffusion loops' block-length / steps per step)")
    return name


def block_num_transfer_tokens(batch: int, block_length: int, steps: int, device) -> torch.Tensor:
    """The block-diffusion loops' per-step counts (SDAR generate.py, LLaDA2 ``generate``; docs/MODELS.md
    §10): block_length // steps each step, one more on the first block_length % steps, whatever masks the
    block holds (a first block shared with the prompt's tail has fewer; the commit rule then takes what
    there is). Returns LongTensor (batch, steps)."""
    return num_transfer_tokens(torch.full((batch,), block_length, dtype=torch.long, device=device), steps)


def dream_num_transfer_tokens(mask_count: torch.Tensor, steps: int, eps: float, first: int = 0) -> torch.Tensor:
    """How many masks each row commits at each step of a block under Dream's schedule.

    Dream generation_utils.py ``_sample`` (algs maskgit_plus / topk_margin / entropy; docs/MODELS.md §5.2):
    timesteps t = linspace(1, eps, steps + 1) in float32; at step i the row holds n_i masks and commits
    k_i = int(n_i · (1 − t[i+1] / t[i])) (float32 product, truncated), every remaining mask at the last
    step. A step may commit 0 (e.g. 16 masks over 16 steps: [0, 1, 1, …, 1, 2]). Since every step
    commits exactly k_i, n_i is known in advance and the whole block is computed here at its start.
    Dream averages the mask count over the batch; every row of a block holds the same count, so the
    per-row count is the same number. Fast-dLLM's block sampler (dream/model/generation_utils_block.py)
    counts a block's steps from 1 on the same grid (its step 0 commits the block's first position):
    pass ``first=1`` and the masks left after that commit.

    Args:
        mask_count: LongTensor (B,), masks per row at step ``first`` (≥ 0; not checked, no device sync).
        steps: steps of this block, ≥ 1.
        eps: the last timestep, in [0, 1) (Dream's generation_config eps, 1e-3).
        first: steps before this index get 0 (the caller commits there by another rule).
    Returns:
        LongTensor (B, steps) on mask_count's device; rows sum to mask_count (when first < steps).
    """
    assert steps >= 1 and 0 <= first <= steps, f"steps {steps}, first {first}"
    n = mask_count.to(torch.long).clone()  # (B,)
    # float32 on the counts' device, as Dream computes them on the canvas' device
    t = torch.linspace(1, eps, steps + 1, dtype=torch.float32, device=n.device)  # (steps + 1,)
    factor = 1 - t[1:] / t[:-1]  # (steps,) float32, elementwise as Dream's scalar 1 - s / t
    out = torch.zeros(n.shape[0], steps, dtype=torch.long, device=n.device)  # (B, steps)
    for i in range(first, steps):
        k = n if i == steps - 1 else (n.to(torch.float32) * factor[i]).to(torch.long)  # trunc toward 0
        out[:, i] = k
        n = n - k
    return out
