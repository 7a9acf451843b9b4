"""Which rule commits tokens at each step of a block: the schedule, the threshold rule and compat mode.

The engine asks one :class:`CommitRule` per run for a block's per-step counts at the block start and for
each step's commits. The rules by model family (README "Samplers"):

- schedule ``llada`` (default for LLaDA): the block's masks spread evenly over its steps (LLaDA
  generate.py get_num_transfer_tokens); threshold decoding commits every candidate ≥ threshold plus
  the top-1, uncapped (Fast-dLLM llada/generate.py get_transfer_index).
- schedule ``dream`` (default for Dream): Dream's timesteps, int(n · (1 − t[i+1]/t[i])) masks per step
  (Dream generation_utils.py ``_sample``); threshold decoding under a per-step quota of block
  masks / steps plus the tokens deferred earlier, with steps added at the end until the block is
  done (Fast-dLLM dream/model/generation_utils.py, alg 'confidence_threshold'). The confidences are
  Dream's: from the temperature-scaled, top-p/top-k filtered distribution (generation_utils.py
  ``sample_tokens``; ``CommitRule.dream_alg``), where the llada schedule scores at temperature 1.
  Dream's ``alg_temp`` > 0 draws the step's positions from softmax(confidence / alg_temp) instead of
  taking the top-k, and alg ``origin`` (``--remasking origin``) reveals each mask independently with
  probability 1 − t[i+1]/t[i], every mask at the last step (both Dream generation_utils.py ``_sample``).
- compat ``fastdllm`` (Dream only; never a default): Fast-dLLM's Dream block sampler
  (dream/model/generation_utils_block.py). A block's first step commits its first position without a
  confidence check; the schedule counts the block's steps from 1; threshold decoding is uncapped.
  Fast-dLLM's block sampler scores with negative entropy whatever its ``alg``: pass
  ``--remasking entropy`` to reproduce it. It commits the first token of each block blind, a known
  quality problem, hence a compatibility mode only.

Differences from the official loops, deliberate: a step never commits a non-candidate (the official
``topk`` can pick −inf positions when k exceeds the masks), and the extended steps of the quota rule
stop when the block is done (Fast-dLLM may run forwards that commit nothing at the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from .remasking import (
    select_factor,
    select_origin,
    select_sampled,
    select_threshold,
    select_threshold_min,
    select_threshold_quota,
    select_topk,
)
from .schedule import (
    BlockPlan,
    block_num_transfer_tokens,
    dream_num_transfer_tokens,
    num_transfer_tokens,
    validate_schedule,
)

COMPAT = ("fastdllm",)


def validate_compat(name: str | None) -> str | None:
    """Check a --compat name (None or one of COMPAT). Returns it; raises UsageError naming the valid ones."""
    if name is not None and name not in COMPAT:
        raise UsageError(f"--compat {name!r} is not a compatibility mode; use fastdllm (Fast-dLLM's Dream block "
                         "sampler), the only one")
    return name


def validate_eps(eps: float) -> float:
    """Check Dream's last timestep eps ∈ [0, 1). Returns it; raises UsageError otherwise."""
    if not 0 <= eps < 1:  # also rejects NaN
        raise UsageError(f"eps {eps} must be in [0, 1): Dream's timesteps run from 1 down to eps (default 1e-3)")
    return eps


#: the official sampler of each model family (``ModelSpec.sampler``) → its default step schedule
SAMPLER_SCHEDULES = {"llada": "llada", "dream": "dream", "sdar": "block", "llada2": "block"}


def family_schedule(sampler: str, schedule: str | None) -> str:
    """The step schedule a run uses: ``schedule`` when given, else the one of the model's official sampler
    (``ModelSpec.sampler``: "dream" for Dream and the models built on it, "block" for the block-diffusion
    families SDAR and LLaDA2.x, "llada" otherwise)."""
    return schedule or SAMPLER_SCHEDULES.get(sampler, "llada")


def ignored_schedule(cfg, sampler: str) -> str | None:
    """Why ``cfg.schedule`` (a ``DecodeConfig``'s ``--schedule``) does nothing on a model whose official
    sampler is ``sampler`` (``ModelSpec.sampler``), or None when it has an effect (or is not set).

    A schedule sets per-step commit counts; threshold and factor decoding (``--threshold``, a
    block-diffusion family's default threshold, ``--factor``) commit by confidence instead, and use a
    schedule only for: the block rule's per-step minimum (``--schedule block`` with ``--steps`` giving
    fewer steps per block than its length), Dream's per-step quota (``--schedule dream`` with ``--steps``
    giving ≥ 2 steps per block, no ``--compat``) and Dream's confidences (``--schedule dream`` at
    temperature > 0 or with ``--top-k`` / ``--top-p``: :meth:`CommitRule.dream_alg`). When neither the given
    schedule nor the model's own (:func:`family_schedule`) uses any of these, the two decode alike and
    the flag is ignored: the one rule the command line warns with (``runs.settings.warn_model_rules``)
    and ``Engine.start`` warns with (``IgnoredSetting``).

    At fixed steps (no threshold or factor) ``--schedule block`` does nothing on a model whose own schedule
    is LLaDA's (LLaDA, LLaDA-MoE): its blocks start fully masked, so block's counts (block-length / steps a
    step, :func:`~.schedule.block_num_transfer_tokens`) are LLaDA's even split of the block's masks. On a
    Dream model it replaces Dream's timesteps by that split, and on the block-diffusion families it is
    their own schedule: not ignored there."""
    if cfg.schedule is None:
        return None
    if cfg.threshold is None and cfg.factor is None:
        if cfg.schedule == "block" and family_schedule(sampler, None) == "llada":
            return ("--schedule block does nothing at fixed steps on a model with LLaDA's schedule: its blocks "
                    "start fully masked, so block's counts (block-length / steps a step) are LLaDA's even split; "
                    "ignored")
        return None
    spb = None
    if cfg.steps is not None and cfg.block_length and cfg.gen_length % cfg.block_length == 0:
        spb = cfg.steps // max(cfg.gen_length // cfg.block_length, 1)

    def effect(schedule: str) -> tuple[str, bool]:
        kind = "plain"
        if cfg.factor is None and spb is not None:
            if schedule == "block" and spb < cfg.block_length:
                kind = "block minimum"
            elif schedule == "dream" and cfg.compat is None and spb > 1:
                kind = "dream quota"
        sampled = bool(cfg.temperature) or cfg.top_k is not None or cfg.top_p is not None
        return kind, schedule == "dream" and sampled and cfg.remasking not in ("random", "origin")

    own = family_schedule(sampler, None)
    if effect(cfg.schedule) != ("plain", False) or effect(own) != ("plain", False):
        return None
    rule = f"--threshold {cfg.threshold:g}" if cfg.threshold is not None else f"--factor {cfg.factor:g}"
    if cfg.schedule == "block" and _idle_block_minimum(cfg, sampler):  # --steps given, yet no minimum above one
        return f"--schedule block at --steps {cfg.steps} does nothing with {rule}: {_idle_minimum_why(cfg)}"
    return (f"--schedule {cfg.schedule} does nothing with {rule}: that rule commits by confidence, not by a "
            "schedule's counts (which count there only with --steps, as block's minimum or dream's quota, or "
            "as dream's confidences when sampling); ignored")


def ignored_steps(cfg, sampler: str) -> str | None:
    """Why ``cfg.steps`` (``--steps``) does nothing, or None when it has an effect (or is not set): under
    the factor rule, and under the threshold rule unless the run's schedule (``cfg.schedule``, else the
    model's: :func:`family_schedule`) turns the steps per block into block's per-step minimum (fewer
    steps than the block's length) or Dream's quota (≥ 2 steps a block, no ``--compat``): a threshold
    block runs until no mask is left, whatever the steps (``DecodeConfig``). Warned as
    :func:`ignored_schedule` is."""
    if cfg.steps is None or (cfg.threshold is None and cfg.factor is None):
        return None
    if cfg.factor is None and cfg.block_length and cfg.gen_length % cfg.block_length == 0:
        spb = cfg.steps // max(cfg.gen_length // cfg.block_length, 1)
        schedule = family_schedule(sampler, cfg.schedule)
        if (schedule == "block" and spb < cfg.block_length) or (schedule == "dream" and cfg.compat is None
                                                                and spb > 1):
            return None
    rule = f"--threshold {cfg.threshold:g}" if cfg.factor is None else f"--factor {cfg.factor:g}"
    if _idle_block_minimum(cfg, sampler):
        return f"--steps {cfg.steps} does nothing with {rule}: {_idle_minimum_why(cfg)}"
    return (f"--steps {cfg.steps} does nothing with {rule}: a block runs until no mask is left (steps count there "
            "only as block's per-step minimum or Dream's quota: --schedule block or dream); ignored")


def _idle_minimum_why(cfg) -> str:
    """Why block's per-step minimum does nothing under the threshold rule (:func:`_idle_block_minimum`), with
    the steps that would raise it."""
    blocks = cfg.gen_length // cfg.block_length
    fewer = (f" (fewer steps than positions a block raise it, e.g. --steps {blocks * (cfg.block_length // 2)})"
             if cfg.block_length > 1 else "")
    return (f"{cfg.steps // blocks} steps a block for its {cfg.block_length} positions make block's per-step "
            f"minimum one token, which the rule commits anyway; ignored{fewer}")


def ignored_schedule_and_steps(cfg, sampler: str, given: tuple[str, ...] = ("schedule", "steps")) -> list[str]:
    """The warnings of :func:`ignored_schedule` and :func:`ignored_steps` for the flags in ``given``, as one
    when both are given and do nothing for the same reason (block's per-step minimum of one token): the
    command line's (``runs.settings.warn_ignored_schedule``) and ``Engine.start``'s."""
    whys = {flag: rule(cfg, sampler) for flag, rule in (("schedule", ignored_schedule), ("steps", ignored_steps))
            if flag in given}
    if whys.get("schedule") and whys.get("steps") and cfg.schedule == "block" and _idle_block_minimum(cfg, sampler):
        return [whys["steps"].replace(f"--steps {cfg.steps} ", f"--steps {cfg.steps} with --schedule block ", 1)]
    return [why for why in whys.values() if why]


def _idle_block_minimum(cfg, sampler: str) -> bool:
    """Whether the run's schedule is block's (``cfg.schedule``, else the model's) under the threshold rule
    with ``--steps`` giving each block at least as many steps as its length: block's per-step minimum is
    then one token (``schedule.block_num_transfer_tokens``), which the threshold rule commits at every step
    anyway, so steps and schedule both do nothing."""
    if cfg.steps is None or cfg.threshold is None or cfg.factor is not None or not cfg.block_length:
        return False
    if cfg.gen_length % cfg.block_length or family_schedule(sampler, cfg.schedule) != "block":
        return False
    return cfg.steps // max(cfg.gen_length // cfg.block_length, 1) >= cfg.block_length


def idle_steps(cfg, sampler: str) -> str | None:
    """Why some of ``cfg.steps`` (``--steps``) never run, or None: under LLaDA's schedule (``cfg.schedule``,
    else the model's: :func:`family_schedule`) with no threshold or factor rule, a block given more steps
    than it has masks commits one a step from the first step on, so its masks are gone after
    ``block_length`` steps and the engine moves on (LLaDA generate.py runs the empty steps; the tokens are
    the same). Dream's schedule spreads its commits over every step. Warned as :func:`ignored_schedule` is."""
    if cfg.steps is None or cfg.threshold is not None or cfg.factor is not None or not cfg.block_length:
        return None
    if family_schedule(sampler, cfg.schedule) != "llada":
        return None
    per_block = cfg.steps // max(cfg.gen_length // cfg.block_length, 1)
    if per_block <= cfg.block_length:
        return None
    return (f"--steps {cfg.steps} gives each block {per_block} steps for its {cfg.block_length} masks; LLaDA's "
            f"schedule commits them in the first {cfg.block_length}, so at most {cfg.gen_length} steps run "
            f"(--steps {cfg.gen_length} is the same decoding)")


def ignored_sampling(cfg, sampler: str | None, given: tuple[str, ...] | None = None) -> str | None:
    """Why ``--top-k`` / ``--top-p`` (``given``: the flags named; None: those ``cfg`` sets) do nothing, or
    None: at temperature 0 under LLaDA's rules greedy decoding never samples and LLaDA's confidence is the
    unfiltered probability, so the decoder drops them; Dream's rules keep them (they filter Dream's
    confidence). The rules are ``cfg.schedule``, else those of the model's official sampler (``sampler``;
    None: not known yet, LLaDA's)."""
    if given is None:
        given = tuple(f for f, v in (("--top-k", cfg.top_k), ("--top-p", cfg.top_p)) if v is not None)
    if not given or cfg.temperature or family_schedule(sampler or "llada", cfg.schedule) == "dream":
        return None
    return (f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} nothing at temperature 0 with LLaDA's "
            "rules (greedy decoding); ignored; pass --temperature > 0 to sample (with a Dream model's schedule, "
            "--schedule dream, they filter Dream's confidence)")


def warn_ignored_settings(cfg, sampler: str) -> None:
    """Warn (``errors.IgnoredSetting``, through ``warnings``: the library's way) about each decode setting of
    ``cfg`` that has no effect with the others given on a model whose official sampler is ``sampler``:
    :func:`ignored_schedule`, :func:`ignored_steps`, :func:`idle_steps`, :func:`ignored_sampling`, the rules
    the command line warns with on its stderr (``runs.settings.warn_ignored_schedule``, ``warn_idle_steps``,
    ``warn_sampling_flags``). Called by ``Engine.start``."""
    import warnings

    from ..errors import IgnoredSetting

    for why in (*ignored_schedule_and_steps(cfg, sampler), idle_steps(cfg, sampler), ignored_sampling(cfg, sampler)):
        if why:
            warnings.warn(why, IgnoredSetting, stacklevel=4)


def check_dream_options(*, remasking: str, alg_temp: float | None, schedule: str | None, parallel: bool,
                        compat: str | None, low_eos_confidence: bool = False) -> None:
    """Check Dream's alg_temp and alg 'origin' against the rest of the decode settings.

    README's rule "dream schedule only": any other schedule (llada, LLaDA's; block, the block-diffusion
    families') refuses both, naming the schedule.

    Both are rules of Dream's fixed-step sampler (Dream generation_utils.py ``_sample``): alg_temp > 0
    samples the positions from softmax(confidence / alg_temp), so it needs a confidence alg
    (low_confidence / maskgit_plus, topk_margin, entropy) and the dream schedule; 'origin' reveals each
    mask with probability 1 − t[i+1]/t[i] on Dream's timesteps. ``schedule`` None = not known yet (the
    CLI checks before the model, hence its family, is loaded): the checks that need it are skipped.

    Raises:
        UsageError (one line): alg_temp < 0 or not finite; alg_temp > 0 with --threshold / --factor, with
            remasking random / origin, or with a schedule other than dream; origin with a schedule other
            than dream, with
            --compat fastdllm (Fast-dLLM's block sampler has no origin) or with --low-eos-confidence.
    """
    if alg_temp is not None and not 0 <= alg_temp < float("inf"):  # also rejects NaN
        raise UsageError(f"--alg-temp {alg_temp} must be a finite number ≥ 0 (0 = the top-scoring positions, "
                         "Dream's default)")
    if alg_temp:
        if parallel:
            raise UsageError("--alg-temp samples the positions of Dream's fixed-step schedule; --threshold / --factor "
                             "choose them by confidence: drop one")
        if remasking in ("random", "origin"):
            raise UsageError(f"--alg-temp samples positions by their confidence; --remasking {remasking} has none "
                             "(Dream ignores alg_temp there): use maskgit_plus, topk_margin or entropy, "
                             "or drop --alg-temp")
        check_alg_temp_schedule(alg_temp, schedule)
    if remasking == "origin":
        if schedule not in (None, "dream"):
            raise UsageError("--remasking origin is Dream's alg on Dream's timesteps: use it with --schedule dream "
                             f"(the {_SCHEDULE_OF[schedule]} has its own steps)")
        if compat == "fastdllm":
            raise UsageError("--compat fastdllm: Fast-dLLM's block sampler has no origin alg (it scores by negative "
                             "entropy): use --remasking entropy")
        if low_eos_confidence:
            raise UsageError("--low-eos-confidence lowers a confidence; --remasking origin reveals positions at "
                             "random: drop one")


def check_alg_temp_schedule(alg_temp: float | None, schedule: str | None) -> None:
    """Refuse a non-zero ``--alg-temp`` (any value but 0 and None, out of its range too) on a schedule other
    than Dream's (``schedule`` None = not known yet: passes). Checked before the value's range where the
    model's family is known (``config.check_ranges``), so that no range message suggests a value the same
    command then refuses. UsageError naming the schedule."""
    if alg_temp is not None and alg_temp != 0 and schedule not in (None, "dream"):
        raise UsageError(f"--alg-temp is a rule of Dream's sampler: use it with --schedule dream (the "
                         f"{_SCHEDULE_OF[schedule]} picks the top-scoring positions)")


#: each schedule as the errors name it
_SCHEDULE_OF = {"llada": "llada schedule, LLaDA's default,", "block": "block schedule, the block-diffusion "
                "families' default,"}
#: why --compat fastdllm does not apply to a model of each sampler other than Dream's
_OWN_SAMPLER = {"llada": "LLaDA already decodes as Fast-dLLM's LLaDA generators",
                "sdar": "an SDAR model decodes with SDAR's own block-diffusion sampler",
                "llada2": "a LLaDA2 model decodes with LLaDA2's own block-diffusion sampler"}


def check_sampler_options(sampler: str, *, schedule: str | None, compat: str | None, remasking: str,
                          alg_temp: float | None, parallel: bool, low_eos_confidence: bool = False) -> str:
    """The decode options that depend on the model's official sampler (``ModelSpec.sampler``; a family's
    ``sampler``): the schedule it runs (``family_schedule``), Dream's alg_temp / origin on it
    (``check_dream_options``) and ``--compat fastdllm`` (Fast-dLLM's Dream block sampler: a Dream model and
    the dream schedule only). One rule for every path: ``runs.settings`` checks it before the model loads
    when the family is known there, ``CommitRule.resolve`` at build. Returns the schedule; raises the
    one-line UsageError, naming the model's own sampler."""
    schedule = validate_schedule(family_schedule(sampler, schedule))
    compat = validate_compat(compat)
    check_dream_options(remasking=remasking, alg_temp=alg_temp, schedule=schedule, parallel=parallel,
                        compat=compat, low_eos_confidence=low_eos_confidence)
    if compat == "fastdllm":
        if sampler != "dream":
            why = _OWN_SAMPLER.get(sampler, f"a {sampler} model decodes with its own sampler")
            raise UsageError(f"--compat fastdllm reproduces Fast-dLLM's Dream block sampler; {why}: drop --compat")
        if schedule != "dream":
            raise UsageError(f"--compat fastdllm uses Dream's schedule: drop --schedule {schedule}")
    return schedule


def _scheduled(schedule: torch.Tensor, sib: torch.Tensor) -> torch.Tensor:
    """(B,) long: each row's scheduled count at its step in block ``sib`` (B,) (the last column past the end)."""
    return schedule.gather(1, sib.clamp(0, schedule.shape[1] - 1)[:, None]).squeeze(1)


def _origin_p_transfer(steps: int, eps: float, i: torch.Tensor) -> torch.Tensor:
    """Dream alg 'origin' at steps i (B,) long of ``steps``: p = 1 − t[i+1]/t[i], t = linspace(1, eps, steps + 1)
    in float32 (as Dream computes it), 1 at the last step (generation_utils.py ``_sample``). Returns (B, 1)
    float64 (the float32 values, widened exactly)."""
    t = torch.linspace(1, eps, steps + 1, dtype=torch.float32, device=i.device)
    j = i.clamp(0, steps - 1)
    p = (1 - t[(j + 1).clamp_max(steps)] / t[j]).double()
    return torch.where(i >= steps - 1, torch.ones_like(p), p)[:, None]


@dataclass(frozen=True)
class CommitRule:
    """The commit rule of one run, resolved from the decode settings and the model family.

    schedule: "llada" | "dream". compat: None | "fastdllm". threshold / factor: the parallel rules
    (None = fixed-step decoding). eps: Dream's last timestep. steps_per_block: the plan's (None =
    threshold/factor decoding without --steps). block_length: tokens per block. alg_temp: Dream's
    (None or 0 = top-k; > 0 = positions sampled, ``select_sampled``). origin: Dream's alg 'origin'
    (``select_origin``). Under the dream schedule the confidences are Dream's (``dream_alg``).
    """

    schedule: str
    compat: str | None
    threshold: float | None
    factor: float | None
    eps: float
    steps_per_block: int | None
    block_length: int
    alg_temp: float | None = None
    origin: bool = False

    @classmethod
    def resolve(cls, sampler: str, plan: BlockPlan, *, schedule: str | None, compat: str | None,
                threshold: float | None, factor: float | None, eps: float, remasking: str = "low_confidence",
                alg_temp: float | None = None, low_eos_confidence: bool = False) -> "CommitRule":
        """Build the rule: ``schedule`` None takes the model's official sampler's (``ModelSpec.sampler``:
        "dream" for the Dream models, else "llada").

        Raises:
            UsageError: alg_temp / origin misused (``check_dream_options``); unknown schedule or compat;
                --compat fastdllm on a LLaDA model, with the
                llada schedule, or with one step per block (Fast-dLLM's block sampler then leaves the
                block's other masks unfilled); the dream threshold quota with a block length that is
                not a multiple of the steps per block (Fast-dLLM asserts masks % steps == 0).
        """
        eps = validate_eps(eps)
        schedule = check_sampler_options(sampler, schedule=schedule, compat=compat, remasking=remasking,
                                         alg_temp=alg_temp, parallel=threshold is not None or factor is not None,
                                         low_eos_confidence=low_eos_confidence)
        spb = plan.steps_per_block
        if compat == "fastdllm":
            if threshold is None and factor is None and spb == 1:
                raise UsageError("--compat fastdllm needs ≥ 2 steps per block (step 1 commits only the block's "
                                 "first position): raise --steps")
        rule = cls(schedule=schedule, compat=compat, threshold=threshold, factor=factor, eps=eps,
                   steps_per_block=spb, block_length=plan.block_length, alg_temp=alg_temp or None,
                   origin=remasking == "origin")
        if rule.quota and plan.block_length % spb != 0:
            raise UsageError(
                f"--threshold with Dream's schedule commits block-length/steps-per-block tokens per step "
                f"(Fast-dLLM): --block-length {plan.block_length} is not a multiple of the {spb} steps per "
                f"block; choose --steps so that it is (e.g. --steps {plan.num_blocks} for one step per block)")
        return rule

    @property
    def quota(self) -> bool:
        """True when threshold decoding runs under Dream's per-step quota (schedule dream, no compat)."""
        return self.threshold is not None and self.schedule == "dream" and self.compat is None \
            and self.steps_per_block is not None and self.steps_per_block > 1

    def dream_alg(self, remasking: str) -> str | None:
        """The alg whose Dream confidence ``sample`` must compute (its ``dream_alg``), or None.

        Under the dream schedule (Dream's rules, the Dream default) a step scores with Dream's confidence
        (generation_utils.py ``sample_tokens``: from the temperature-scaled, top-p/top-k filtered
        distribution); low_confidence is Dream's maskgit_plus. Under the llada schedule, and for random /
        origin, None: the temperature-1 scores (LLaDA generate.py low_confidence).
        """
        if self.schedule != "dream" or remasking in ("random", "origin"):
            return None
        return "maskgit_plus" if remasking == "low_confidence" else remasking

    def block_schedule(self, mask_count: torch.Tensor) -> torch.Tensor | None:
        """Per-step commit counts of a block from its mask count at the block start.

        Args:
            mask_count: LongTensor (B,), masks of the block per row.
        Returns:
            LongTensor (B, steps_per_block), or None in threshold/factor decoding (no fixed counts) and
            under origin (each mask is revealed at random; the block still ends after its steps, since
            the last one commits every mask). Under compat fastdllm column 0 is the forced commit of the
            block's first position (1).
        """
        if self.schedule == "block" and self.factor is None:  # the threshold rule's minimum too
            return block_num_transfer_tokens(mask_count.shape[0], self.block_length,
                                             self.steps_per_block or self.block_length, mask_count.device)
        if self.threshold is not None or self.factor is not None or self.origin:
            return None
        spb = self.steps_per_block
        if self.schedule == "llada":
            return num_transfer_tokens(mask_count, spb)
        if self.compat == "fastdllm":
            out = dream_num_transfer_tokens(mask_count - 1, spb, self.eps, first=1)  # (B, spb)
            out[:, 0] = 1
            return out
        return dream_num_transfer_tokens(mask_count, spb, self.eps)

    def select(self, conf: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, schedule: torch.Tensor | None,
               step_in_block: torch.Tensor, block_start: torch.Tensor,
               noise: torch.Tensor | None = None) -> torch.Tensor:
        """The commits of one step; every row at its own block and step.

        Args:
            conf: float64 (B, R) confidence of each target, −inf at non-candidates (origin: the reveal
                draws U[0, 1)).
            targets: LongTensor (B, R) canvas positions of the rows' block masks (padded), ascending per row.
            valid: (B, R) bool, real targets.
            schedule: (B, steps_per_block) long each row's ``block_schedule``, or None.
            step_in_block: (B,) long each row's 0-based step within its block. block_start: (B,) long
                canvas position of each row's block start.
            noise: float64 (B, R) U[0, 1), needed with alg_temp > 0 (the Gumbel keys of ``select_sampled``).
        Returns:
            BoolTensor (B, R), True = commit.
        """
        sib = step_in_block
        if self.origin:  # Dream alg 'origin': every mask revealed with probability 1 − t[i+1]/t[i]
            return select_origin(conf, _origin_p_transfer(self.steps_per_block, self.eps, sib))
        out = self._select_rest(conf, valid, schedule, sib, noise)
        if self.compat == "fastdllm":  # generation_utils_block.py: a block's first step sets x[:, s] = x0[:, s]
            first = (targets == block_start[:, None]) & valid
            out = torch.where((sib == 0)[:, None], first, out)
        return out

    def _select_rest(self, conf, valid, schedule, sib, noise) -> torch.Tensor:
        """The threshold, factor, sampled or top-k commits (``select`` without origin and the compat first step)."""
        if self.threshold is not None and self.schedule == "block":
            return select_threshold_min(conf, self.threshold, _scheduled(schedule, sib))
        if self.threshold is not None:
            plain = select_threshold(conf, self.threshold)
            if not self.quota:
                return plain
            # Fast-dLLM: quota q = masks/steps per step plus the deferred ones, i.e. (i + 1)·q minus what
            # the block has committed; from the last scheduled step on, every remaining mask
            q = self.block_length // self.steps_per_block
            committed = self.block_length - valid.sum(1)  # (B,) the block started fully masked
            quota = select_threshold_quota(conf, self.threshold, (sib + 1) * q - committed)
            return torch.where((sib < self.steps_per_block - 1)[:, None], quota, plain)
        if self.factor is not None:
            return select_factor(conf, self.factor)
        k = _scheduled(schedule, sib)
        if self.alg_temp:  # Dream alg_temp > 0: torch.multinomial(softmax(conf / alg_temp), k) in Dream
            assert noise is not None, "alg_temp > 0 needs the step's noise"
            return select_sampled(conf, k, self.alg_temp, noise)
        return select_topk(conf, k)
