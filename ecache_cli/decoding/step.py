"""One step's sampling and commits: from the step's logits to the tokens each row commits.

The run's sampling settings (temperature, top-k/p, banned ids), its remasking scores and its
:class:`~ecache_cli.decoding.commit.CommitRule` in one object, so the engine hands over logits and
gets commits back. The family rules live here and in ``commit.py``: Dream's confidences and draws
(``CommitRule.dream_alg``, alg_temp, origin) and LLaDA's ``confidence_eos_eot_inf``
(``low_eos_confidence``: an EOS/EOT candidate scores 0, LLaDA generate.py).

Random draws come from ``draw(*tail)``, which the engine binds to each row's own generator, in a
fixed order per step: token noise (temperature > 0), the random / origin scores, the alg_temp keys.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import UsageError
from .commit import CommitRule
from .editing import TokenEditing
from .remasking import confidence_scores, validate_remasking
from .sampling import Sampled, sample
from .schedule import BlockPlan, default_steps, plan_blocks


def check_edit_threshold(edit_threshold: float | None, block_causal: bool, family: str) -> None:
    """Refuse ``--edit-threshold`` (LLaDA2.1's token editing: it re-opens committed tokens of the current
    block, which only a block-diffusion model's block-causal attention supports) on a model family that
    attends bidirectionally. Raises UsageError naming the family; checked by ``StepDecoder.build`` and,
    where the family is known before loading, by ``runs.settings.resolve_settings``."""
    if edit_threshold is not None and not block_causal:
        raise UsageError(f"--edit-threshold is LLaDA2.1's token editing, for block-diffusion models; the "
                         f"{family} model family attends bidirectionally: drop it")


class StepDecoder:
    """Samples a step's logits and chooses its commits.

    cfg: the run's ``DecodeConfig``. rule: its ``CommitRule``. banned: (K,) long ids never sampled (the
    mask id and vocabulary rows the tokenizer lacks); end_ids: (E,) long EOS/EOT ids (banned too with
    ``cfg.ban_eos``).
    """

    def __init__(self, cfg, rule: CommitRule, banned: torch.Tensor, end_ids: torch.Tensor, blocks: BlockPlan):
        self.cfg, self.rule, self.end_ids, self.blocks = cfg, rule, end_ids, blocks
        self.banned = torch.cat([banned, end_ids]) if cfg.ban_eos else banned
        self._scores_drawn = cfg.remasking in ("random", "origin")
        # Greedy decoding under LLaDA's rules ignores top-k/top-p: the argmax is the same and LLaDA's confidence
        # is the unfiltered probability. Dream's rules keep them at temperature 0: its confidence is taken from
        # the filtered distribution (generation_utils.py sample_tokens).
        self.dream_alg = rule.dream_alg(cfg.remasking)  # the alg whose Dream confidence sample() computes, or None
        keep = cfg.temperature > 0 or self.dream_alg is not None
        self.top_k, self.top_p = (cfg.top_k, cfg.top_p) if keep else (None, None)
        self.draws = cfg.temperature > 0 or self._scores_drawn or bool(rule.alg_temp)
        self.editing = None if cfg.edit_threshold is None else TokenEditing(cfg.edit_threshold, cfg.max_post_steps)

    @classmethod
    def build(cls, cfg, spec, banned: torch.Tensor, end_ids: torch.Tensor) -> "StepDecoder":
        """The decoder of a run with settings ``cfg`` on a model with ``spec``: its block plan (``.blocks``)
        and commit rule (``.rule``). Raises UsageError for settings that do not go together (the
        remasking under parallel decoding, --threshold with --factor, ``CommitRule.resolve``'s checks)."""
        parallel = cfg.parallel
        validate_remasking(cfg.remasking, parallel=parallel)
        check_edit_threshold(cfg.edit_threshold, spec.block_causal, spec.family)
        if cfg.threshold is not None and cfg.factor is not None:
            raise UsageError("--threshold and --factor are two parallel-decoding rules; pass only one")
        blocks = plan_blocks(cfg.gen_length, cfg.block_length, default_steps(cfg.gen_length, cfg.steps, parallel),
                             parallel)
        rule = CommitRule.resolve(spec.sampler, blocks, schedule=cfg.schedule, compat=cfg.compat,
                                  threshold=cfg.threshold, factor=cfg.factor,
                                  eps=spec.eps if cfg.eps is None else cfg.eps, remasking=cfg.remasking,
                                  alg_temp=cfg.alg_temp, low_eos_confidence=cfg.low_eos_confidence)
        return cls(cfg, rule, banned, end_ids, blocks)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, state,
                 draw: Callable[..., torch.Tensor],
                 produced: torch.Tensor | None = None) -> tuple[Sampled, torch.Tensor]:
        """Sample ``logits`` (B, R, V) for ``targets`` (B, R) long (``valid`` (B, R) bool real ones) and
        choose the commits under ``state``'s per-row schedule, steps and blocks. ``draw(*tail)`` returns
        U[0, 1) float64 (B, R, *tail). ``produced`` (B, R) bool: the targets that got logits this step
        (None = all); the others are no candidates, but still count as the block's masks (the draws and
        Dream's threshold quota see ``valid``). Only the real targets are sampled (a padding entry repeats
        its row's first target's outputs); each row's draws are the same as unpadded. Returns (sampled,
        commit (B, R) bool)."""
        cand = valid if produced is None else valid & produced
        chosen = valid  # the targets the commit rule chooses among (with editing: the masks; all are sampled)
        if self.editing is not None:
            is_mask = state.masked.gather(1, targets)  # (B, R)
            chosen, cand, editable = valid & is_mask, cand & is_mask, cand & ~is_mask
        cfg, rule = self.cfg, self.rule
        noise = draw(logits.shape[-1]) if cfg.temperature > 0 else None
        # padded targets (rows with fewer masks than the widest): sample the real ones; one row has none
        packed = valid.shape[0] > 1 and int(valid.sum()) < valid.numel()
        if packed:
            logits, noise = logits[valid][None], None if noise is None else noise[valid][None]  # (1, K, V)
        sampled = sample(logits, temperature=cfg.temperature, top_k=self.top_k, top_p=self.top_p, generator=None,
                         banned_ids=self.banned, uniform=noise, dream_alg=self.dream_alg)
        if packed:
            sampled = sampled.spread(valid)
        del noise
        rand = draw() if self._scores_drawn else None  # (B, R)
        conf = confidence_scores(cfg.remasking, sampled, None, uniform=rand)  # (B, R) float64
        if cfg.low_eos_confidence:  # LLaDA confidence_eos_eot_inf: probability 0, still selectable
            conf = conf.masked_fill(torch.isin(sampled.x0, self.end_ids), 0.0)
        conf = conf.masked_fill(~cand, float("-inf"))
        keys = draw() if rule.alg_temp else None  # (B, R)
        commit = rule.select(conf, targets, chosen, state.schedule, state.step_in_block, state.block_start, noise=keys)
        if self.editing is not None:
            return sampled, commit & cand | self.editing.edits(sampled, targets, editable, state)
        return sampled, commit & cand

    def targets(self, state) -> torch.Tensor:
        """(B, T) bool: the positions a step samples and may write: each row's current-block masks (with
        token editing, also the tokens committed in its block: ``TokenEditing.targets``)."""
        return state.block_masked() if self.editing is None else self.editing.targets(state)

    def block_done(self, state, had_masks: torch.Tensor | None, edited: torch.Tensor) -> torch.Tensor:
        """(B,) bool: rows whose block ends with the step just applied: no mask left, or a fixed schedule's
        steps taken (with token editing: ``TokenEditing.block_done``). ``had_masks`` / ``edited`` (B,) bool:
        the block held masks when the step began / the step rewrote a committed token (``had_masks`` is
        None without editing, the only rule that reads it)."""
        if self.editing is not None:
            return self.editing.block_done(state, had_masks, edited)
        done = ~state.block_masked().any(1)
        if state.schedule is not None:
            done = done | (state.step_in_block + 1 >= state.schedule.shape[1])
        return done
