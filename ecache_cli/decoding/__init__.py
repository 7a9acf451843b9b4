"""Pure tensor functions the engine calls once per denoising step: sampling, commit rules, schedules."""

from ecache_cli.decoding.commit import COMPAT, CommitRule
from ecache_cli.decoding.remasking import (
    REMASKING,
    confidence_scores,
    select_factor,
    select_threshold,
    select_threshold_quota,
    select_topk,
    validate_remasking,
)
from ecache_cli.decoding.sampling import Sampled, sample
from ecache_cli.decoding.schedule import (
    SCHEDULES,
    BlockPlan,
    dream_num_transfer_tokens,
    num_transfer_tokens,
    plan_blocks,
)

__all__ = [
    "COMPAT",
    "REMASKING",
    "SCHEDULES",
    "BlockPlan",
    "CommitRule",
    "dream_num_transfer_tokens",
    "Sampled",
    "confidence_scores",
    "num_transfer_tokens",
    "plan_blocks",
    "sample",
    "select_factor",
    "select_threshold",
    "select_threshold_quota",
    "select_topk",
    "validate_remasking",
]
