"""LLaDA2.1's token editing: a step may also rewrite tokens of the current block committed earlier.

The official LLaDA2.1 ``generate`` (dllm ``pipelines/llada21``; docs/MODELS.md §10): in every step of a
block, besides filling masks (mask → token: the threshold rule with at least one commit), every position
of the block that is neither a mask nor the prompt's (a prompt's last tokens share the first decoded
block) and whose new argmax differs from its token with probability above the editing threshold is
rewritten (token → token). Once the block has no mask left at the start of a step, that step only
edits; the block ends after such a step that edits nothing, or after ``max_post_steps`` of them.
Earlier blocks are never edited, so the block-causal cache of finished blocks stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenEditing:
    """The editing rule of a run: ``threshold`` (the official ``editing_threshold``, a probability: a token
    is rewritten when its new argmax's probability exceeds it, strictly) and ``max_post_steps`` (mask-free
    steps a block may take, the official default 16)."""

    threshold: float
    max_post_steps: int = 16

    @staticmethod
    def targets(state) -> torch.Tensor:
        """(B, T) bool: the positions a step may write: the current block's generated positions (its masks
        and the tokens committed in it), never the prompt's or the padding after a row's last block."""
        pos = torch.arange(state.length, device=state.tokens.device)[None, :]
        return state.in_block() & state.key_mask & (pos >= state.prompt_len)

    def edits(self, sampled, targets: torch.Tensor, editable: torch.Tensor, state) -> torch.Tensor:
        """(B, R) bool: the targets to rewrite: ``editable`` (B, R) bool (real, not masks) whose proposal
        ``sampled.x0`` differs from the canvas token with ``sampled.prob`` above the threshold."""
        current = state.tokens.gather(1, targets)  # (B, R)
        return editable & (sampled.prob > self.threshold) & (sampled.x0 != current)

    def block_done(self, state, had_masks: torch.Tensor, edited: torch.Tensor) -> torch.Tensor:
        """(B,) bool: rows whose block ends with this step, given whether each row's block held masks when the
        step began (``had_masks``) and whether the step rewrote a token (``edited``). Counts the block's
        mask-free steps in ``state.mask_free_steps``."""
        free = ~had_masks
        state.mask_free_steps = state.mask_free_steps + free.long()
        limit = state.mask_free_steps >= self.max_post_steps
        # a model that keeps proposing the mask id makes no progress: the official loop would not end, here the
        # block ends after that many steps (its masks stay; an answer holding them ends there)
        stuck = state.step_in_block + 1 >= self.step_cap(state.block_length)
        if self.max_post_steps == 0:  # no mask-free step at all: the block ends with its last mask
            return ~state.block_masked().any(1) | stuck
        return free & (~edited | limit) | stuck

    def step_cap(self, block_length: int) -> int:
        """The most steps a block takes: 4 per position plus the mask-free ones (the official loop has no cap)."""
        return 4 * block_length + self.max_post_steps
